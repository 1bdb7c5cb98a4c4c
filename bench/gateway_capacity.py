"""Gateway capacity: how many real-time Opus sessions one gateway process carries, and its CPU per stream.

The audio source is a STAND-IN, not a model: `bench/paced_engine.py` hands every running request one 160 ms patch
of a fixed speech-like waveform per 160 ms (real time, all streams on one tick like an engine step). So the numbers
are the gateway's own cost (protocol, segmenter, Opus encoding, pacing, WebSocket writes, the engine API calls),
not a model's. The real gateway app runs in its own process (`bench/gateway_proc.py`); the sessions are driven
from several client processes (aiohttp WebSockets), so the clients do not share the gateway's CPU or event loop.

Each session: session.start (Opus 48 kHz, 20 ms frames), then turns back to back: the whole text in one
text.append, context.end, frames until context.done. Measured over a window after all sessions have started:
- gateway process CPU seconds per second per stream (and per thread: the event loop is MainThread);
- event-loop lag (overshoot of a 10 ms timer in the gateway) p50/p99/max;
- at the clients: inter-frame arrival gap p99, lateness of each frame against the real-time schedule
  (arrival - (first frame's arrival + pts)) p99, underruns against a playout clock (playback starts one cushion
  after the first frame, in real time; a frame after its play time is an underrun and playback waits), TTFB and
  the gateway's share of it (client TTFB - engine TTFB), errors.

    python bench/gateway_capacity.py --sessions 50,100,200 --client-procs 2 --duration 20 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import struct
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_proc import GatewayProcess, delta, git_commit, machine_info  # noqa: E402

HEADER = struct.Struct("!BBBBHII")  # the native protocol's 14-byte audio frame header (docs/PROTOCOL.md)
TEXT = ("Thanks for calling. Your order shipped this morning and should arrive on Friday; the tracking number is in "
        "the email we just sent. Is there anything else I can help you with today?")


@dataclass
class ClientResult:
    """One client process's view of the measurement window."""

    sessions: int = 0
    turns_done: int = 0
    frames: int = 0
    gaps_ms: list[float] = field(default_factory=list)
    late_ms: list[float] = field(default_factory=list)
    underruns: int = 0
    underrun_ms: float = 0.0
    ttfb_ms: list[float] = field(default_factory=list)
    overhead_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    cpu_s: float = 0.0


async def _session(url: str, index: int, t_start: float, t_from: float, t_to: float, args: argparse.Namespace,
                   out: ClientResult) -> None:
    import aiohttp

    await asyncio.sleep(max(0.0, t_start - time.monotonic()))
    loop_time = time.monotonic
    try:
        async with aiohttp.ClientSession() as http, http.ws_connect(url, compress=0, max_msg_size=0) as ws:
            await ws.send_str(json.dumps({"type": "session.start", "output": {"format": "opus"},
                                          "generation": {"seed": index}}))
            msg = json.loads(await ws.receive_str(timeout=60))
            if msg.get("type") != "session.started":
                out.errors.append(f"session.start: {msg}")
                return
            turn = 0
            while loop_time() < t_to:
                cid = f"s{index}t{turn}"
                turn += 1
                t0 = loop_time()
                await ws.send_str(json.dumps({"type": "text.append", "context_id": cid, "text": TEXT}))
                await ws.send_str(json.dumps({"type": "context.end", "context_id": cid}))
                first = last = play_start = None
                ttfb = None
                while True:
                    m = await ws.receive(timeout=60)
                    now = loop_time()
                    if m.type == aiohttp.WSMsgType.BINARY:
                        _, _, _, _, _, _, pts = HEADER.unpack_from(m.data)
                        if first is None:
                            first, ttfb = now, (now - t0) * 1000.0
                            play_start = now + args.cushion_ms / 1000.0
                        counted = t_from <= now <= t_to
                        if counted:
                            out.frames += 1
                            out.late_ms.append((now - first) * 1000.0 - pts)
                            if last is not None:
                                out.gaps_ms.append((now - last) * 1000.0)
                        due = play_start + pts / 1000.0
                        if now > due:  # the listener ran dry: playback resumes when this frame arrives
                            if counted:
                                out.underruns += 1
                                out.underrun_ms += (now - due) * 1000.0
                            play_start += now - due
                        last = now
                    elif m.type == aiohttp.WSMsgType.TEXT:
                        event = json.loads(m.data)
                        kind = event.get("type")
                        if kind == "error":
                            out.errors.append(f"{event.get('code')}: {event.get('message')}")
                            if event.get("fatal"):
                                return
                        elif kind == "context.done" and event.get("context_id") == cid:
                            if t_from <= t0 <= t_to and ttfb is not None:
                                out.turns_done += 1
                                out.ttfb_ms.append(ttfb)
                                engine = (event.get("metrics") or {}).get("engine_ttfb_ms")
                                if engine is not None:
                                    out.overhead_ms.append(ttfb - engine)
                            break
                    else:
                        out.errors.append(f"connection closed ({m.type.name})")
                        return
            await ws.send_str(json.dumps({"type": "session.end"}))
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        out.errors.append(f"{type(e).__name__}: {e}")


def _client_main(conn: Any, url: str, indexes: list[int], starts: list[float], t_from: float, t_to: float,
                 args: argparse.Namespace) -> None:
    """One client process: its share of the sessions on one event loop; the result goes back through `conn`."""
    out = ClientResult(sessions=len(indexes))
    cpu0 = time.process_time()

    async def run() -> None:
        await asyncio.gather(*(_session(url, i, s, t_from, t_to, args, out) for i, s in zip(indexes, starts,
                                                                                              strict=True)))

    asyncio.run(run())
    out.cpu_s = time.process_time() - cpu0
    conn.send(asdict(out))
    conn.close()


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 1)


def run_level(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Start a fresh gateway, drive n sessions, measure the window; the level's summary."""
    gateway_args = ["--engine", "paced"] + (["--tick-ms", str(args.tick_ms)] if args.tick_ms else [])
    with GatewayProcess(*gateway_args) as gw:
        ramp = args.ramp if args.ramp is not None else max(2.0, n / 50.0)
        t0 = time.monotonic() + 2.0  # client processes start meanwhile
        t_from = t0 + ramp + args.settle
        t_to = t_from + args.duration
        procs = max(1, min(args.client_procs, n))
        ctx = mp.get_context("spawn")
        workers = []
        for p in range(procs):
            indexes = list(range(p, n, procs))
            starts = [t0 + ramp * i / n for i in indexes]
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_client_main, args=(send, gw.url, indexes, starts, t_from, t_to, args),
                               daemon=True)
            proc.start()
            send.close()
            workers.append((proc, recv))
        time.sleep(max(0.0, t_from - time.monotonic()))
        gw.reset()
        before = gw.stats()
        time.sleep(max(0.0, t_to - time.monotonic()))
        after = gw.stats()
        results = []
        for proc, recv in workers:
            try:
                if recv.poll(args.duration + 120):
                    results.append(recv.recv())
            except EOFError:  # the client process died: counted as missing (client_results < client_procs)
                pass
            proc.join(10)
    used = delta(before, after)
    chunks = (after["engine"]["chunks"] or 0) - (before["engine"]["chunks"] or 0)
    audio_s = chunks * 0.160  # every chunk of the stand-in is one 160 ms patch
    streams = audio_s / used["wall_s"] if used["wall_s"] else 0.0  # mean concurrently streaming turns
    merged = ClientResult()
    for r in results:
        for k, v in r.items():
            cur = getattr(merged, k)
            setattr(merged, k, cur + v)
    cpu_per_stream = used["cpu_s"] / used["wall_s"] / streams if streams else None
    loop_cpu = used["threads_cpu_s"].get("MainThread", 0.0)
    return {
        "sessions": n, "client_procs": len(workers), "client_results": len(results),
        "window_s": used["wall_s"], "streams_mean": round(streams, 1), "audio_s": round(audio_s, 1),
        "gateway_cpu_s": used["cpu_s"],
        "gateway_cpu_s_per_s_per_stream": round(cpu_per_stream, 5) if cpu_per_stream else None,
        "gateway_cores_used": round(used["cpu_s"] / used["wall_s"], 3),
        "event_loop_thread_busy": round(loop_cpu / used["wall_s"], 3),
        "threads_cpu_s": used["threads_cpu_s"],
        "event_loop_lag_ms": after["loop_lag"],
        "engine_tick_late_ms_p99": after["engine"].get("late_tick_ms_p99"),
        "frames": merged.frames, "turns_done": merged.turns_done,
        "gap_ms_p50": _pct(merged.gaps_ms, 0.5), "gap_ms_p99": _pct(merged.gaps_ms, 0.99),
        "gap_ms_max": _pct(merged.gaps_ms, 1.0),
        "late_ms_p50": _pct(merged.late_ms, 0.5), "late_ms_p99": _pct(merged.late_ms, 0.99),
        "late_ms_max": _pct(merged.late_ms, 1.0),
        "underruns": merged.underruns, "underrun_ms_total": round(merged.underrun_ms),
        "ttfb_ms_p50": _pct(merged.ttfb_ms, 0.5), "ttfb_ms_p90": _pct(merged.ttfb_ms, 0.9),
        "gateway_overhead_ms_p50": _pct(merged.overhead_ms, 0.5),
        "gateway_overhead_ms_p90": _pct(merged.overhead_ms, 0.9),
        "errors": len(merged.errors), "error_examples": sorted(set(merged.errors))[:3],
        "client_cpu_s": round(merged.cpu_s, 2),
    }


def _table(results: list[dict[str, Any]]) -> str:
    cols = [("sessions", "N"), ("streams_mean", "streams"), ("gateway_cpu_s_per_s_per_stream", "CPU s/s/stream"),
            ("gateway_cores_used", "cores"), ("event_loop_thread_busy", "loop busy"),
            ("event_loop_lag_ms", "lag p99"), ("gap_ms_p99", "gap p99"), ("late_ms_p99", "late p99"),
            ("underruns", "underruns"), ("gateway_overhead_ms_p50", "overhead p50"), ("errors", "errors")]
    lines = [" | ".join(h for _, h in cols)]
    for r in results:
        lines.append(" | ".join(str(r[k]["p99_ms"] if k == "event_loop_lag_ms" else r[k]) for k, _ in cols))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=lambda s: [int(x) for x in s.split(",")], default=[50, 100])
    ap.add_argument("--client-procs", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="client processes the sessions are spread over (default: half the cores)")
    ap.add_argument("--duration", type=float, default=20.0, help="measurement window, seconds")
    ap.add_argument("--ramp", type=float, default=None, help="seconds over which sessions start (default N/50, >=2)")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after the ramp before measuring")
    ap.add_argument("--cushion-ms", type=float, default=100.0, help="client playout start-up cushion")
    ap.add_argument("--tick-ms", type=float, help="stand-in engine: ms per chunk (default 160: real time)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    results = []
    for n in args.sessions:
        results.append(run_level(n, args))
        print(json.dumps(results[-1]), flush=True)
    print(_table(results))
    if args.json:
        doc = {"benchmark": "gateway capacity, paced stand-in engine (no model: bench/paced_engine.py)",
               "command": " ".join([Path(sys.executable).name, *sys.argv]),
               "git_commit": git_commit(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
               "machine": machine_info(),
               "config": vars(args), "results": results}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0 if all(r["errors"] == 0 and r["client_results"] == r["client_procs"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
