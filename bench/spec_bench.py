"""The caller's side of `Engine.generate` on the tiny VoxCPM2 checkpoint: what one request costs the event loop.

`generate` checks its arguments and builds the request's prompt on the caller's thread (a gateway's event loop)
before the request goes to a worker. Every torch op there drops the GIL and waits to take it back; with other
threads wanting the GIL (a gateway's encode, reader and sender threads) each op can cost the loop up to a switch
interval. For two kinds of request, a plain one (text only) and a continuation (a 3-patch prompt, as every later
segment of a gateway turn is), it reports per request:
- `torch_ops`: the torch functions and tensor methods called on the calling thread (a `TorchFunctionMode` counts
  them; factory functions such as `torch.zeros` included);
- `wall_us`: the wall time of the `generate` call (p50 / p90 / mean), idle, and with `--contenders` threads that
  each hold the GIL ~20 us at a time between GIL-free waits (the loop's competition under load).

Requests are issued in bursts within one pass of the event loop, then cancelled, and the worker is left to settle
before the next burst, so the worker's own work does not overlap the timed calls.

    python bench/spec_bench.py --json bench/results/2026-12-03-cpu-specfast/spec_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

TEXT = "A second sentence of the answer, which continues from the first one without a seam."


class CountTorchOps(TorchFunctionMode):
    """Counts the torch calls made on the thread that entered it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    return {"p50": round(values[len(values) // 2], 1), "p90": round(values[int(0.9 * len(values))], 1),
            "mean": round(statistics.fmean(values), 1), "n": len(values)}


class Contenders:
    """Threads that take the GIL ~20 us at a time and drop it between (what a loaded gateway's other threads do)."""

    def __init__(self, n: int) -> None:
        self.n, self.stop = n, threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def _run(self) -> None:
        while not self.stop.is_set():
            sum(range(400))  # holds the GIL
            time.sleep(0)  # drops it

    def __enter__(self) -> Contenders:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


async def measure(engine: Any, kwargs: dict, bursts: int, burst: int, contenders: int) -> dict:
    """Wall time per `generate` call and torch ops on this thread, over `bursts` bursts of `burst` requests."""
    walls: list[float] = []
    ops = 0
    with Contenders(contenders):
        for _ in range(bursts):
            gens = []
            mode = CountTorchOps()
            with mode:
                for _ in range(burst):
                    t0 = time.perf_counter_ns()
                    gens.append(engine.generate(TEXT, max_length=4, **kwargs))
                    walls.append((time.perf_counter_ns() - t0) / 1000.0)
            ops += mode.count
            for g in gens:
                await g.aclose()
            await asyncio.sleep(0.05)  # the worker takes the burst and its cancels before the next one
    return {"torch_ops_per_request": ops / (bursts * burst), "wall_us": percentiles(walls)}


async def run(args: argparse.Namespace) -> dict:
    from engine import Engine
    from engine.model_configs import tiny
    from engine.random_checkpoint import write_random_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp), tiny("voxcpm2"), seed=0, progress=False)
        engine = Engine(str(path), max_num_seqs=args.burst, devices=["cpu"])
        try:
            await engine.wait_for_ready()
            c = engine.config
            rng = np.random.default_rng(0)
            tail = rng.standard_normal((3, c.patch_size, c.feat_dim)).astype(np.float32)
            kinds = {"plain": {}, "continuation": {"prompt_latents": tail, "prompt_text": "The first sentence."}}
            await measure(engine, kinds["continuation"], 2, args.burst, 0)  # warm: imports, caches
            report: dict[str, dict] = {}
            for name, kwargs in kinds.items():
                report[name] = {"idle": await measure(engine, kwargs, args.bursts, args.burst, 0),
                                f"{args.contenders}_contenders": await measure(engine, kwargs, args.bursts,
                                                                               args.burst, args.contenders)}
            return report
        finally:
            await engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bursts", type=int, default=20, help="bursts per kind of request and setting")
    ap.add_argument("--burst", type=int, default=16, help="requests per burst (one pass of the event loop)")
    ap.add_argument("--contenders", type=int, default=2, help="threads competing for the GIL in the second setting")
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from gateway_proc import git_commit

    results = asyncio.run(run(args))
    report = {"command": " ".join(["python", *sys.argv]), "git_commit": git_commit(),
              "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": {"cpu": platform.processor() or platform.machine(), "platform": platform.platform(),
                          "python": platform.python_version(), "torch": torch.__version__},
              "requests": results}
    print(f"{'request':13} {'setting':14} {'torch ops':>9} {'p50 us':>8} {'p90 us':>8} {'mean us':>8}")
    for name, settings in results.items():
        for setting, r in settings.items():
            w = r["wall_us"]
            print(f"{name:13} {setting:14} {r['torch_ops_per_request']:>9.1f} {w['p50']:>8} {w['p90']:>8} "
                  f"{w['mean']:>8}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
