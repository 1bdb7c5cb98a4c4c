"""The event loop's own CPU per turn and per chunk under a burst of new turns, in-process: no sockets, no client.

N sessions (the real `gateway.session.Session`, the paced stand-in engine of bench/paced_engine.py ticked by hand, a
sink that serialises what it is given) each get a paragraph (bench/gateway_load.py's) in one text.append +
context.end, all handled back to back as a burst's messages are. The loop thread's CPU (time.thread_time) is read
per phase and divided by N:
- handler: the burst's message handlers (what the k-th turn's text waits for, k handlers);
- after_burst: what runs right after them (work the handlers queued, each turn's tasks' first steps);
- first_chunk: one engine tick gives every turn its first chunk, until every turn's first frame is written;
- later_chunk: per chunk, over a few ticks once the first chunks are out.
The socket benchmark (gateway_load.py --spawn-server) measures latency end to end; this isolates the loop's work,
which a shared machine's noise hides there.

    python bench/loop_cost.py --sessions 128 --format opus --runs 3 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_load import TEXTS  # noqa: E402
from paced_engine import PacedEngine  # noqa: E402

from gateway import protocol as p  # noqa: E402
from gateway.encode_site import start_encoders  # noqa: E402
from gateway.session import Session, SessionConfig  # noqa: E402

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


async def burst(sessions: int, fmt: str) -> dict[str, Any]:
    """One burst of `sessions` new turns; loop-thread CPU per phase (us per turn / per chunk)."""
    engine = PacedEngine(tick_ms=1e6)  # ticked by hand below
    start_encoders()  # as a serving process does once it listens: no encoder process starts inside the burst
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
    c0 = time.thread_time()
    for session, append in zip(clients, appends, strict=True):
        await session.receive(append)
        await session.receive(end)
    c1 = time.thread_time()
    for _ in range(3):  # what the handlers queued, then the turns' tasks up to their first engine read
        await asyncio.sleep(0)
    c2 = time.thread_time()
    if engine._ticker is not None:
        engine._ticker.cancel()
    t_tick = time.perf_counter()
    engine._tick()
    await run.all_first.wait()
    c3 = time.thread_time()
    firsts = sorted((s.first_at or t_tick) - t_tick for s in sinks)
    await asyncio.sleep(TICK_WAIT_S)
    frames0, c4 = sum(s.frames for s in sinks), time.thread_time()
    for _ in range(LATER_TICKS):
        engine._tick()
        await asyncio.sleep(TICK_WAIT_S)
    c5, frames1 = time.thread_time(), sum(s.frames for s in sinks)
    for session in clients:
        await session.close()
    await engine.stop()
    us = 1e6 / sessions
    return {"handler_us_per_turn": round((c1 - c0) * us, 1), "after_burst_us_per_turn": round((c2 - c1) * us, 1),
            "first_chunk_us_per_turn": round((c3 - c2) * us, 1),
            "later_chunk_us_per_chunk": round((c5 - c4) * us / LATER_TICKS, 1),
            "first_frame_ms_p50": round(firsts[len(firsts) // 2] * 1e3, 2),
            "first_frame_ms_max": round(firsts[-1] * 1e3, 2),
            "later_frames_per_chunk": round((frames1 - frames0) / (LATER_TICKS * sessions), 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=128)
    ap.add_argument("--format", default="opus", choices=("opus", "pcm_s16le", "mulaw", "alaw"))
    ap.add_argument("--runs", type=int, default=3, help="bursts, each in a fresh event loop; the medians are reported")
    ap.add_argument("--json", type=Path, help="write the runs and medians here")
    args = ap.parse_args(argv)
    runs = [asyncio.run(burst(args.sessions, args.format)) for _ in range(args.runs)]
    median = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    print(json.dumps(median))
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "loop_cost", "command": " ".join(sys.argv),
                                         "sessions": args.sessions, "format": args.format, "median": median,
                                         "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
