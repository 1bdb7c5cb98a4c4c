"""Micro-benchmark of the batched-LoRA kernels (engine.model.lora_triton.lora_add_) at VoxCPM2's LoRA'd linears.

Shapes (rank 32 by default, bf16 (fp16 under --tiny), 32 adapter slots + slot 0 as `--lora 32` registers): LM
q|k|v (K 2048 -> 2048, 256, 256) and o (2048 -> 2048), LocDiT q|k|v (1024 -> 2048, 256, 256) and o (2048 -> 1024).
Rows 1, 64 (LM decode at c=1 and 64), 22, 1408 (LocDiT: 2 CFG rows x 11 tokens per sequence, so 11 rows per index
entry) and 4096 (prefill), each with no adapter (slot 0 everywhere), one adapter, and 32 adapters spread round-robin
over the index entries.
Each case is checked against a per-slot torch reference, then timed as the engine runs it: `segments` computed once
(the engine shares them per step), a CUDA graph of REPEAT back-to-back calls, median replay time / REPEAT. The base
linear's GEMM at the same rows is timed the same way for scale, and the last lines add the kernels up over one
VoxCPM2 decode step (36 LM layers, 12 LocDiT layers x 10 Euler steps; the 4 projections left out).

    .venv/bin/python bench/lora_bench.py [--out lora.json] [--rank 32]   (GPU, ~1 minute)
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
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from datetime import UTC, datetime  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.model import lora_triton  # noqa: E402

ADAPTERS = 32
REPEAT = 20
ROWS = (1, 22, 64, 1408, 4096)
DIT_TOKENS = 11  # LocDiT tokens per sequence: mu x 2, t, 4 cond, 4 x
SHAPES = {  # name: (K, outs of the linears sharing x)
    "lm qkv": (2048, (2048, 256, 256)),
    "lm o": (2048, (2048,)),
    "dit qkv": (1024, (2048, 256, 256)),
    "dit o": (2048, (1024,)),
}
TINY_SHAPES = {"lm qkv": (256, (32, 16, 16)), "lm o": (128, (40,)), "dit qkv": (128, (32, 16, 16)),
               "dit o": (96, (24,))}
TINY_ROWS = (1, 22, 64)
# one VoxCPM2 decode step: (shape, LM rows or LocDiT rows) -> linears per step
STEP = {("lm qkv", "lm"): 28 + 8, ("lm o", "lm"): 28 + 8, ("dit qkv", "dit"): 12 * 10, ("dit o", "dit"): 12 * 10}


def rows_per_index(rows: int) -> int:
    return DIT_TOKENS if rows % (2 * DIT_TOKENS) == 0 else 1


def make_case(k: int, outs: tuple[int, ...], rank: int, rows: int, adapters: int, device: str,
              dtype: torch.dtype) -> dict:
    gen = torch.Generator(device).manual_seed(rows * 31 + k + adapters)
    per = rows_per_index(rows)
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
             dtype: torch.dtype) -> dict:
    c = make_case(k, outs, rank, rows, adapters, device, dtype)
    timer = graph_us if device == "cuda" else cpu_us
    seg = lora_triton.segment_rows(c["index"], c["per"], ADAPTERS + 1)
    plan = lora_triton.plan(k, seg.grid, torch.device(device))
    # checked on y = 0: the delta alone, so bf16's rounding of y cannot hide an error in it
    out = torch.zeros_like(c["y"])
    lora_triton.lora_add_(out, c["x"], c["a"], c["b"], c["index"], c["per"], outs, seg)
    ref = reference({**c, "y": out.new_zeros(out.shape)})
    err = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    changed = out.float().abs().max().item()
    y = c["y"].clone()
    us = timer(lambda: lora_triton.lora_add_(y, c["x"], c["a"], c["b"], c["index"], c["per"], outs, seg))
    base_us = timer(lambda: F.linear(c["x"], c["w"]))
    seg_us = timer(lambda: lora_triton.segment_rows(c["index"], c["per"], ADAPTERS + 1))
    used = len({s for s in c["index"].tolist() if s})
    size = c["x"].element_size()
    a_rows = rank * len(outs)
    moved = (used * a_rows * k + used * sum(outs) * rank) * size  # A and B of the slots in use
    if used:
        moved += (rows * k + 2 * rows * sum(outs)) * size + 2 * plan.splits * rows * a_rows * 4  # x, y, t partials
    return {"shape": name, "k": k, "outs": list(outs), "rank": rank, "rows": rows, "rows_per_index": c["per"],
            "adapters": adapters, "grid": seg.grid, "splits": plan.splits, "lora_us": us, "base_gemm_us": base_us,
            "segment_rows_us": seg_us, "gbs": moved / us / 1e3, "max_rel_err": err, "changed": changed > 0}


def step_estimate(results: list[dict], lm_rows: int, adapters: int) -> float | None:
    """us of LoRA kernels in one decode step at lm_rows sequences (None when a shape was not measured)."""
    by = {(r["shape"], r["rows"], r["adapters"]): r["lora_us"] for r in results}
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
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        sys.exit("no GPU: run with --tiny (Triton's interpreter, small shapes)")
    if device == "cpu":
        torch.set_num_threads(1)
    shapes, row_counts = (TINY_SHAPES, TINY_ROWS) if args.tiny else (SHAPES, ROWS)
    rank = 4 if args.tiny else args.rank
    # the engine's dtype; Triton's interpreter mis-computes tl.dot on bf16 (numpy has none), so fp16 there
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    results = [run_case(name, k, outs, rank, rows, adapters, device, dtype)
               for name, (k, outs) in shapes.items() for rows in row_counts for adapters in (0, 1, ADAPTERS)]
    sms = lora_triton.sm_count(torch.device(device))
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
              "sms": sms, "date": datetime.now(UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "dtype": str(dtype).removeprefix("torch."), "repeat": REPEAT, "tiny": args.tiny, "results": results,
              "step_us": {f"c={c} adapters={n}": step_estimate(results, c, n)
                          for c in (1, 64) for n in (0, 1, ADAPTERS)}}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{report['device']}, {sms} SMs, {report['dtype']}, rank {rank}; us per call, median of CUDA-graph "
          f"replays of {REPEAT} calls" if device == "cuda" else f"{report['device']}: checks only, times mean nothing")
    print(f"{'shape':<8}{'rows':>6}{'per':>4}{'adapt':>6}{'grid':>5}{'split':>6}{'lora us':>10}{'gemm us':>9}"
          f"{'seg us':>8}{'GB/s':>7}{'rel err':>9}")
    for r in results:
        print(f"{r['shape']:<8}{r['rows']:>6}{r['rows_per_index']:>4}{r['adapters']:>6}{r['grid']:>5}"
              f"{r['splits']:>6}{r['lora_us']:>10.1f}{r['base_gemm_us']:>9.1f}{r['segment_rows_us']:>8.1f}"
              f"{r['gbs']:>7.0f}{r['max_rel_err']:>9.1e}")
    for key, us in report["step_us"].items():
        if us is not None and device == "cuda":
            print(f"LoRA kernels per decode step, {key}: {us / 1e3:.2f} ms")
    bad = [r for r in results if r["max_rel_err"] > 2e-2 or r["changed"] != (r["adapters"] > 0)]
    if bad:
        sys.exit(f"{len(bad)} cases differ from the torch reference (or left y unchanged with adapters): {bad[:3]}")


if __name__ == "__main__":
    main()
