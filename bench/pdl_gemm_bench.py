"""Would batch-1 GEMMs chain faster as Triton kernels launched as programmatic dependents (PDL)? (H200 only)

A batch-1 step is ~1,900 dependent kernels in a CUDA graph. Its LocDiT alone is 3.9 ms in ~1,200 kernels, while its
weights take ~0.9 ms to read from HBM. Each GEMM costs 4.8-7.4 us cold and is only 12-26% faster with its weights
already in L2 (bench/results/README.md, s12 `prefetch.json`): what each kernel pays is mostly fixed latency (launch,
prologue, ramp) in series with its neighbours.

With PDL, a kernel can start while the one before it still runs. It loads what does not depend on that kernel (its
weights) and waits (`griddepcontrol.wait`) only before reading the activations. cuBLAS GEMMs are not launched that
way, so this tries a Triton skinny GEMM (all rows in one tile; one program per BLOCK_N output columns, walking K):
- `cublas`: torch.mm, as the engine runs these GEMMs now;
- `triton`: the Triton GEMM, launched normally;
- `pdl`: the same, launched as a programmatic dependent. Each program lets the next kernel start at once, loads its
  first weight block, then waits for the kernel before it;
- `pdl_l2`: `pdl`, where each program also asks L2 for its whole weight slice (`cp.async.bulk.prefetch.L2`) before
  the wait.

Each variant runs a CUDA graph of a stack's GEMMs in order (q|k|v, o, gate|up, down per layer; every layer its own
weights, so every GEMM starts cold as in a step): the LocDiT at 22 rows (c=1: 2 CFG rows x 11 tokens), both LMs at
one row. Outputs are checked against torch.mm first.

    python bench/pdl_gemm_bench.py [--out pdl_gemm.json]      (GPU, ~20 s)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl
from lora_bench import step_graph_us  # bench/ is on the path when this runs as a script
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

REPLAYS = 50
HBM_BYTES_PER_S = 4.8e12  # H200
# (rows, layers, [(K, N) of q|k|v, o, gate|up, down]): VoxCPM2's LocDiT at c=1, and its base and residual LMs at c=1
STACKS = {
    "dit": (22, 12, [(1024, 2560), (2048, 1024), (1024, 8192), (4096, 1024)]),
    "lm": (1, 36, [(2048, 2560), (2048, 2048), (2048, 12288), (6144, 2048)]),
}
VARIANTS = ("cublas", "triton", "pdl", "pdl_l2")
# (BLOCK_N, BLOCK_K, num_warps, num_stages) per variant run; the first is the default, --tiles tries the rest
TILES = [(16, 256, 4, 4), (32, 128, 4, 4), (16, 128, 4, 6), (32, 256, 8, 3)]


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                        L2_PREFETCH: tl.constexpr):
    """y[:, cols] = x @ W[cols]^T for this program's BLOCK_N columns, all M (<= BLOCK_M) rows in one tile."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64) * stride_wn  # [BLOCK_N] row starts of this program's W slice
    if PDL:
        gdc_launch_dependents()  # the next kernel may start now: it waits for this one before reading its output
    if L2_PREFETCH:  # the whole slice, one bulk prefetch per W row (K * 2 bytes, contiguous); nothing waits for it
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [w_rows, tl.where(col_ok, K * 2, 0)], dtype=tl.int32, is_pure=False, pack=1)
    # the weights do not depend on the kernel before: the first block loads before the wait
    w = tl.load(w_rows[None, :] + ks[:, None], mask=col_ok[None, :] & (ks[:, None] < K), other=0.0)
    if PDL:
        gdc_wait()
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
    acc = tl.dot(x, w, tl.zeros((BLOCK_M, BLOCK_N), tl.float32))
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + ks
        w = tl.load(w_rows[None, :] + kk[:, None], mask=col_ok[None, :] & (kk[:, None] < K), other=0.0)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < K),
                    other=0.0)
        acc = tl.dot(x, w, acc)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, variant: str,
                tiles: tuple[int, int, int, int]) -> None:
    """out = x @ w^T with the Triton skinny GEMM (x [M <= 64, K], w [N, K], unit column strides)."""
    m, k = x.shape
    block_n, block_k, warps, stages = tiles
    pdl = variant in ("pdl", "pdl_l2")
    _skinny_gemm_kernel[(triton.cdiv(w.shape[0], block_n),)](
        x, w, out, m, w.shape[0], k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl,
        L2_PREFETCH=variant == "pdl_l2", num_warps=warps, num_stages=stages, launch_pdl=pdl)


def chain(xs: dict[int, torch.Tensor], weights: list[torch.Tensor], variant: str,
          tiles: tuple[int, int, int, int]) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """GEMM after GEMM over `weights` (each [N, K] with its input xs[K]), and their outputs."""
    outs = [torch.empty(xs[w.shape[1]].shape[0], w.shape[0], device="cuda", dtype=w.dtype) for w in weights]

    def run() -> None:
        for w, out in zip(weights, outs, strict=True):
            if variant == "cublas":
                torch.mm(xs[w.shape[1]], w.t(), out=out)
            else:
                skinny_gemm(xs[w.shape[1]], w, out, variant, tiles)
    return run, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tiles", action="store_true", help="every tile shape in TILES, not only the first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("pdl_gemm_bench.py needs a GPU")
    started = time.perf_counter()
    dtype = torch.bfloat16
    rows_out = []
    for stack, (rows, layers, shapes) in STACKS.items():
        xs = {k: torch.randn(rows, k, device="cuda", dtype=dtype) for k in {k for k, _ in shapes}}
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5 for _ in range(layers) for k, n in shapes]
        floor_us = 1e6 * sum(w.numel() * w.element_size() for w in weights) / HBM_BYTES_PER_S / len(weights)
        for tiles in TILES if args.tiles else TILES[:1]:
            for variant in VARIANTS:
                if variant == "cublas" and tiles != TILES[0]:
                    continue
                run, outs = chain(xs, weights[:len(shapes)], variant, tiles)
                run()
                torch.cuda.synchronize()
                for w, out in zip(weights, outs, strict=False):  # the first layer, against torch.mm
                    want = xs[w.shape[1]].float() @ w.float().t()
                    err = float((out.float() - want).norm() / want.norm())
                    assert err < 2e-2, f"{variant} {tuple(w.shape)}: relative error {err:.2e}"
                run, _ = chain(xs, weights, variant, tiles)
                us = step_graph_us(run, REPLAYS)[0] / len(weights)
                row = {"stack": stack, "rows": rows, "layers": layers, "variant": variant,
                       "tiles": None if variant == "cublas" else dict(zip(("block_n", "block_k", "warps", "stages"),
                                                                          tiles, strict=True)),
                       "us_per_gemm": round(us, 3), "us_per_layer": round(us * len(shapes), 2),
                       "hbm_floor_us_per_gemm": round(floor_us, 3)}
                rows_out.append(row)
                print(f"{stack} {rows:2d} rows x {layers} layers  {variant:7s} {str(tiles):18s} {us:6.2f} us a GEMM, "
                      f"{us * len(shapes):6.1f} a layer (HBM floor {floor_us:.2f} a GEMM)", flush=True)
        del weights
        torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(), "replays": REPLAYS, "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(sys.argv), "seconds": round(time.perf_counter() - started, 1), "results": rows_out}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
