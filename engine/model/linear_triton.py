"""Linears of a few rows on CUDA: y = x @ W^T for up to 32 rows in one Triton launch that spreads W over every SM.

At one stream the step's GEMMs have 1 row (the LMs) or 22 (the LocDiT: 2 CFG halves x 11 tokens), and only read
weights. cuBLAS picks tiles for them that leave most SMs idle or adds a split-K reduce kernel: on an H200 (profile of
a batch-1 step, 2026-12-02) they stream 4-17 MB of weights at 0.8-2.5 TB/s, 5-7 us each, ~650 of them a step.
Here the grid is column tiles x K splits sized to fill the SMs a few times over; each program streams its
[BLOCK_N, K / splits] slab of W once, and the last K split to arrive at a column tile sums the fp32 partials of all
splits in split order (bit-reproducible, no atomics on data) and writes y. The arrival counters are reset by that
last program, so one zeroed counter buffer per device serves every call in stream order.

Runs on CPU under TRITON_INTERPRET=1 for the tests (fp16/fp32 there: the interpreter's bf16 dot is wrong).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_ROWS = 32  # one row tile; more rows go to cuBLAS
BLOCK_N = 64
BLOCK_K = 128
PROGRAMS_PER_SM = 2
NUM_WARPS = 4
MAX_SPLITS = 32
MAX_COL_TILES = 1024  # counters per device: 65,536 output columns at BLOCK_N 64
CPU_SMS = 4


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else CPU_SMS


_counters: dict[torch.device, Tensor] = {}


def _counter_buffer(device: torch.device) -> Tensor:
    """The device's arrival counters (zeros between launches). Made on the first, eager call: a tensor made
    during CUDA-graph capture would live in that graph's private pool."""
    if device not in _counters:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_linear's first call on a device must run outside CUDA-graph capture")
        _counters[device] = torch.zeros(MAX_COL_TILES, device=device, dtype=torch.int32)
    return _counters[device]


def splits_for(n: int, k: int, device: torch.device) -> int:
    """K splits so that column tiles x splits fill the SMs PROGRAMS_PER_SM times (host ints only: one graph bucket
    always runs one plan)."""
    tiles = triton.cdiv(n, BLOCK_N)
    chunks = triton.cdiv(k, BLOCK_K)
    return max(1, min(MAX_SPLITS, chunks, triton.cdiv(PROGRAMS_PER_SM * _sm_count(device), tiles)))


def supports(x: Tensor, weight: Tensor) -> bool:
    """Whether `skinny_linear` takes this linear: few rows, 2-D weight with unit column stride, no bias."""
    return (x.shape[-1] == weight.shape[1] and weight.dim() == 2 and weight.stride(1) == 1
            and 0 < x.numel() // max(1, x.shape[-1]) <= MAX_ROWS
            and triton.cdiv(weight.shape[0], BLOCK_N) <= MAX_COL_TILES and x.dtype == weight.dtype)


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K, K_PER_SPLIT, SPLITS,
                   stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PLANES: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None],
                    other=0.0)
        acc = tl.dot(x, w, acc)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    y_ok = row_ok[:, None] & col_ok[None, :]
    if SPLITS == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_ok)
    else:
        # this split's partial in its plane [SPLITS, BLOCK_M, N] (only the real rows are written and read)
        plane = BLOCK_M * N
        parts = part_ptr + rows[:, None] * N + cols[None, :]
        tl.store(parts + split * plane, acc, mask=y_ok)
        tl.debug_barrier()  # every warp's stores before the (one thread's) arrival, whose release covers them
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:  # the last: every plane is stored and visible (acquire)
            tl.store(count_ptr + tile, 0)
            s = tl.arange(0, PLANES)[:, None, None]
            planes = tl.load(parts[None, :, :] + s * plane, mask=y_ok[None, :, :] & (s < SPLITS), other=0.0,
                             cache_modifier=".cg")  # from L2, where the other SMs' stores are
            total = tl.reduce(planes, 0, tl.standard._sum_combine)  # the interpreter sums it with numpy
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_ok)


def skinny_linear(x: Tensor, weight: Tensor, splits: int | None = None) -> Tensor:
    """F.linear(x, weight) (no bias) for x [..., K] of at most MAX_ROWS rows, weight [N, K]; fp32 accumulation,
    output in x's dtype. `splits`: K splits (default `splits_for`)."""
    if not supports(x, weight):
        raise ValueError(f"skinny_linear takes up to {MAX_ROWS} rows of x [..., K] and weight [N, K] of its dtype "
                         f"(got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype})")
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    splits = splits or splits_for(n, k, x.device)
    per = triton.cdiv(triton.cdiv(k, BLOCK_K), splits) * BLOCK_K
    splits = triton.cdiv(k, per)  # no empty split
    counters = _counter_buffer(x.device)
    parts = torch.empty(splits, MAX_ROWS, n, device=x.device, dtype=torch.float32) if splits > 1 else y
    block_m = max(16, triton.next_power_of_2(m))
    _skinny_kernel[(triton.cdiv(n, BLOCK_N), splits)](
        rows, weight, y, parts, counters, m, n, k, per, splits, rows.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PLANES=triton.next_power_of_2(splits),
        num_warps=NUM_WARPS)
    return y.view(*x.shape[:-1], n)
