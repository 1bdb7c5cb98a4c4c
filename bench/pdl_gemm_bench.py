"""Would batch-1 GEMMs chain faster as Triton kernels launched as programmatic dependents (PDL)? (H200 only)

A batch-1 step is ~1,900 dependent kernels in a CUDA graph. Its LocDiT alone is 3.9 ms in ~1,200 kernels, while its
weights take ~0.9 ms to read from HBM. Each GEMM costs 4.8-7.4 us cold and is only 12-26% faster with its weights
already in L2 (docs/decisions.md, L2 prefetch): what each kernel pays is mostly fixed latency (launch,
prologue, ramp) in series with its neighbours.

With PDL, a kernel can start while the one before it still runs. It loads what does not depend on that kernel (its
weights) and waits (`griddepcontrol.wait`) only before reading the activations. cuBLAS GEMMs are not launched that
way, so this tries a Triton skinny GEMM (all rows in one tile; one program per BLOCK_N output columns, walking K).

s14a measured it slower than cuBLAS (LocDiT 8.6 against 6.7 us a GEMM), slower again with PDL (9.1) and with an L2
prefetch (10.7). This version asks why, one GEMM shape at a time, cold (a chain of `layers` GEMMs with weights of
their own) and hot (one weight over and over, from L2):
- `cublas`: torch.mm, as the engine runs these GEMMs now (with its kernels' names and eager device times);
- `triton`: the Triton GEMM, launched normally; `pdl`: as a programmatic dependent that lets the next kernel start
  first thing; `pdl_late`: one that lets it start only after its K loop, so at most one kernel waits ahead;
- `split*`: the same with K split so that every SM gets ~2 programs (more bytes in flight); the last split of a
  column block to finish adds the partial sums, in the same launch; `_l2`: each program also asks L2 for its whole
  weight slice (`cp.async.bulk.prefetch.L2`) before the wait.

Outputs are checked against fp32 first (twice, into a NaN-poisoned output).

    python bench/pdl_gemm_bench.py [--out pdl_gemm.json]      (GPU, ~40 s)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl
from gateway_proc import save_probe  # bench/ is on the path when this runs as a script
from lora_bench import step_graph_us
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

REPLAYS = 50
HBM_BYTES_PER_S = 4.8e12  # H200
# (rows, layers, [(K, N) of q|k|v, o, gate|up, down]): VoxCPM2's LocDiT at c=1, and its base and residual LMs at c=1
STACKS = {
    "dit": (22, 12, [(1024, 2560), (2048, 1024), (1024, 8192), (4096, 1024)]),
    "lm": (1, 36, [(2048, 2560), (2048, 2048), (2048, 12288), (6144, 2048)]),
}
VARIANTS = ("cublas", "triton", "pdl", "pdl_late", "split", "split_pdl", "split_pdl_late", "split_pdl_late_l2")
# (BLOCK_N, BLOCK_K, num_warps, num_stages); s14a tried four, this one the others did not beat by more than 7%
TILES = [(16, 256, 4, 4)]
SMS = 132  # the H200's; main() reads the device's


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, partial_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        PDL: tl.constexpr, L2_PREFETCH: tl.constexpr):
    """y[:, cols] = x @ W[cols]^T for this program's BLOCK_N columns and 1/SPLIT_K of K, all M (<= BLOCK_M) rows in
    one tile. PDL: 0 a plain launch, 1 let the next kernel start first thing, 2 only once this program's loads are
    issued (its K loop done)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    k_hi = tl.minimum(K, k_lo + k_span)
    w_rows = w_ptr + cols.to(tl.int64) * stride_wn  # [BLOCK_N] row starts of this program's W slice
    if PDL == 1:
        gdc_launch_dependents()  # the next kernel may start now: it waits for this one before reading its output
    if L2_PREFETCH:  # this program's slice, one bulk prefetch per W row (contiguous); nothing waits for it
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [w_rows + k_lo, tl.where(col_ok, (k_hi - k_lo) * 2, 0)], dtype=tl.int32, is_pure=False, pack=1)
    # the weights do not depend on the kernel before: the first block loads before the wait
    kk = k_lo + ks
    w = tl.load(w_rows[None, :] + kk[:, None], mask=col_ok[None, :] & (kk[:, None] < k_hi), other=0.0)
    if PDL != 0:
        gdc_wait()
    x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < k_hi),
                other=0.0)
    acc = tl.dot(x, w, tl.zeros((BLOCK_M, BLOCK_N), tl.float32))
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        kk = k0 + ks
        w = tl.load(w_rows[None, :] + kk[:, None], mask=col_ok[None, :] & (kk[:, None] < k_hi), other=0.0)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < k_hi),
                    other=0.0)
        acc = tl.dot(x, w, acc)
    if PDL == 2:
        gdc_launch_dependents()
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    else:
        # Split K in one launch: each split writes its fp32 partial sums, and the last split of these columns to
        # arrive (a counter per column block) adds them up and resets the counter for the next launch, so no memset
        # or second kernel joins the chain.
        partial = partial_ptr + (rows[:, None] * N + cols[None, :]).to(tl.int64)
        tl.store(partial + pid_k * BLOCK_M * N, acc, mask=col_ok[None, :])
        tl.debug_barrier()  # every thread's partials stored before the release below
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(partial + s * BLOCK_M * N, mask=col_ok[None, :], other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
            tl.store(count_ptr + pid_n, 0)


def split_for(n: int, k: int, block_n: int, block_k: int) -> int:
    """K splits that give every SM about two programs, each split at least two K blocks long."""
    programs = triton.cdiv(n, block_n)
    want = triton.next_power_of_2(triton.cdiv(2 * SMS, programs))
    return max(1, min(want, k // (2 * block_k)))


class SkinnyGemm:
    """out = x @ w^T with the Triton skinny GEMM (x [M <= 64, K], w [N, K], unit column strides), its split-K
    workspace and counters allocated once, as a graph needs."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, variant: str,
                 tiles: tuple[int, int, int, int]):
        self.x, self.w, self.out, self.tiles = x, w, out, tiles
        n, k = w.shape
        self.block_m = max(16, triton.next_power_of_2(x.shape[0]))
        self.split = split_for(n, k, tiles[0], tiles[1]) if "split" in variant else 1
        self.pdl = 2 if "late" in variant else 1 if "pdl" in variant else 0
        self.l2 = variant.endswith("_l2")
        self.partial = torch.empty(self.split * self.block_m * n, device=w.device, dtype=torch.float32)
        self.count = torch.zeros(triton.cdiv(n, tiles[0]), device=w.device, dtype=torch.int32)

    def __call__(self) -> None:
        block_n, block_k, warps, stages = self.tiles
        n, k = self.w.shape
        _skinny_gemm_kernel[(triton.cdiv(n, block_n), self.split)](
            self.x, self.w, self.out, self.partial, self.count, self.x.shape[0], n, k, self.x.stride(0),
            self.w.stride(0), self.out.stride(0), BLOCK_M=self.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            SPLIT_K=self.split, PDL=self.pdl, L2_PREFETCH=self.l2, num_warps=warps, num_stages=stages,
            launch_pdl=self.pdl != 0)


def chain(xs: dict[int, torch.Tensor], weights: list[torch.Tensor], variant: str,
          tiles: tuple[int, int, int, int]) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """GEMM after GEMM over `weights` (each [N, K] with its input xs[K]), and their outputs."""
    outs = [torch.empty(xs[w.shape[1]].shape[0], w.shape[0], device=w.device, dtype=w.dtype) for w in weights]
    if variant == "cublas":
        def run() -> None:
            for w, out in zip(weights, outs, strict=True):
                torch.mm(xs[w.shape[1]], w.t(), out=out)
        return run, outs
    gemms = [SkinnyGemm(xs[w.shape[1]], w, out, variant, tiles) for w, out in zip(weights, outs, strict=True)]

    def run_triton() -> None:
        for gemm in gemms:
            gemm()
    return run_triton, outs


def check(xs: dict[int, torch.Tensor], w: torch.Tensor, variant: str, tiles: tuple[int, int, int, int]) -> float:
    """Relative error against fp32 of two runs in a row into a NaN-poisoned output (the second run finds the split-K
    counters reset by the first); the larger of the two."""
    run, (out,) = chain(xs, [w], variant, tiles)
    want = xs[w.shape[1]].float() @ w.float().t()
    errors = []
    for _ in range(2):
        out.fill_(float("nan"))
        run()
        errors.append(float((out.float() - want).norm() / want.norm()))
    return max(errors)


def kernel_us(run: Callable[[], None]) -> dict[str, float]:
    """Device us per launch of each kernel that `run` launches (eagerly), by kernel name."""
    from torch.profiler import ProfilerActivity, profile
    run()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
    except Exception as e:  # the profiler is a side note: its failure must not cost the timings
        return {f"profiler failed: {type(e).__name__}: {e}"[:90]: -1.0}
    times: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(event.name[:90], []).append(event.device_time)
    return {name: round(sum(t) / len(t), 2) for name, t in times.items()}


def main() -> None:
    global SMS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("pdl_gemm_bench.py needs a GPU")
    SMS = torch.cuda.get_device_properties(0).multi_processor_count
    started = time.perf_counter()
    dtype = torch.bfloat16
    rows_out = []
    for stack, (rows, layers, shapes) in STACKS.items():
        xs = {k: torch.randn(rows, k, device="cuda", dtype=dtype) for k in {k for k, _ in shapes}}
        # one shape at a time: a chain of `layers` cold GEMMs (own weights each) and a hot one (one weight, in L2)
        for k, n in shapes:
            weights = [torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5 for _ in range(layers)]
            floor_us = 1e6 * n * k * 2 / HBM_BYTES_PER_S
            print(f"{stack} {rows} x {k} -> {n}: HBM floor {floor_us:.2f} us; split {split_for(n, k, *TILES[0][:2])}",
                  flush=True)
            for variant in VARIANTS:
                err = check(xs, weights[0], variant, TILES[0])
                assert err < 2e-2, f"{variant} {stack} {k}->{n}: relative error {err:.2e}"
                cold = step_graph_us(chain(xs, weights, variant, TILES[0])[0], REPLAYS)[0] / layers
                hot = step_graph_us(chain(xs, weights[:1] * layers, variant, TILES[0])[0], REPLAYS)[0] / layers
                kernels = kernel_us(chain(xs, weights, variant, TILES[0])[0]) if variant in ("cublas", "split") else {}
                rows_out.append({"stack": stack, "rows": rows, "k": k, "n": n, "variant": variant,
                                 "split_k": SkinnyGemm(xs[k], weights[0], torch.empty(0), variant, TILES[0]).split
                                 if variant != "cublas" else None,
                                 "cold_us": round(cold, 3), "hot_us": round(hot, 3), "floor_us": round(floor_us, 3),
                                 "rel_err": err, "kernels_eager_us": kernels})
                print(f"  {variant:18s} cold {cold:6.2f} us  hot {hot:6.2f} us  err {err:.1e}  "
                      + "  ".join(f"{name[:50]} {us}" for name, us in kernels.items()), flush=True)
            del weights
        torch.cuda.empty_cache()
    print("\nus a GEMM, cold (hot) | " + " | ".join(VARIANTS))
    for stack, (rows, _, shapes) in STACKS.items():
        for k, n in shapes:
            cells = {r["variant"]: r for r in rows_out if (r["stack"], r["k"], r["n"]) == (stack, k, n)}
            print(f"{stack} {rows}x{k}->{n} | " + " | ".join(
                f"{cells[v]['cold_us']:.2f} ({cells[v]['hot_us']:.2f})" for v in VARIANTS))
    save_probe(args.out, started, torch.cuda.get_device_name(), replays=REPLAYS, tiles=TILES[0], results=rows_out)


if __name__ == "__main__":
    main()
