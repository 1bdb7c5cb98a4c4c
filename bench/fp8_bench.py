"""The LMs' prefill GEMMs in bf16 against FP8 (`engine.model.fp8`: row quantization + `torch._scaled_mm`). (GPU)

A c=64 burst's prefill is 64 x ~111 positions through VoxCPM2's base LM (28 layers) and residual LM (8), each layer
four GEMMs (q|k|v, o, gate|up, down). For each shape at that burst's row count: bf16 `torch.mm`, the whole FP8
linear, and its two parts (the quantization kernel, `_scaled_mm` alone; also with fast, FP8-precision
accumulation), as median device times, with TFLOPS and the FP8 result's error against fp32; then the kernels that
make the GEMM inputs, plain and quantizing as they write. The last line: the 36 layers' GEMM time each way.

    python bench/fp8_bench.py [--rows 7104] [--out fp8.json]      (GPU, ~15 s)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine import kernels  # noqa: E402
from engine.model import fp8  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_proc import save_probe  # noqa: E402

LAYERS = 28 + 8  # VoxCPM2: base LM + residual LM, same widths
SHAPES = {"q|k|v": (2048, 2560), "o": (2048, 2048), "gate|up": (2048, 12288), "down": (6144, 2048)}  # (K, N)


def measure(rows: int, k: int, n: int) -> tuple[float, float, dict[str, float]]:
    """(The FP8 linear's error against fp32, fast accumulation's difference from exact accumulation on the same FP8
    inputs, median us of bf16 / the FP8 linear / its quantizer / its GEMM, with either accumulation)."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    w = fp8.quantized((linear,))
    q, scale = kernels.quantize_rows_fp8(x)
    want = x.float() @ linear.weight.float().t()
    err = float((fp8.linear(x, w).float() - want).norm() / want.norm())
    runs = {"bf16": lambda: torch.mm(x, linear.weight.t()), "fp8": lambda: fp8.linear(x, w),
            "quantize": lambda: kernels.quantize_rows_fp8(x),
            "scaled_mm": lambda: torch._scaled_mm(q, w.weight.t(), scale_a=scale, scale_b=w.scale,
                                                  out_dtype=torch.bfloat16),
            "scaled_mm_fast_accum": lambda: torch._scaled_mm(q, w.weight.t(), scale_a=scale, scale_b=w.scale,
                                                             out_dtype=torch.bfloat16, use_fast_accum=True)}
    exact, fast = runs["scaled_mm"]().float(), runs["scaled_mm_fast_accum"]().float()
    fast_err = float((fast - exact).norm() / exact.norm())
    return err, fast_err, {key: 1e3 * do_bench(run, return_mode="median") for key, run in runs.items()}


def producers(rows: int) -> dict[str, float]:
    """Median us of the kernels that make the GEMM inputs, plain (bf16 out) and with their input already quantized
    (FP8 out): the norm after a residual add (2,048 wide) and silu_mul (6,144 wide)."""
    x, h = (torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    weight = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(rows, 2 * 6144, device="cuda", dtype=torch.bfloat16)
    runs = {"add_rms_norm": lambda: kernels.add_rms_norm(x, h, weight, 1e-5),
            "add_rms_norm_fp8": lambda: kernels.add_rms_norm_fp8(x, h, weight, 1e-5),
            "silu_mul": lambda: kernels.silu_mul(gate_up), "silu_mul_fp8": lambda: kernels.silu_mul_fp8(gate_up)}
    return {key: round(1e3 * do_bench(run, return_mode="median"), 1) for key, run in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=7104, help="GEMM rows (default: a c=64 burst of 111 positions)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_bench.py needs a GPU")
    started = time.perf_counter()
    fp8.MIN_ROWS = 1
    results = []
    for name, (k, n) in SHAPES.items():
        err, fast_err, times = measure(args.rows, k, n)
        flop = 2 * args.rows * k * n
        row = {"gemm": name, "rows": args.rows, "k": k, "n": n, "fp8_rel_err": round(err, 5),
               "fast_accum_vs_exact": round(fast_err, 6),
               **{f"{key}_us": round(us, 1) for key, us in times.items()},
               "bf16_tflops": round(flop / times["bf16"] / 1e6, 1),
               "scaled_mm_tflops": round(flop / times["scaled_mm"] / 1e6, 1)}
        results.append(row)
        print(f"{name:8s} {args.rows}x{k}->{n}: bf16 {times['bf16']:7.1f} us ({row['bf16_tflops']} TFLOPS)  "
              f"fp8 {times['fp8']:7.1f} = quantize {times['quantize']:5.1f} + scaled_mm {times['scaled_mm']:7.1f} "
              f"({row['scaled_mm_tflops']} TFLOPS; fast accumulation {times['scaled_mm_fast_accum']:7.1f})  "
              f"err {err:.4f} (fast accumulation: {fast_err:.1e} from exact)", flush=True)
    made = producers(args.rows)
    print("producers (us): " + ", ".join(f"{key} {us}" for key, us in made.items()))
    bf16_ms = LAYERS * sum(r["bf16_us"] for r in results) / 1e3
    fp8_ms = LAYERS * sum(r["fp8_us"] for r in results) / 1e3
    # in the engine three of the four inputs come from producers that quantize them (no quantizer launch): the
    # GEMMs plus o's quantizer plus what quantizing costs the producers
    o_quantize_us = next(r["quantize_us"] for r in results if r["gemm"] == "o")
    engine_ms = (LAYERS * (sum(r["scaled_mm_us"] for r in results) + o_quantize_us
                           + 2 * (made["add_rms_norm_fp8"] - made["add_rms_norm"])
                           + made["silu_mul_fp8"] - made["silu_mul"]) / 1e3)
    print(f"{LAYERS} layers' GEMMs at {args.rows} rows: bf16 {bf16_ms:.1f} ms, fp8 {fp8_ms:.1f} ms with a quantizer "
          f"each, {engine_ms:.1f} ms with the producers quantizing")
    save_probe(args.out, started, torch.cuda.get_device_name(), layers=LAYERS, bf16_ms=round(bf16_ms, 2),
               fp8_ms=round(fp8_ms, 2), fp8_with_producers_ms=round(engine_ms, 2), producers_us=made, results=results)


if __name__ == "__main__":
    main()
