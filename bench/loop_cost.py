"""The event loop's own CPU per turn and per chunk under a burst of new turns, in-process: no sockets, no client.

N sessions (the real `gateway.session.Session`, the paced stand-in engine of bench/paced_engine.py ticked by hand, a
sink that serialises what it is given) each get a paragraph (bench/gateway_load.py's) in one text.append +
context.end, all handled back to back as a burst's messages are. The loop thread's CPU (time.thread_time) is read
per phase and divided by N:
- handler: the burst's message handlers (what the k-th turn's text waits for, k handlers), split into pre_submit
  (a text.append's handler up to its engine request's return from `generate`: parse, the turn opened, its first cut)
  and post_submit (the rest of the handlers: the context.end's too);
- after_burst: what runs right after them (work the handlers queued or deferred to the loop's lane,
  `gateway.loop_lanes`, each turn's tasks' first steps);
- first_chunk: one engine tick gives every turn its first chunk, until every turn's first frame is written;
- later_chunk: per chunk, over a few ticks once the first chunks are out.
The socket benchmark (gateway_load.py --spawn-server) measures latency end to end; this isolates the loop's work,
which a shared machine's noise hides there.

--link: as in a front process of `voxgate serve --fronts N`, the sessions' engine is the real `RemoteEngine` over the
real link to an `EngineHost` in a child process (bench/paced_host.py: the same paced stand-in behind it, ticked by
a signal), so the phases include the front's requests (checked, tokenized, built into specs, written to the link)
and its chunks (read off the link and its audio ring). The child's CPU is not counted: it is the host's.
--segmenter: also the segmenter's share of the handler and after_burst phases (`gateway.text`, measured on its own).

    python bench/loop_cost.py --sessions 128 --format opus --runs 3 --json out.json
    python bench/loop_cost.py --sessions 128 --format opus --runs 3 --link --segmenter
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_load import TEXTS  # noqa: E402
from paced_engine import PacedEngine  # noqa: E402

from gateway import protocol as p  # noqa: E402
from gateway.audio import OutputFormat  # noqa: E402
from gateway.encode_procs import EncodeProcs  # noqa: E402
from gateway.encode_site import encode_site, start_encoders  # noqa: E402
from gateway.loop_lanes import lane  # noqa: E402
from gateway.session import Session, SessionConfig  # noqa: E402
from gateway.text.segmenter import Segment, Segmenter  # noqa: E402

LATER_TICKS = 5
TICK_WAIT_S = 0.2  # after a hand-made tick: every chunk encoded (Opus in the pool's threads) and written


class Sink:
    """A session's EventSink that serialises what it gets (as the native sink does) and notes each turn's first
    frame; `all_first` is set when every sink of the run has written one."""

    def __init__(self, run: Run):
        self.run = run
        self.first_at: float | None = None
        self.frames = 0

    async def message(self, msg: p.ServerMessage) -> None:
        msg.encode()

    async def audio(self, packets: p.AudioPackets) -> None:
        packets.encode()
        self.frames += len(packets.payloads)
        if self.first_at is None:
            self.first_at = time.perf_counter()
            self.run.waiting -= 1
            if not self.run.waiting:
                self.run.all_first.set()

    def send_ready(self) -> bool:
        return True

    async def close(self, code: int, reason: str) -> None:
        pass

    def abort(self) -> None:
        pass


class Run:
    def __init__(self, sessions: int):
        self.waiting = sessions
        self.all_first = asyncio.Event()


class SubmitClock:
    """When the last engine request went out (loop-thread CPU, time.thread_time, after `Session._start` returned):
    `Session._start` wrapped while a run lasts."""

    def __init__(self) -> None:
        self.at = 0.0

    @contextmanager
    def installed(self) -> Iterator[SubmitClock]:
        start = Session._start

        @functools.wraps(start)
        def timed(*args: Any, **kwargs: Any) -> Any:
            try:
                return start(*args, **kwargs)
            finally:
                self.at = time.thread_time()

        Session._start = timed  # type: ignore[method-assign]
        try:
            yield self
        finally:
            Session._start = start  # type: ignore[method-assign]


class SegmenterClock:
    """The loop thread's CPU inside the segmenter (`gateway.text`, whose cost is measured on its own): its methods
    wrapped while a run lasts (~1 us per call added)."""

    METHODS = ((Segmenter, ("__init__", "push", "release", "flush", "end", "poll", "next_deadline",
                            "set_queued_audio_ms")), (Segment, ("speak", "shown")))

    def __init__(self) -> None:
        self.total = 0.0

    @contextmanager
    def installed(self) -> Iterator[SegmenterClock]:
        saved = [(cls, name, cls.__dict__[name]) for cls, names in self.METHODS for name in names]
        for cls, name, fn in saved:
            setattr(cls, name, self._timed(fn))
        try:
            yield self
        finally:
            for cls, name, fn in saved:
                setattr(cls, name, fn)

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.thread_time() - t0
        return timed


def tick_now(engine: PacedEngine) -> None:
    """One engine step now (its own timer's, `tick_ms` away, is dropped)."""
    if engine._ticker is not None:
        engine._ticker.cancel()
    engine._tick()


@contextmanager
def paced_host() -> Iterator[tuple[str, Callable[[], None]]]:
    """bench/paced_host.py in a child process: (its socket path, a function that makes it tick once)."""
    with tempfile.TemporaryDirectory(prefix="voxgate-loop-cost-") as tmp:
        path = os.path.join(tmp, "host.sock")
        child = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parent / "paced_host.py"), path,
                                  os.path.join(tmp, "model")], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert child.stdout is not None
            if child.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"bench/paced_host.py did not start (exit code {child.wait()})")
            yield path, lambda: os.kill(child.pid, signal.SIGUSR1)
        finally:
            child.terminate()
            child.wait(10)


async def burst(sessions: int, fmt: str, host: tuple[str, Callable[[], None]] | None = None,
                seg: SegmenterClock | None = None) -> dict[str, Any]:
    """One burst of `sessions` new turns; loop-thread CPU per phase (us per turn / per chunk). `host`: over the
    link to that host (`paced_host`), else to the paced stand-in in this loop; `seg`: the segmenter's share too."""
    link = None
    if host is None:
        engine: Any = PacedEngine(tick_ms=1e6)  # ticked by hand below
        tick = functools.partial(tick_now, engine)
    else:
        from gateway.link import connect

        link = await connect(host[0], 1)
        engine, tick = link.engine, host[1]
    start_encoders()  # as a serving process does once it listens: no encoder process starts inside the burst
    site = encode_site(OutputFormat.from_dict({"format": fmt}))
    if isinstance(site, EncodeProcs):
        await site.open_counts()  # every encoder process is up and answering
    run = Run(sessions)
    sinks = [Sink(run) for _ in range(sessions)]
    config = SessionConfig(limits=p.Limits(idle_timeout_s=3600.0))
    clients = [Session(engine, sink, config) for sink in sinks]
    for session in clients:
        session.open()
        await session.receive(json.dumps({"type": "session.start", "output": {"format": fmt}}))
    appends = [json.dumps({"type": "text.append", "context_id": "c", "text": TEXTS[i % len(TEXTS)]})
               for i in range(sessions)]
    end = json.dumps({"type": "context.end", "context_id": "c"})
    await asyncio.sleep(0.05)
    gc.collect()
    s0 = seg.total if seg else 0.0
    pre_submit = 0.0
    with SubmitClock().installed() as submit:
        c0 = time.thread_time()
        for session, append in zip(clients, appends, strict=True):
            before = time.thread_time()
            await session.receive(append)
            pre_submit += submit.at - before
            await session.receive(end)
        c1, s1 = time.thread_time(), seg.total if seg else 0.0
    deferred = lane()
    while deferred._items:  # the work deferred to the loop's lane (all of it: no socket has a message waiting)
        await asyncio.sleep(0)
    for _ in range(3):  # what the handlers queued, then the turns' tasks up to their first engine read
        await asyncio.sleep(0)
    c2, s2 = time.thread_time(), seg.total if seg else 0.0
    t_tick = time.perf_counter()
    tick()
    await run.all_first.wait()
    c3 = time.thread_time()
    firsts = sorted((s.first_at or t_tick) - t_tick for s in sinks)
    await asyncio.sleep(TICK_WAIT_S)
    frames0, c4 = sum(s.frames for s in sinks), time.thread_time()
    for _ in range(LATER_TICKS):
        tick()
        await asyncio.sleep(TICK_WAIT_S)
    c5, frames1 = time.thread_time(), sum(s.frames for s in sinks)
    for session in clients:
        await session.close()
    await engine.stop()
    if link is not None:
        await link.close()
    us = 1e6 / sessions
    return {"handler_us_per_turn": round((c1 - c0) * us, 1), "pre_submit_us_per_turn": round(pre_submit * us, 1),
            "post_submit_us_per_turn": round((c1 - c0 - pre_submit) * us, 1),
            "after_burst_us_per_turn": round((c2 - c1) * us, 1),
            "first_chunk_us_per_turn": round((c3 - c2) * us, 1),
            "later_chunk_us_per_chunk": round((c5 - c4) * us / LATER_TICKS, 1),
            "first_frame_ms_p50": round(firsts[len(firsts) // 2] * 1e3, 2),
            "first_frame_ms_max": round(firsts[-1] * 1e3, 2),
            "later_frames_per_chunk": round((frames1 - frames0) / (LATER_TICKS * sessions), 2),
            **({"handler_segmenter_us_per_turn": round((s1 - s0) * us, 1),
                "after_burst_segmenter_us_per_turn": round((s2 - s1) * us, 1)} if seg else {})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=128)
    ap.add_argument("--format", default="opus", choices=("opus", "pcm_s16le", "mulaw", "alaw"))
    ap.add_argument("--runs", type=int, default=3, help="bursts, each in a fresh event loop; the medians are reported")
    ap.add_argument("--link", action="store_true", help="as a front: over the link to an engine host process")
    ap.add_argument("--segmenter", action="store_true", help="also time the segmenter's share of the burst's phases "
                    "(its methods wrapped: ~1 us per call added)")
    ap.add_argument("--json", type=Path, help="write the runs and medians here")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        host = stack.enter_context(paced_host()) if args.link else None
        seg = stack.enter_context(SegmenterClock().installed()) if args.segmenter else None
        runs = [asyncio.run(burst(args.sessions, args.format, host, seg)) for _ in range(args.runs)]
    median = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    print(json.dumps(median))
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "loop_cost", "command": " ".join(sys.argv),
                                         "sessions": args.sessions, "format": args.format, "link": args.link,
                                         "median": median,
                                         "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
