"""Host cost of the scheduler's step picks: `Scheduler.schedule()` and `Scheduler.schedule_ahead()` at a given number
of running streams, without a model (the step's outputs are stand-in patches).

    python bench/scheduler_bench.py                      # 256 and 512 running, steady and with a waiting queue
    python bench/scheduler_bench.py --running 512 --steps 400
    python bench/scheduler_bench.py --lean-ms 750     # lean steps, every listener reporting (half well queued)

Scenarios: `steady` (every stream decoding, nothing waiting), `waiting` (every VAE slot taken and 64 prompts
queued behind them, so every step tries an admission that fails), `admit` (a one-patch prompt arrives before every
step and is admitted, so the running count holds). `schedule_ahead` is timed the way the worker calls it: on the
step still "on the device", before that step is collected. The scheduler has the served defaults (`EngineConfig`):
at 512 running the decodes split into halves. `picked`: the share of steps `schedule_ahead` picked.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from engine.engine_config import EngineConfig
from engine.request import RequestSpec, SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler

P, D = 2, 4
PROMPT = 24
_ids = itertools.count()


def _spec(max_length: int) -> RequestSpec:
    return RequestSpec(f"r{next(_ids)}", list(range(PROMPT)), [0] * PROMPT, (P, D),
                       SamplingParams(max_length=max_length, min_length=0))


def _collect(s: Scheduler, seqs: list[ScheduledSeq], patch: torch.Tensor) -> None:
    s.postprocess(seqs, [patch if q.emit else None for q in seqs], [False] * len(seqs))


def _scheduler(running: int, scenario: str, steps: int, lean_ms: float = 0.0) -> Scheduler:
    slots = running if scenario == "waiting" else running + steps + 8
    c = EngineConfig()  # the served defaults: token budget, prefill cap, block size, split bound
    s = Scheduler(max_num_seqs=slots, max_num_batched_tokens=c.max_num_batched_tokens, num_blocks=(slots + 8) * 64,
                  block_size=c.block_size, patch_ms=80.0, sit_out_ms=c.sit_out_ms,
                  max_prefill_tokens_while_speaking=c.max_prefill_tokens_while_speaking,
                  split_decodes_above=c.split_decodes_above, lean_ms=lean_ms)
    patch = torch.zeros(P, D)
    for _ in range(running):
        s.add(_spec(10 ** 6))
    while any(not r.generated for r in s.running) or s.waiting:
        _collect(s, s.schedule(), patch)
    if scenario == "waiting":
        for _ in range(64):
            s.add(_spec(10 ** 6))
    if lean_ms:  # every listener reports; half of them have plenty queued (they sit out steps that admit)
        for i, req in enumerate(s.running):
            s.update_buffered(req.request_id, 5000.0 if i % 2 else 100.0)
    return s


def bench(running: int, scenario: str, steps: int, lean_ms: float = 0.0) -> dict[str, float]:
    """Median and p90 microseconds of `schedule()` and of `schedule_ahead()` over `steps` steps each."""
    patch = torch.zeros(P, D)
    timings: dict[str, list[float]] = {"schedule": [], "schedule_ahead": []}
    picked = 0
    s = _scheduler(running, scenario, steps, lean_ms)
    for _ in range(steps):
        if scenario == "admit":
            s.add(_spec(1))  # prefilled, sampled and finished in one step: the running count holds
        t = time.perf_counter()
        seqs = s.schedule()
        timings["schedule"].append(time.perf_counter() - t)
        _collect(s, seqs, patch)
    s = _scheduler(running, scenario, steps, lean_ms)
    current = s.schedule()
    for _ in range(steps):
        if scenario == "admit":
            s.add(_spec(1))
        t = time.perf_counter()
        ahead = s.schedule_ahead(current, True)
        timings["schedule_ahead"].append(time.perf_counter() - t)
        picked += ahead is not None
        _collect(s, current, patch)
        current = ahead if ahead is not None else s.schedule()
    out = {"ahead_picked": picked / steps}
    for name, ts in timings.items():
        ts.sort()
        out[f"{name}_us"] = 1e6 * statistics.median(ts)
        out[f"{name}_p90_us"] = 1e6 * ts[int(0.9 * (len(ts) - 1))]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", default="256,512", help="running streams, comma-separated")
    parser.add_argument("--scenarios", default="steady,waiting,admit")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lean-ms", type=float, default=0.0, help="lean steps at this many ms (VOXGATE_LEAN_STEPS)")
    args = parser.parse_args()
    print(f"{'running':>8} {'scenario':>8} {'schedule us':>12} {'p90':>8} {'ahead us':>10} {'p90':>8} {'picked':>7}")
    for running in map(int, args.running.split(",")):
        for scenario in args.scenarios.split(","):
            r = bench(running, scenario, args.steps, args.lean_ms)
            print(f"{running:>8} {scenario:>8} {r['schedule_us']:>12.1f} {r['schedule_p90_us']:>8.1f} "
                  f"{r['schedule_ahead_us']:>10.1f} {r['schedule_ahead_p90_us']:>8.1f} "
              f"{r['ahead_picked']:>7.0%}", flush=True)


if __name__ == "__main__":
    main()
