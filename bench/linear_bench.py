"""Few-rows linears on one GPU: cuBLAS (F.linear) against `engine.model.linear_triton.skinny_linear`.

The GEMMs of a batch-1 VoxCPM2 step (LocDiT: 22 rows = 2 CFG halves x 11 tokens; base and residual LM: 1 row), each
timed as a chain of distinct weight copies (together several times the L2, so every weight comes from HBM as in a
step) captured in one CUDA graph: us per linear = replay time / copies. Also the achieved weight bandwidth, the
relative error of each path against an fp32 matmul, and whether the Triton path gives the same bits twice.

    python bench/linear_bench.py [--out linear.json]     (CUDA only; ~1 minute)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model import linear_triton  # noqa: E402
from engine.model.linear_triton import skinny_linear, splits_for  # noqa: E402

CHAIN_BYTES = 400 * 2**20  # weights per chain: ~8x the H200's 50 MB L2
# (name, rows, out features N, in features K): VoxCPM2 at one stream
SHAPES = [
    ("dit_qkv", 22, 2560, 1024), ("dit_o", 22, 1024, 2048), ("dit_gate_up", 22, 8192, 1024),
    ("dit_down", 22, 1024, 4096),
    ("lm_qkv", 1, 2560, 2048), ("lm_o", 1, 2048, 2048), ("lm_gate_up", 1, 12288, 2048), ("lm_down", 1, 2048, 6144),
    ("locenc_gate_up", 5, 8192, 1024),
]
# (BLOCK_N, BLOCK_K, PROGRAMS_PER_SM, NUM_WARPS): the module's defaults first
VARIANTS = [(64, 128, 2, 4), (32, 128, 4, 4), (64, 128, 4, 4), (128, 64, 2, 4), (64, 256, 2, 8), (32, 256, 4, 4)]


def use_variant(variant: tuple[int, int, int, int]) -> None:
    linear_triton.BLOCK_N, linear_triton.BLOCK_K, linear_triton.PROGRAMS_PER_SM, linear_triton.NUM_WARPS = variant


def chain_us(fn, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """us per linear of fn(x, w) over every w, replayed from one CUDA graph."""
    for w in weights[:2]:
        fn(x, w)  # compile, pick kernels, make the counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    ms = do_bench(graph.replay, warmup=20, rep=200, return_mode="median")
    return ms * 1000 / len(weights)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    rows = []
    for name, m, n, k in SHAPES:
        nbytes = n * k * 2
        copies = max(4, min(256, CHAIN_BYTES // nbytes))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ weights[0].float().T
        ours = skinny_linear(x, weights[0])
        row = {"shape": name, "rows": m, "n": n, "k": k, "weight_mb": round(nbytes / 1e6, 2),
               "splits": splits_for(n, k, dev), "copies": copies,
               "cublas_rel_err": rel_err(F.linear(x, weights[0]), ref), "triton_rel_err": rel_err(ours, ref),
               "triton_same_bits": bool(torch.equal(ours, skinny_linear(x, weights[0])))}
        row["cublas_us"] = chain_us(F.linear, x, weights)
        row["variants_us"] = {}
        for variant in VARIANTS:
            use_variant(variant)
            row["variants_us"]["/".join(map(str, variant))] = round(chain_us(skinny_linear, x, weights), 2)
        use_variant(VARIANTS[0])
        best = min(row["variants_us"], key=row["variants_us"].get)
        row["best_variant"], row["triton_us"] = best, row["variants_us"][best]
        for path in ("cublas", "triton"):
            row[f"{path}_tbs"] = round(nbytes / row[f"{path}_us"] / 1e6, 2)
        row["speedup"] = round(row["cublas_us"] / row["triton_us"], 2)
        rows.append(row)
        print(f"{name}: {row}", file=sys.stderr)
        del weights
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(0), "shapes": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print("| shape | rows x K -> N | MB | cuBLAS us (TB/s) | best Triton us (TB/s) | variant | speedup | default | "
          "rel err cuBLAS / Triton | same bits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    default = "/".join(map(str, VARIANTS[0]))
    for r in rows:
        print(f"| {r['shape']} | {r['rows']} x {r['k']} -> {r['n']} | {r['weight_mb']} | "
              f"{r['cublas_us']:.2f} ({r['cublas_tbs']}) | {r['triton_us']:.2f} ({r['triton_tbs']}) | "
              f"{r['best_variant']} | {r['speedup']} | {r['variants_us'][default]} | "
              f"{r['cublas_rel_err']:.1e} / {r['triton_rel_err']:.1e} | {r['triton_same_bits']} |")


if __name__ == "__main__":
    main()
