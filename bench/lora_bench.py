"""Micro-benchmark of the batched-LoRA kernels (engine.model.lora_triton.lora_add_) at VoxCPM2's LoRA'd linears.

Shapes (rank 32 by default, bf16 (fp16 under --tiny), 32 adapter slots + slot 0 as `--lora 32` registers): LM
q|k|v (K 2048 -> 2048, 256, 256) and o (2048 -> 2048) at rows 1, 4, 8, 64 (decode at c=1..64) and 4096 (prefill);
LocDiT q|k|v (1024 -> 2048, 256, 256) and o (2048 -> 1024) at rows 22, 44, 88, 1408 (c=1, 2, 4, 64: 2 CFG rows x 11
tokens per sequence, so 11 rows per index entry). Each with no adapter (slot 0 everywhere), one adapter, and 32
adapters spread round-robin over the index entries.
Both paths run every case: two launches (shrink, expand) and the one launch (`_fused_kernel`) at each of
the module's BLOCK_N x BLOCK_K and those of `--fused-tiles`; `pick` is the path `lora_add_` takes, and `lora_us` its
time. Each is checked against a per-slot torch reference (max abs error of the delta), then timed as the engine
runs it: `segments` computed once (the engine shares them per step), a CUDA graph of REPEAT back-to-back calls,
median replay time / REPEAT. The base linear's GEMM at the same rows is timed the same way for scale, and the last
lines add the kernels up over one VoxCPM2 decode step (36 LM layers, 12 LocDiT layers x 10 Euler steps; the 4
projections left out), with the picked paths and with two launches everywhere.

    .venv/bin/python bench/lora_bench.py [--out lora.json] [--rank 32]   (GPU, ~1-2 minutes)
    .venv/bin/python bench/lora_bench.py --tiny                            (CPU, Triton's interpreter: small shapes,
                                                                           checks only; its times mean nothing)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# the interpreter must be on before triton is imported (torch imports it)
if "--tiny" in sys.argv and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from datetime import UTC, datetime  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gateway_proc import git_commit  # noqa: E402  (bench/ is on the path: this file's folder)

from engine.model import lora_triton  # noqa: E402

ADAPTERS = 32
REPEAT = 20
DIT_TOKENS = 11  # LocDiT tokens per sequence: mu x 2, t, 4 cond, 4 x
SHAPES = {  # name: (K, outs of the linears sharing x); the name's first word is the stack
    "lm qkv": (2048, (2048, 256, 256)),
    "lm o": (2048, (2048,)),
    "dit qkv": (1024, (2048, 256, 256)),
    "dit o": (2048, (1024,)),
}
ROWS = {"lm": (1, 4, 8, 64, 4096), "dit": tuple(2 * DIT_TOKENS * c for c in (1, 2, 4, 64))}
TINY_SHAPES = {"lm qkv": (256, (160, 16, 16)), "lm o": (128, (40,)), "dit qkv": (128, (32, 16, 16)),
               "dit o": (96, (24,))}
TINY_ROWS = {"lm": (1, 8), "dit": (22, 44)}
CONCURRENCY = (1, 4, 64)  # decode steps added up: LM rows c, LocDiT rows 22c
# one VoxCPM2 decode step: (shape, LM rows or LocDiT rows) -> linears per step
STEP = {("lm qkv", "lm"): 28 + 8, ("lm o", "lm"): 28 + 8, ("dit qkv", "dit"): 12 * 10, ("dit o", "dit"): 12 * 10}


def rows_per_index(stack: str) -> int:
    return DIT_TOKENS if stack == "dit" else 1


def make_case(k: int, outs: tuple[int, ...], rank: int, rows: int, per: int, adapters: int, device: str,
              dtype: torch.dtype) -> dict:
    gen = torch.Generator(device).manual_seed(rows * 31 + k + adapters)
    entries = rows // per
    slots = [0 if adapters == 0 else 1 + i % adapters for i in range(entries)]
    num_slots = ADAPTERS + 1
    randn = lambda *shape, scale: (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)
    a = randn(num_slots, rank * len(outs), k, scale=k ** -0.5)
    b = randn(num_slots, sum(outs), rank, scale=1e-3 * rank ** -0.5)  # small: y can take many timed replays
    a[0], b[0] = 0, 0
    return {"x": randn(rows, k, scale=1.0), "y": randn(rows, sum(outs), scale=1.0), "a": a, "b": b,
            "w": randn(sum(outs), k, scale=k ** -0.5), "index": torch.tensor(slots, device=device), "per": per,
            "outs": outs}


@contextlib.contextmanager
def fused_tiles(tiles: str) -> Iterator[None]:
    """The one-launch kernel with BLOCK_N x BLOCK_K = `tiles` ("128x128"): lora_add_ reads the module's constants
    at each call, and a CUDA graph keeps what it captured."""
    saved = lora_triton.FUSED_BLOCK_N, lora_triton.FUSED_BLOCK_K
    lora_triton.FUSED_BLOCK_N, lora_triton.FUSED_BLOCK_K = (int(v) for v in tiles.split("x"))
    try:
        yield
    finally:
        lora_triton.FUSED_BLOCK_N, lora_triton.FUSED_BLOCK_K = saved


def reference(c: dict) -> torch.Tensor:
    """y + LoRA in fp32, one matmul pair per slot in use (a gather of A per row would not fit at 4096 rows)."""
    y = c["y"].float().clone()
    row_slots = c["index"].repeat_interleave(c["per"])
    rank = c["b"].shape[2]
    for s in row_slots.unique().tolist():
        if s == 0:
            continue
        rows = (row_slots == s).nonzero().squeeze(1)
        t = c["x"][rows].float() @ c["a"][s].float().T
        parts, start = [], 0
        for j, n in enumerate(c["outs"]):
            parts.append(t[:, j * rank:(j + 1) * rank] @ c["b"][s, start:start + n].float().T)
            start += n
        y[rows] += torch.cat(parts, dim=1)
    return y


def graph_us(fn: Callable[[], object]) -> float:
    """Median us of one call, from a CUDA graph of REPEAT back-to-back calls (as a step graph runs them)."""
    from triton.testing import do_bench

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            fn()
    return 1e3 * do_bench(graph.replay, warmup=20, rep=100, return_mode="median") / REPEAT


def cpu_us(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return 1e6 * (time.perf_counter() - start)


def run_case(name: str, k: int, outs: tuple[int, ...], rank: int, rows: int, adapters: int, device: str,
             dtype: torch.dtype, tiles: list[str]) -> dict:
    per = rows_per_index(name.split()[0])
    c = make_case(k, outs, rank, rows, per, adapters, device, dtype)
    timer = graph_us if device == "cuda" else cpu_us
    seg = lora_triton.segment_rows(c["index"], per, ADAPTERS + 1)
    plan = lora_triton.plan(k, seg.grid, torch.device(device))
    picked = lora_triton.fuse(rows, k, rank, sum(-(-n // lora_triton.FUSED_BLOCK_N) for n in outs), seg.grid,
                              c["x"].element_size())
    ref = reference({**c, "y": torch.zeros_like(c["y"])})
    changed = True  # every path changes y exactly when there are adapters

    def measure(fused: bool) -> tuple[float, float, float]:
        """(us, max abs error, max error relative to the delta's largest) of one path."""
        nonlocal changed
        # checked on y = 0: the delta alone, so bf16's rounding of y cannot hide an error in it
        out = torch.zeros_like(c["y"])
        lora_triton.lora_add_(out, c["x"], c["a"], c["b"], c["index"], per, outs, seg, fused=fused)
        err = (out.float() - ref).abs().max().item()
        changed &= (out.float().abs().max().item() > 0) == (adapters > 0)
        y = c["y"].clone()
        us = timer(lambda: lora_triton.lora_add_(y, c["x"], c["a"], c["b"], c["index"], per, outs, seg, fused=fused))
        return us, err, err / max(ref.abs().max().item(), 1e-30)

    two_us, two_err, two_rel = measure(False)
    one: dict[str, tuple[float, float, float]] = {}
    for t in tiles:
        with fused_tiles(t):
            one[t] = measure(True)
    used = len({s for s in c["index"].tolist() if s})
    size = c["x"].element_size()
    a_rows = rank * len(outs)
    moved = (used * a_rows * k + used * sum(outs) * rank) * size  # A and B of the slots in use
    if used:
        moved += (rows * k + 2 * rows * sum(outs)) * size + 2 * plan.splits * rows * a_rows * 4  # x, y, t partials
    return {"shape": name, "k": k, "outs": list(outs), "rank": rank, "rows": rows, "rows_per_index": per,
            "adapters": adapters, "grid": seg.grid, "splits": plan.splits, "one_launch_picked": picked,
            "lora_us": one[tiles[0]][0] if picked else two_us, "two_launch_us": two_us,
            "one_launch_us": {t: v[0] for t, v in one.items()}, "two_launch_max_abs_err": two_err,
            "one_launch_max_abs_err": {t: v[1] for t, v in one.items()},
            "max_rel_err": max(two_rel, *(v[2] for v in one.values())),
            "base_gemm_us": gemm_us(timer, k, sum(outs), rows, device, dtype),
            "segment_rows_us": segments_us(timer, rows, per, adapters, device),
            "gbs": moved / two_us / 1e3, "delta_as_expected": changed}


@functools.cache
def gemm_us(timer: Callable, k: int, n: int, rows: int, device: str, dtype: torch.dtype) -> float:
    """The base linear at these rows (the same for every adapter count)."""
    x, w = torch.randn(rows, k, device=device, dtype=dtype), torch.randn(n, k, device=device, dtype=dtype)
    return timer(lambda: F.linear(x, w))


@functools.cache
def segments_us(timer: Callable, rows: int, per: int, adapters: int, device: str) -> float:
    """segment_rows once per step and row group (the same for every shape)."""
    index = torch.tensor([0 if adapters == 0 else 1 + i % adapters for i in range(rows // per)], device=device)
    return timer(lambda: lora_triton.segment_rows(index, per, ADAPTERS + 1))


def step_estimate(results: list[dict], lm_rows: int, adapters: int, key: str = "lora_us") -> float | None:
    """us of LoRA kernels in one decode step at lm_rows sequences (None when a shape was not measured)."""
    by = {(r["shape"], r["rows"], r["adapters"]): r[key] for r in results}
    total = 0.0
    for (shape, stack), count in STEP.items():
        rows = lm_rows if stack == "lm" else 2 * DIT_TOKENS * lm_rows
        if (shape, rows, adapters) not in by:
            return None
        total += count * by[(shape, rows, adapters)]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--tiny", action="store_true", help="small shapes; on CPU in Triton's interpreter")
    parser.add_argument("--fused-tiles", default="64x128",
                        help="other BLOCK_N x BLOCK_K of the one-launch kernel to time besides the module's, "
                             "comma-separated (default: %(default)s)")
    args = parser.parse_args()
    own = f"{lora_triton.FUSED_BLOCK_N}x{lora_triton.FUSED_BLOCK_K}"  # first: the one lora_add_ runs
    tiles = list(dict.fromkeys([own, *filter(None, args.fused_tiles.split(","))]))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        sys.exit("no GPU: run with --tiny (Triton's interpreter, small shapes)")
    if device == "cpu":
        torch.set_num_threads(1)
    shapes, row_counts = (TINY_SHAPES, TINY_ROWS) if args.tiny else (SHAPES, ROWS)
    rank = 4 if args.tiny else args.rank
    # the engine's dtype; Triton's interpreter mis-computes tl.dot on bf16 (numpy has none), so fp16 there
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    results = [run_case(name, k, outs, rank, rows, adapters, device, dtype, tiles)
               for name, (k, outs) in shapes.items() for rows in row_counts[name.split()[0]]
               for adapters in (0, 1, ADAPTERS)]
    sms = lora_triton.sm_count(torch.device(device))
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
              "sms": sms, "date": datetime.now(UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "git_commit": git_commit(), "dtype": str(dtype).removeprefix("torch."), "repeat": REPEAT,
              "tiny": args.tiny,
              "fused_tiles": tiles, "fused_max_bytes": lora_triton.FUSED_MAX_BYTES, "results": results,
              "step_us": {f"c={c} adapters={n}": step_estimate(results, c, n)
                          for c in CONCURRENCY for n in (0, 1, ADAPTERS)},
              "step_us_two_launches": {f"c={c} adapters={n}": step_estimate(results, c, n, "two_launch_us")
                                       for c in CONCURRENCY for n in (0, 1, ADAPTERS)}}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{report['device']}, {sms} SMs, {report['dtype']}, rank {rank}; us per call, median of CUDA-graph "
          f"replays of {REPEAT} calls" if device == "cuda" else f"{report['device']}: checks only, times mean nothing")
    print("2-launch: shrink + expand; 1-launch NxK: the fused kernel at BLOCK_N x BLOCK_K; pick: what lora_add_ runs; "
          "abs err: of the delta, 1-launch the worst tiles")
    print(f"{'shape':<8}{'rows':>6}{'per':>4}{'adapt':>6}{'grid':>5}{'split':>6}{'pick':>5}{'2-launch':>9}"
          + "".join(f"{'1@' + t:>10}" for t in tiles)
          + f"{'gemm us':>9}{'seg us':>8}{'abs err 2':>10}{'abs err 1':>10}")
    for r in results:
        print(f"{r['shape']:<8}{r['rows']:>6}{r['rows_per_index']:>4}{r['adapters']:>6}{r['grid']:>5}"
              f"{r['splits']:>6}{'1' if r['one_launch_picked'] else '2':>5}{r['two_launch_us']:>9.1f}"
              + "".join(f"{r['one_launch_us'][t]:>10.1f}" for t in tiles)
              + f"{r['base_gemm_us']:>9.1f}{r['segment_rows_us']:>8.1f}{r['two_launch_max_abs_err']:>10.1e}"
              f"{max(r['one_launch_max_abs_err'].values()):>10.1e}")
    for key, us in report["step_us"].items():
        two = report["step_us_two_launches"][key]
        if us is not None and two is not None and device == "cuda":
            print(f"LoRA kernels per decode step, {key}: {us / 1e3:.2f} ms (two launches everywhere: "
                  f"{two / 1e3:.2f} ms)")
    bad = [r for r in results if r["max_rel_err"] > 2e-2 or not r["delta_as_expected"]]
    if bad:
        sys.exit(f"{len(bad)} cases differ from the torch reference (or left y unchanged with adapters): {bad[:3]}")


if __name__ == "__main__":
    main()
