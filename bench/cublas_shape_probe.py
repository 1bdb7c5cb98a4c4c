"""Host cost of an eager bf16 F.linear whose row count M is new to cuBLAS vs one it has met, and of
torch.tensor(list, device="cuda") behind a busy GPU (a pageable copy waits for the stream). Why mixed steps pad
their flat batch to recurring sizes (engine.cuda_graphs.eager_flat_key). GPU only:

    python bench/cublas_shape_probe.py

H200, 2026-11-29: same M 27 us per call, a new M 230-260 us (one warm-up run aside), M rounded to 128 47 us;
torch.tensor(list of 2000, cuda) behind ~60 ms of queued GEMMs: 65 ms of host time.
"""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

DEV = "cuda"
WEIGHTS = [torch.randn(n, 2048, device=DEV, dtype=torch.bfloat16) for n in (3072, 2048)]  # an LM's qkv and o


def host_us_per_linear(rows: list[int]) -> float:
    """Mean host time of one F.linear call over `rows` (one M per call) and both weights."""
    inputs = {m: torch.randn(m, 2048, device=DEV, dtype=torch.bfloat16) for m in set(rows)}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for m in rows:
        for w in WEIGHTS:
            F.linear(inputs[m], w)
    spent = time.perf_counter() - t0
    torch.cuda.synchronize()
    return spent / (len(rows) * len(WEIGHTS)) * 1e6


def main() -> None:
    rng = random.Random(0)
    host_us_per_linear([1920] * 20)  # CUDA context, cuBLAS handle
    fresh = rng.sample(range(1000, 3000), 200)
    cases = {
        "same M (1920)": [1920] * 200,
        "a new M each call": fresh,
        "the same new Ms again": fresh,
        "new Ms rounded up to 128": [-(-m // 128) * 128 for m in rng.sample(range(3000, 5000), 200)],
    }
    for label, rows in cases.items():
        print(f"{label:28s} {host_us_per_linear(rows):7.1f} us of host time per linear call")
    big = torch.randn(8192, 8192, device=DEV)
    for _ in range(3):
        big @ big  # ~60 ms queued on the stream
    t0 = time.perf_counter()
    torch.tensor(list(range(2000)), device=DEV)
    print(f"torch.tensor(list, cuda) behind a busy GPU: {(time.perf_counter() - t0) * 1e3:.2f} ms of host time")


if __name__ == "__main__":
    main()
