"""Triton batched-LoRA kernels: y[m] += (x[m] @ A[slot(m)]^T) @ B[slot(m)]^T for a flat batch of rows.

Two kernels, Punica-style: `shrink` (x -> rank space, fp32) and `expand` (rank space -> out, added in place). The
slot of row m is `index[m // rows_per_index]` (LocDiT rows repeat a sequence's slot over its tokens). A block of
BLOCK_M rows whose slots agree (prefill chunks: one sequence's tokens) runs as one `tl.dot`; a mixed block (decode
rows of different sequences) gathers each row's adapter on its own. Shapes come from host ints and the slot table is
read in-kernel, so a fixed batch shape replays under a CUDA graph with new slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_M = 16
BLOCK_K = 32
BLOCK_N = 64


@triton.jit
def _add(a, b):
    # tl.sum / tl.zeros are @jit library functions, which the interpreter cannot call when triton was imported
    # before TRITON_INTERPRET was set (torch imports it): builtins and our own combine function only
    return a + b


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, idx_ptr, t_ptr, M, K, rows_per_index,
                        stride_xm, stride_as, stride_ar, stride_tm,
                        RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    first = tl.load(idx_ptr + (tl.program_id(0) * BLOCK_M) // rows_per_index).to(tl.int64)
    slots = tl.load(idx_ptr + rows // rows_per_index, mask=row_ok, other=0).to(tl.int64)
    others = tl.reduce(tl.where(row_ok & (slots != first), 1, 0), 0, _add)
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < RANK
    if others == 0:  # one adapter for the whole block
        acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
        a_base = a_ptr + first * stride_as
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_base + ranks[None, :] * stride_ar + ks[:, None],
                        mask=rank_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(x, a, acc, input_precision=PRECISION)
        tl.store(t_ptr + rows[:, None] * stride_tm + ranks[None, :], acc, mask=row_ok[:, None])
    else:
        for m in tl.static_range(BLOCK_M):
            row = tl.program_id(0) * BLOCK_M + m
            if row < M:
                slot = tl.load(idx_ptr + row // rows_per_index).to(tl.int64)
                acc_r = tl.full((BLOCK_R,), 0.0, tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    k_ok = ks < K
                    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + ks, mask=k_ok, other=0.0).to(tl.float32)
                    a = tl.load(a_ptr + slot * stride_as + ranks[:, None] * stride_ar + ks[None, :],
                                mask=rank_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                    acc_r += tl.reduce(a * x[None, :], 1, _add)
                tl.store(t_ptr + row * stride_tm + ranks, acc_r)


@triton.jit
def _lora_expand_kernel(t_ptr, b_ptr, idx_ptr, y_ptr, M, N, rows_per_index,
                        stride_tm, stride_bs, stride_bn, stride_ym,
                        RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                        PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    first = tl.load(idx_ptr + (tl.program_id(0) * BLOCK_M) // rows_per_index).to(tl.int64)
    slots = tl.load(idx_ptr + rows // rows_per_index, mask=row_ok, other=0).to(tl.int64)
    others = tl.reduce(tl.where(row_ok & (slots != first), 1, 0), 0, _add)
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < RANK
    if others == 0:
        t = tl.load(t_ptr + rows[:, None] * stride_tm + ranks[None, :], mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptr + first * stride_bs + cols[None, :].to(tl.int64) * stride_bn + ranks[:, None],
                    mask=col_ok[None, :] & rank_ok[:, None], other=0.0)
        delta = tl.dot(t.to(b.dtype), b, input_precision=PRECISION)
        y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)
    else:
        for m in tl.static_range(BLOCK_M):
            row = tl.program_id(0) * BLOCK_M + m
            if row < M:
                slot = tl.load(idx_ptr + row // rows_per_index).to(tl.int64)
                t = tl.load(t_ptr + row * stride_tm + ranks)
                b = tl.load(b_ptr + slot * stride_bs + cols[:, None].to(tl.int64) * stride_bn + ranks[None, :],
                            mask=col_ok[:, None] & rank_ok[None, :], other=0.0).to(tl.float32)
                delta = tl.reduce(b * t.to(b.dtype).to(tl.float32)[None, :], 1, _add)
                y_ptrs = y_ptr + row.to(tl.int64) * stride_ym + cols
                y = tl.load(y_ptrs, mask=col_ok, other=0.0)
                tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=col_ok)


def lora_add_(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, index: Tensor, rows_per_index: int) -> None:
    """y [M, N] += per-row LoRA of x [M, K]: A [S, R, K], B [S, N, R] (scaling folded in), slot of row m =
    index[m // rows_per_index]. x and y row-major with unit column stride; the rank intermediate is fp32."""
    m, k = x.shape
    n, rank = lora_b.shape[1], lora_a.shape[1]
    if m == 0:
        return
    block_r = max(16, triton.next_power_of_2(rank))
    t = torch.empty((m, block_r), device=x.device, dtype=torch.float32)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays exact; half types use tensor cores
    grid_m = triton.cdiv(m, BLOCK_M)
    _lora_shrink_kernel[(grid_m,)](x, lora_a, index, t, m, k, rows_per_index,
                                   x.stride(0), lora_a.stride(0), lora_a.stride(1), t.stride(0),
                                   RANK=rank, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K,
                                   PRECISION=precision)
    _lora_expand_kernel[(grid_m, triton.cdiv(n, BLOCK_N))](t, lora_b, index, y, m, n, rows_per_index,
                                                          t.stride(0), lora_b.stride(0), lora_b.stride(1),
                                                          y.stride(0), RANK=rank, BLOCK_M=BLOCK_M,
                                                          BLOCK_R=block_r, BLOCK_N=BLOCK_N, PRECISION=precision)
