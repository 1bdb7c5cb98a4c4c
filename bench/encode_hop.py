"""The event loop's cost of one offloaded Opus chunk: the encode thread pool vs the encoder processes.

`--turns` turns each encode `--chunks` 160 ms chunks, one awaited call after another (as a turn does), all at once;
reported per place: the loop thread's CPU per chunk (what the hop costs the thread every session shares), a 2 ms
timer's overshoot on the loop meanwhile (waits for the GIL show there, not in the CPU), wall time and chunks per
second, each the median of `--repeats` runs made in turn (min too for the CPU: a machine shared with
other work inflates some runs). On a small machine the wall figures mostly say how many cores there are; the loop's
CPU per chunk is the comparison.

    python bench/encode_hop.py --turns 64 --chunks 20 --workers 2 [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.audio import OutputFormat  # noqa: E402
from gateway.encode_procs import EncodeProcs  # noqa: E402
from gateway.encode_site import EncodeSite, InPool, OnLoop  # noqa: E402
from gateway.offload import OffloadPool  # noqa: E402

RATE = 48000
CHUNK = RATE * 160 // 1000


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


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=20, help="160 ms chunks per turn")
    ap.add_argument("--workers", type=int, default=2, help="encode threads, and encoder processes")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each place, interleaved")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    t = np.arange(args.chunks * CHUNK) / RATE
    pcm = (0.3 * np.sin(2 * np.pi * 140 * t) + 0.05 * rng.standard_normal(len(t))).astype(np.float32)
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
    out = {"turns": args.turns, "chunks": args.chunks, "workers": args.workers, "repeats": args.repeats,
           "results": results}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
