"""The LMs' prefill GEMMs in bf16 against FP8 (`engine.model.fp8`: row quantization + `torch._scaled_mm`). (GPU)

A c=64 burst's prefill is 64 x ~111 positions through VoxCPM2's base LM (28 layers) and residual LM (8), each layer
four GEMMs (q|k|v, o, gate|up, down). For each shape at that burst's row count: bf16 `torch.mm`, the whole FP8
linear, and its two parts (the quantization kernel, `_scaled_mm` alone; also with fast, FP8-precision
accumulation), as median device times, with TFLOPS and the FP8 result's error against fp32. The last line: the 36
layers' GEMM time each way.

    python bench/fp8_bench.py [--rows 7104] [--out fp8.json]      (GPU, ~15 s)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine import kernels  # noqa: E402
from engine.model import fp8  # noqa: E402

LAYERS = 28 + 8  # VoxCPM2: base LM + residual LM, same widths
SHAPES = {"q|k|v": (2048, 2560), "o": (2048, 2048), "gate|up": (2048, 12288), "down": (6144, 2048)}  # (K, N)


def measure(rows: int, k: int, n: int) -> tuple[float, dict[str, float]]:
    """(The FP8 linear's error against fp32, median us of bf16 / the FP8 linear / its quantizer / its GEMM)."""
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
    return err, {key: 1e3 * do_bench(run, return_mode="median") for key, run in runs.items()}


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
        err, times = measure(args.rows, k, n)
        flop = 2 * args.rows * k * n
        row = {"gemm": name, "rows": args.rows, "k": k, "n": n, "fp8_rel_err": round(err, 5),
               **{f"{key}_us": round(us, 1) for key, us in times.items()},
               "bf16_tflops": round(flop / times["bf16"] / 1e6, 1),
               "scaled_mm_tflops": round(flop / times["scaled_mm"] / 1e6, 1)}
        results.append(row)
        print(f"{name:8s} {args.rows}x{k}->{n}: bf16 {times['bf16']:7.1f} us ({row['bf16_tflops']} TFLOPS)  "
              f"fp8 {times['fp8']:7.1f} = quantize {times['quantize']:5.1f} + scaled_mm {times['scaled_mm']:7.1f} "
              f"({row['scaled_mm_tflops']} TFLOPS; fast accumulation {times['scaled_mm_fast_accum']:7.1f})  "
              f"err {err:.4f}", flush=True)
    bf16_ms = LAYERS * sum(r["bf16_us"] for r in results) / 1e3
    fp8_ms = LAYERS * sum(r["fp8_us"] for r in results) / 1e3
    print(f"{LAYERS} layers' GEMMs at {args.rows} rows: bf16 {bf16_ms:.1f} ms, fp8 {fp8_ms:.1f} ms")
    report = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
              "seconds": round(time.perf_counter() - started, 1), "layers": LAYERS, "bf16_ms": round(bf16_ms, 2),
              "fp8_ms": round(fp8_ms, 2), "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
