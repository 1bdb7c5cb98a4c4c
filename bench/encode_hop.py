"""Offloaded Opus encoding: the loop's cost per chunk (`burst`), and a new turn's first frame under load (`steps`).

`--pattern burst`: the event loop's cost of one offloaded Opus chunk, the encode thread pool vs the encoder processes.
`--turns` turns each encode `--chunks` 160 ms chunks, one awaited call after another (as a turn does), all at once;
reported per place: the loop thread's CPU per chunk (what the hop costs the thread every session shares), a 2 ms
timer's overshoot on the loop meanwhile (waits for the GIL show there, not in the CPU), wall time and chunks per
second, each the median of `--repeats` runs made in turn (min too for the CPU: a machine shared with
other work inflates some runs). On a small machine the wall figures mostly say how many cores there are; the loop's
CPU per chunk is the comparison.

    python bench/encode_hop.py --turns 64 --chunks 20 --workers 2 [--repeats 5] [--json out.json]

`--pattern steps`: what one front's encoder process sees on the H200 (issue 34). `--turns` turns stream a 160 ms
chunk each every `--step-ms` (one engine step: all of a step's chunks are handed over in one loop iteration), through
ONE encoder process (a front's default there), with the urgency of a listener with audio queued; in each step
`--heads` new turns each ask for their first frame (`encode_head`, urgency 0, encoder opened a step before) at a random
moment in the first `--spread-ms` of the step (the same moments in every run), then encode the rest of their chunk and
end. Reported: the head's latency (call -> answer) p50 / p90 / max, the streaming chunks' latency, the steps a stream's
chunk was still out when the next came (late), and the time one chunk and one head take to encode in this process
(the queueing arithmetic's inputs); each the median of `--repeats` runs.

    python bench/encode_hop.py --pattern steps --turns 32 --heads 4 --steps 100 [--repeats 5] [--json out.json]

`--pattern burst-heads`: one front's share of the H200's 256 sessions opened at once (issue 34), through ONE encoder
process. `--turns` turns, their encoders opened, get their first chunk in one loop iteration (one engine step): each
asks for its head (`encode_head`, urgency 0), and once it is back for the rest of the chunk (urgency: the head's
20 ms), as `gateway.turn` does (`--turn-us`: the loop's work for a turn before it asks, so the heads come that far
apart); `--later-ms` later `--later-heads` more turns start the same way while the first ones' rests are being
encoded. Reported: the heads' latency (call -> answer) p50 / p90 / max, for the burst's heads and the later ones
apart, and the first chunks' (head call -> rest answered); each the median of `--repeats` runs.

    python bench/encode_hop.py --pattern burst-heads --turns 32 --later-heads 8 --later-ms 10 [--repeats 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.audio import Encoder, OutputFormat  # noqa: E402
from gateway.encode_procs import EncodeProcs, ProcEncoder  # noqa: E402
from gateway.encode_site import EncodeSite, InPool, OnLoop  # noqa: E402
from gateway.offload import OffloadPool  # noqa: E402

RATE = 48000
CHUNK = RATE * 160 // 1000
FRAME = RATE * 20 // 1000  # one Opus frame's time in samples: `encode_head`'s step


async def run_turns(site: EncodeSite, turns: int, chunks: int, pcm: np.ndarray) -> dict[str, float]:
    async def turn(i: int) -> int:
        encoder = site.open(OutputFormat(), RATE)
        frames = 0
        for k in range(chunks):
            frames += len(await encoder.encode(pcm[k * CHUNK:(k + 1) * CHUNK], 100.0 + (i + k) % 500))
        frames += len(await encoder.finish(0.0))
        encoder.close()
        return frames

    async def lag_probe(lags: list[float]) -> None:
        """A 2 ms timer's overshoot: how long the loop waits (for the GIL, or its own work) to run a ready timer."""
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.002)
            lags.append((time.perf_counter() - t - 0.002) * 1000.0)

    await asyncio.gather(*(turn(i) for i in range(min(turns, 4))))  # warm: threads / processes started
    lags: list[float] = []
    probe = asyncio.ensure_future(lag_probe(lags))
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    frames = sum(await asyncio.gather(*(turn(i) for i in range(turns))))
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    probe.cancel()
    calls = turns * (chunks + 1)
    lags.sort()
    return {"loop_cpu_us_per_chunk": round(cpu / calls * 1e6, 1), "wall_s": round(wall, 3),
            "chunks_per_s": round(calls / wall, 1), "frames": frames,
            "timer_lag_ms_p50": round(lags[len(lags) // 2], 3) if lags else 0.0,
            "timer_lag_ms_p99": round(lags[int(len(lags) * 0.99)], 3) if lags else 0.0}


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 / p90 / max of `values` in ms, rounded."""
    v = sorted(values)
    if not v:
        return {"p50": 0.0, "p90": 0.0, "max": 0.0}
    return {"p50": round(v[len(v) // 2], 3), "p90": round(v[int(len(v) * 0.9)], 3), "max": round(v[-1], 3)}


def encode_costs(pcm: np.ndarray) -> dict[str, float]:
    """One 160 ms chunk's and one head's encode time here, in ms (medians): what a call waiting in the process waits
    for."""
    encoder = Encoder(OutputFormat(), RATE)
    chunk_ms, head_ms = [], []
    for k in range(len(pcm) // CHUNK):
        t = time.perf_counter()
        encoder.encode(pcm[k * CHUNK:(k + 1) * CHUNK])
        chunk_ms.append((time.perf_counter() - t) * 1000.0)
        fresh = Encoder(OutputFormat(), RATE)
        t = time.perf_counter()
        fresh.encode_head(pcm[k * CHUNK:(k + 1) * CHUNK], 1, FRAME)
        head_ms.append((time.perf_counter() - t) * 1000.0)
    return {"chunk_encode_ms": round(statistics.median(chunk_ms), 3),
            "head_encode_ms": round(statistics.median(head_ms), 3)}


async def run_steps(procs: EncodeProcs, args: argparse.Namespace, pcm: np.ndarray) -> dict[str, Any]:
    """The `steps` pattern once: streams' chunks every step, new turns' heads among them (see the module's doc)."""
    loop = asyncio.get_running_loop()
    rng = np.random.default_rng(1)  # the same heads at the same moments in every run
    chunks = len(pcm) // CHUNK
    streams = [procs.open(OutputFormat(), RATE) for _ in range(args.turns)]
    buffered = 200.0 + rng.uniform(0.0, 2000.0, args.turns)  # ms the stream's listener has queued: not urgent
    await asyncio.gather(*(s.encode(pcm[:CHUNK], 0.0) for s in streams))  # warm
    out: list[asyncio.Future | None] = [None] * args.turns
    head_ms: list[float] = []
    chunk_ms: list[float] = []
    late = 0
    tasks: list[asyncio.Task] = []

    async def chunk(encoder: ProcEncoder, piece: np.ndarray, urgency: float) -> None:
        t = time.perf_counter()
        await encoder.encode(piece, urgency)
        chunk_ms.append((time.perf_counter() - t) * 1000.0)

    async def new_turn(encoder: ProcEncoder, piece: np.ndarray) -> None:
        t = time.perf_counter()
        head, used = await encoder.encode_head(piece, 1, FRAME, 0.0)
        head_ms.append((time.perf_counter() - t) * 1000.0)
        await encoder.encode(piece[used:], len(head) * 20.0)
        await encoder.finish(0.0)
        encoder.close()

    openers = [procs.open(OutputFormat(), RATE) for _ in range(args.heads)]
    start = loop.time() + args.step_ms / 1000.0
    for step in range(args.steps):
        await asyncio.sleep(max(0.0, start + step * args.step_ms / 1000.0 - loop.time()))
        piece = pcm[(step % chunks) * CHUNK:(step % chunks + 1) * CHUNK]
        for i, encoder in enumerate(streams):  # the step's chunks, all in this iteration
            prior = out[i]
            if prior is not None and not prior.done():
                late += 1  # its last chunk is still out: this one waits for it (a turn awaits each call)
                continue
            out[i] = asyncio.ensure_future(chunk(encoder, piece, float(buffered[i])))
        heads, openers = openers, [procs.open(OutputFormat(), RATE) for _ in range(args.heads)]
        for encoder, at in zip(heads, rng.uniform(0.0, args.spread_ms / 1000.0, args.heads), strict=True):
            tasks.append(loop.create_task(_after(at, new_turn(encoder, piece))))
    await asyncio.gather(*tasks, *(f for f in out if f is not None))
    for encoder in [*streams, *openers]:
        encoder.close()
    return {"head_ms": percentiles(head_ms), "chunk_ms": percentiles(chunk_ms), "late_chunks": late,
            "heads": len(head_ms), "chunks": len(chunk_ms)}


async def run_burst_heads(procs: EncodeProcs, args: argparse.Namespace, pcm: np.ndarray) -> dict[str, Any]:
    """The `burst-heads` pattern once (see the module's doc)."""
    loop = asyncio.get_running_loop()
    chunks = len(pcm) // CHUNK
    head_ms: dict[str, list[float]] = {"burst": [], "later": []}
    chunk_ms: list[float] = []

    async def first_chunk(encoder: ProcEncoder, piece: np.ndarray, group: str) -> None:
        busy_until = time.perf_counter() + args.turn_us / 1e6
        while time.perf_counter() < busy_until:  # the loop's own work for the turn before it asks (it holds the loop)
            pass
        t = time.perf_counter()
        head, used = await encoder.encode_head(piece, 1, FRAME, 0.0)
        head_ms[group].append((time.perf_counter() - t) * 1000.0)
        await encoder.encode(piece[used:], len(head) * 20.0)
        chunk_ms.append((time.perf_counter() - t) * 1000.0)

    burst = [procs.open(OutputFormat(), RATE) for _ in range(args.turns)]
    later = [procs.open(OutputFormat(), RATE) for _ in range(args.later_heads)]
    await procs.open_counts()  # every encoder made in the process before the burst, as a turn's is at its start
    await asyncio.sleep(0.05)  # the process idle, as it is between two engine steps
    tasks = [loop.create_task(first_chunk(e, pcm[(i % chunks) * CHUNK:(i % chunks + 1) * CHUNK], "burst"))
             for i, e in enumerate(burst)]
    await asyncio.sleep(args.later_ms / 1000.0)
    tasks += [loop.create_task(first_chunk(e, pcm[(i % chunks) * CHUNK:(i % chunks + 1) * CHUNK], "later"))
              for i, e in enumerate(later)]
    await asyncio.gather(*tasks)
    for encoder in [*burst, *later]:
        encoder.close()
    return {"head_ms": percentiles(head_ms["burst"]), "later_head_ms": percentiles(head_ms["later"]),
            "first_chunk_ms": percentiles(chunk_ms), "heads": len(head_ms["burst"]) + len(head_ms["later"])}


async def _after(seconds: float, work: Awaitable[None]) -> None:
    await asyncio.sleep(seconds)
    await work


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the runs (nested dicts figure by figure)."""
    first = runs[0]
    return {k: median_of([r[k] for r in runs]) if isinstance(first[k], dict)
            else round(statistics.median(r[k] for r in runs), 3) for k in first}


async def one_process_main(args: argparse.Namespace, pcm: np.ndarray) -> dict[str, Any]:
    """The `steps` or `burst-heads` pattern `--repeats` times through one encoder process."""
    procs = EncodeProcs(1, nice=args.nice)
    runs = []
    try:
        procs.start()
        await procs.open_counts()  # the process started and its imports done
        for _ in range(args.repeats):
            runs.append(await (run_steps if args.pattern == "steps" else run_burst_heads)(procs, args, pcm))
    finally:
        procs.close()
    if args.pattern == "steps":
        shape = {"turns": args.turns, "heads": args.heads, "steps": args.steps, "step_ms": args.step_ms,
                 "spread_ms": args.spread_ms}
    else:
        shape = {"turns": args.turns, "later_heads": args.later_heads, "later_ms": args.later_ms,
                 "turn_us": args.turn_us}
    return {"pattern": args.pattern, **shape, "repeats": args.repeats, **encode_costs(pcm),
            "results": median_of(runs), "runs": runs}


async def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pattern", choices=("burst", "steps", "burst-heads"), default="burst")
    ap.add_argument("--turns", type=int, default=64,
                    help="turns at once (burst, burst-heads), streaming turns (steps)")
    ap.add_argument("--chunks", type=int, default=20, help="160 ms chunks per turn (burst)")
    ap.add_argument("--workers", type=int, default=2, help="encode threads, and encoder processes (burst)")
    ap.add_argument("--heads", type=int, default=4, help="new turns' first frames per step (steps)")
    ap.add_argument("--steps", type=int, default=100, help="engine steps per run (steps)")
    ap.add_argument("--step-ms", type=float, default=40.0, help="time between engine steps (steps)")
    ap.add_argument("--spread-ms", type=float, default=20.0,
                    help="a head comes this long or less after its step's chunks (steps)")
    ap.add_argument("--later-heads", type=int, default=8, help="turns starting after the burst (burst-heads)")
    ap.add_argument("--turn-us", type=float, default=0.0,
                    help="the loop's work per turn before its head is asked for: the burst's heads come this far apart"
                         " (burst-heads)")
    ap.add_argument("--later-ms", type=float, default=10.0, help="when they start after it (burst-heads)")
    ap.add_argument("--nice", type=int, default=None,
                    help="the encoder process's priority below ours (steps, burst-heads; default: the gateway's)")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each place, interleaved")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    command = " ".join(["python", "bench/encode_hop.py", *(sys.argv[1:] if argv is None else argv)])
    rng = np.random.default_rng(0)
    t = np.arange(args.chunks * CHUNK) / RATE
    pcm = (0.3 * np.sin(2 * np.pi * 140 * t) + 0.05 * rng.standard_normal(len(t))).astype(np.float32)
    if args.pattern != "burst":
        report(command, await one_process_main(args, pcm), args.json)
        return
    pool = OffloadPool(threads=args.workers)
    procs = EncodeProcs(args.workers)
    sites: dict[str, EncodeSite] = {"loop": OnLoop(), "threads": InPool(pool), "procs": procs}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sites}
    try:
        for _ in range(args.repeats):
            for name, site in sites.items():
                runs[name].append(await run_turns(site, args.turns, args.chunks, pcm))
    finally:
        pool.shutdown()
        procs.close()
    results = {name: {"loop_cpu_us_per_chunk_min": min(r["loop_cpu_us_per_chunk"] for r in rs),
                      **{k: statistics.median(r[k] for r in rs) for k in rs[0]}} for name, rs in runs.items()}
    report(command, {"pattern": "burst", "turns": args.turns, "chunks": args.chunks, "workers": args.workers,
            "repeats": args.repeats, "results": results}, args.json)


def report(command: str, out: dict[str, Any], path: str | None) -> None:
    """Print the results, with the command and commit that made them, and write them to `path` if given."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    out = {"command": command, "commit": commit, **out}
    print(json.dumps(out, indent=1))
    if path:
        Path(path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
