"""Engine benchmark: a concurrency sweep of fixed-length streaming requests through the public async API.

Definitions follow the Nano-vLLM-VoxCPM benchmark so the numbers compare: TTFB = first chunk time - request start;
RTF per request = (wall - TTFB) / audio seconds (mean over requests); inter-chunk gap = time between consecutive
chunks of one request. Fixed length needs a checkpoint whose stop head never fires: `--random-size` writes one.

    python bench/engine_bench.py --random-size tiny --concurrency 1,8,32 --patches 20
    python bench/engine_bench.py --model DIR --concurrency 1,8,32,64 --patches 60 --out bench/results/x.json
    python bench/engine_bench.py --random-size tiny --closed-loop --concurrency 8 --duration 10
    python bench/engine_bench.py --random-size tiny --poisson 4 --requests 40
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import Engine  # noqa: E402

TEXT = ("Streaming speech synthesis turns text into audio while the text is still arriving, so a voice agent can "
        "start speaking within a fraction of a second. The gateway splits the text into short segments, the "
        "engine batches every active stream into one step on the accelerator, and the audio is encoded and sent "
        "to the listener as soon as each patch is ready. A good system keeps the first audio fast and steady "
        "even when hundreds of people are talking to it at the same time, and it never lets a stream run dry.")


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def one_request(engine: Engine, patches: int, seed: int, timesteps: int) -> dict:
    start = time.perf_counter()
    times, samples = [], 0
    async for chunk in engine.generate(TEXT, seed=seed, max_length=patches, min_length=patches, timesteps=timesteps):
        times.append(time.perf_counter())
        samples += chunk.audio.shape[0]
    audio_s = samples / engine.model_info().sample_rate
    ttfb = times[0] - start
    return {"ttfb": ttfb, "rtf": (times[-1] - start - ttfb) / audio_s if audio_s else float("nan"),
            "gaps": np.diff(times).tolist(), "audio_s": audio_s, "patches": len(times)}


async def run_level(engine: Engine, args: argparse.Namespace, concurrency: int) -> dict:
    steps0, t0 = engine.stats().steps, time.perf_counter()
    results: list[dict] = []
    seeds = iter(range(10**9))

    async def report():
        while True:
            await asyncio.sleep(2)
            print(f"  ... {len(results)} requests done, {engine.stats().running} running", file=sys.stderr)

    progress = asyncio.create_task(report())
    if args.poisson:
        rng = random.Random(0)
        tasks = []
        for _ in range(args.requests):
            tasks.append(asyncio.create_task(one_request(engine, args.patches, next(seeds), args.timesteps)))
            tasks[-1].add_done_callback(lambda t: results.append(t.result()))
            await asyncio.sleep(rng.expovariate(args.poisson))
        await asyncio.gather(*tasks)
    elif args.closed_loop:
        end = t0 + args.duration

        async def user():
            while time.perf_counter() < end:
                results.append(await one_request(engine, args.patches, next(seeds), args.timesteps))

        await asyncio.gather(*(user() for _ in range(concurrency)))
    else:
        n = args.requests or concurrency
        sem = asyncio.Semaphore(concurrency)

        async def limited():
            async with sem:
                results.append(await one_request(engine, args.patches, next(seeds), args.timesteps))

        await asyncio.gather(*(limited() for _ in range(n)))
    progress.cancel()
    elapsed = time.perf_counter() - t0
    ttfb = [r["ttfb"] * 1000 for r in results]
    gaps = [g * 1000 for r in results for g in r["gaps"]]
    return {
        "concurrency": concurrency, "requests": len(results), "elapsed_s": elapsed,
        "ttfb_ms": {"p50": percentile(ttfb, 50), "p90": percentile(ttfb, 90), "p99": percentile(ttfb, 99)},
        "rtf_mean": float(np.mean([r["rtf"] for r in results])),
        "gap_ms": {"p50": percentile(gaps, 50), "p99": percentile(gaps, 99)},
        "steps_per_s": (engine.stats().steps - steps0) / elapsed,
        "audio_s_per_s": sum(r["audio_s"] for r in results) / elapsed,
    }


def model_dir(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from engine import model_configs
    from engine.random_checkpoint import write_random_checkpoint

    config = {"tiny": lambda: model_configs.tiny("voxcpm2"), "voxcpm2": model_configs.voxcpm2,
              "voxcpm1.5": model_configs.voxcpm15}[args.random_size]()
    out = Path(tempfile.gettempdir()) / f"voxgate-bench-{args.random_size}-stop-never"
    if not (out / "config.json").exists():
        print(f"writing a random {args.random_size} checkpoint (stop head never fires) to {out}", file=sys.stderr)
        write_random_checkpoint(out, config, seed=0, stop_never=True)
    return str(out)


async def main(args: argparse.Namespace) -> dict:
    model = model_dir(args)
    engine = Engine(model, max_num_seqs=args.max_num_seqs, max_waiting=args.max_num_seqs * 4,
                    inference_timesteps=args.timesteps, dtype=args.dtype,
                    gpu_memory_utilization=args.gpu_memory_utilization)
    t = time.perf_counter()
    await engine.wait_for_ready()
    print(f"engine ready in {time.perf_counter() - t:.1f} s: {engine.model_info()}", file=sys.stderr)
    await one_request(engine, 2, 0, args.timesteps)  # warm-up
    levels = []
    try:
        for c in args.concurrency:
            print(f"concurrency {c} ...", file=sys.stderr)
            levels.append(await run_level(engine, args, c))
    finally:
        await engine.stop()
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU {platform.processor()}"
    return {"command": " ".join(sys.argv), "git_commit": commit, "device": device,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "model": model, "model_info": vars(engine.model_info()), "patches": args.patches,
            "timesteps": args.timesteps, "mode": "poisson" if args.poisson else
            "closed-loop" if args.closed_loop else "batch", "levels": levels}


def table(result: dict) -> str:
    rows = ["| concurrency | requests | TTFB p50 / p90 / p99 (ms) | RTF mean | gap p50 / p99 (ms) | steps/s "
            "| audio s/s |", "|---|---|---|---|---|---|---|"]
    for lv in result["levels"]:
        t, g = lv["ttfb_ms"], lv["gap_ms"]
        rows.append(f"| {lv['concurrency']} | {lv['requests']} | {t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} | "
                    f"{lv['rtf_mean']:.3f} | {g['p50']:.1f} / {g['p99']:.1f} | {lv['steps_per_s']:.1f} | "
                    f"{lv['audio_s_per_s']:.1f} |")
    return "\n".join(rows)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model directory (its stop head should never fire for fixed lengths)")
    src.add_argument("--random-size", choices=["tiny", "voxcpm2", "voxcpm1.5"], default="tiny")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--patches", type=int, default=20, help="patches per request (fixed length)")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: = concurrency)")
    p.add_argument("--closed-loop", action="store_true", help="each of C users sends requests back to back")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per level in closed loop")
    p.add_argument("--poisson", type=float, default=0.0, help="open loop: RATE requests/s (uses --requests)")
    p.add_argument("--timesteps", type=int, default=10)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--dtype", default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--out", help="write the JSON result here")
    args = p.parse_args()
    if args.poisson and not args.requests:
        args.requests = 32
    return args


if __name__ == "__main__":
    arguments = parse_args()
    result = asyncio.run(main(arguments))
    text = json.dumps(result, indent=2)
    if arguments.out:
        Path(arguments.out).write_text(text)
    else:
        print(text)
    print(table(result))
