"""Triton batched-LoRA kernels, Punica/S-LoRA shrink/expand: y[m] += (x[m] @ A[slot(m)]^T) @ B[slot(m)]^T.

Rows are grouped by slot on the device (`segment_rows`: a stable sort of the row slots and each slot's segment,
cut into tiles of BLOCK_M rows); a program handles one tile, so the adapter's weights are read once per tile, not
once per row. Every tile runs as `tl.dot`, a partial one (decode rows: a few rows per adapter) with its missing rows
masked: on tensor cores a 16-row tile with one valid row costs what a matvec costs, without a serial row loop.

The shrink is split over K: program (tile, split) reduces one K range and stores its fp32 partial in its own plane
of t [splits, M, r]; the expand sums the planes while it loads t. So a decode step's few tiles still spread over the
SMs (one tile alone would walk K=2048 serially on one SM), with no atomics (the result is bit-reproducible) and no
memset of t (slot-0 rows are never written nor read): two launches per linear. The split count comes from host ints
(rows, index entries, slots, K, SM count), so it is fixed per CUDA-graph bucket. Slot 0 (no adapter) gets no tiles:
programs beyond the last tile exit at once, and a step without adapters costs two empty launches per linear (one
on the one-launch path below). Every offset is read in-kernel, so a fixed batch shape replays under a CUDA graph
with new slots.

`shrink` maps x to rank space (fp32) over the stacked A's of linears sharing x (q/k/v: [S, 3r, in]); `expand` adds
each linear's part into its own column block of one fused output (B's stacked [S, q+k+v, r]).

Decode-sized batches take one launch instead (`_fused_kernel`): program (tile, column tile) recomputes its tile's
shrink over all of K, for the rank block of its column tile's part only, keeps t in registers and adds t @ B^T into
its y tile. The shrink is repeated once per column tile, from L2; `fuse` picks the path from host ints.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_M = 16
BLOCK_K = 64  # bf16 q|k|v shrink (A tile [64, 128]): ptxas sm_90 72 registers, no spills, 36 KB shared (2 stages)
BLOCK_N = 64
MAX_SPLITS = 16  # the expand unrolls this many (masked) loads of t's planes
PROGRAMS_PER_SM = 2  # split K until tiles x splits reaches this many programs per SM
CPU_SMS = 132  # an H200's SM count: CPU tensors (interpreter tests, compile cases) plan like the GPU the engine uses
# The one-launch kernel's tiles. bf16, 4 warps: t 16 x r fp32, A 128 x r, B r x 128, x 16 x 128, y 16 x 128 fp32 are
# ~60 registers a thread at r 32; ptxas sm_90a: 64 registers at r 32, 94 at r 64, 128 at r 128, no spills, 24 KB
# shared at r 32. A column tile of 128 halves the repeated shrinks (and the programs) against 64.
FUSED_BLOCK_N = 128
FUSED_BLOCK_K = 128  # the K walk is serial in each program: fewer, larger steps keep more loads in flight
FUSED_MAX_ROWS = 256  # decode sizes; prefill chunks keep the two launches
FUSED_MAX_BYTES = 32 << 20  # A and x the one-launch kernel reads in all, mostly again from L2 (see `fuse`)


class Segments(NamedTuple):
    """Rows grouped by slot: `order` [M] row ids sorted by slot, `starts` [S+1] each slot's first position in
    `order`, `tiles` [S+1] each slot's first tile (slot 0 has none); `grid` bounds the tile count from shapes."""

    order: Tensor
    starts: Tensor
    tiles: Tensor
    grid: int


class Plan(NamedTuple):
    """Launch shape of one linear's shrink: `splits` K ranges of `k_per_split` columns (a multiple of BLOCK_K)."""

    splits: int
    k_per_split: int


def segment_rows(index: Tensor, rows_per_index: int, num_slots: int) -> Segments:
    """Group the rows (slot of row m = index[m // rows_per_index]) by slot with device ops only (no host sync, so
    a CUDA graph can capture it); computed once per step and row group, shared by every linear."""
    slots = index[:, None].expand(-1, rows_per_index).reshape(-1)  # repeat_interleave would sync
    rows = slots.shape[0]
    ordered, order = torch.sort(slots, stable=True)
    starts = torch.searchsorted(ordered, torch.arange(num_slots + 1, device=index.device, dtype=ordered.dtype))
    tiles = (starts.diff() + BLOCK_M - 1) // BLOCK_M
    # slot 0: the linear's output as it is; zero_() because `tiles[0] = 0` copies a CPU scalar (refused in capture)
    tiles[:1].zero_()
    tiles = torch.cat((tiles.new_zeros(1), tiles.cumsum(0)))
    # each adapter in use adds at most one partial tile, and at most min(slots, index entries) are in use: a LocDiT
    # step of one sequence (22 rows, 2 entries) needs 4 programs, not one per row
    partial = min(num_slots - 1, index.shape[0])
    grid = max(1, min(rows, triton.cdiv(rows, BLOCK_M) + partial))
    return Segments(order.to(torch.int32), starts.to(torch.int32), tiles.to(torch.int32), grid)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's SM count (CPU_SMS for CPU tensors)."""
    if device.type != "cuda":
        return CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan(k: int, grid: int, device: torch.device) -> Plan:
    """Split K so that grid x splits >= PROGRAMS_PER_SM x SMs (capped by MAX_SPLITS and K's BLOCK_K chunks); from
    host ints only, so one graph bucket always gets the same plan."""
    chunks = triton.cdiv(k, BLOCK_K)
    splits = max(1, min(MAX_SPLITS, chunks, triton.cdiv(PROGRAMS_PER_SM * sm_count(device), grid)))
    per = triton.cdiv(chunks, splits)
    return Plan(triton.cdiv(chunks, per), per * BLOCK_K)  # no empty split: the last one may be shorter


def fuse(m: int, k: int, rank: int, col_tiles: int, grid: int, itemsize: int) -> bool:
    """Whether `lora_add_` takes the one-launch kernel (`col_tiles` of FUSED_BLOCK_N); from host ints only, so one
    graph bucket always takes the same path."""
    # Each of grid x col_tiles programs reads its part's A block (rank x K) and its tile's rows of x (masked rows
    # are not read; each row is in one tile): col_tiles x K x itemsize x (grid x rank + m) bytes, the first pass
    # from HBM and the repeats from L2. Two launches read A once (3r rows for q|k|v) but pay a second launch
    # (~3-5 us in a graph) and t's fp32 round trip. 32 MiB is ~5 us of L2 reads at ~6 TB/s: about the launch saved.
    # VoxCPM2 at r 32, bf16 (fused tiles: q|k|v 16+2+2, LM o 16, LocDiT o 8), 32 adapters: LocDiT q|k|v (K 1024)
    # 22 rows (grid 4) 5.9 MiB, 88 rows (grid 14) 21 MiB, 176 rows (grid 27) 41 MiB, 1408 rows (grid 120) 205 MiB;
    # LM q|k|v (K 2048) 1 row 2.6 MiB, 8 rows 21 MiB, 16 rows 41 MiB. So LocDiT up to 4 sequences, LM up to 8.
    return m <= FUSED_MAX_ROWS and col_tiles * k * itemsize * (grid * rank + m) <= FUSED_MAX_BYTES


@triton.jit
def _add(a, b):
    # tl.sum / tl.zeros are @jit library functions, which the interpreter cannot call when triton was imported
    # before TRITON_INTERPRET was set (torch imports it): builtins and our own combine function only
    return a + b


@triton.jit
def _tile(order_ptr, tiles_ptr, starts_ptr, NUM_SLOTS, BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr):
    """(slot, row ids [BLOCK_M] int64, which of them are valid) of this program's tile; slot == NUM_SLOTS: none."""
    tile = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    ends = tl.load(tiles_ptr + 1 + s, mask=s < NUM_SLOTS, other=2 ** 30)
    slot = tl.reduce(tl.where(ends <= tile, 1, 0), 0, _add)
    safe = tl.minimum(slot, NUM_SLOTS - 1)
    first = tl.load(starts_ptr + safe) + (tile - tl.load(tiles_ptr + safe)) * BLOCK_M
    m = tl.arange(0, BLOCK_M)
    # a partial tile (the slot's last rows) masks the rest; a program without a tile masks all
    row_ok = (m < tl.load(starts_ptr + safe + 1) - first) & (slot < NUM_SLOTS)
    rows = tl.load(order_ptr + first + m, mask=row_ok, other=0).to(tl.int64)
    return slot, rows, row_ok


@triton.jit
def _columns(N0, N1, N2, BLOCK_N: tl.constexpr):
    """(part j (q, k or v) of the fused output, its columns [BLOCK_N] int64, which are valid) of this program's
    column tile (program_id 1); the part picks the rank block of t, too."""
    tile = tl.program_id(1)
    tiles0 = (N0 + BLOCK_N - 1) // BLOCK_N
    tiles01 = tiles0 + (N1 + BLOCK_N - 1) // BLOCK_N
    part = (tile >= tiles0).to(tl.int32) + (tile >= tiles01).to(tl.int32)
    part_tile = tile - tl.where(part == 0, 0, tl.where(part == 1, tiles0, tiles01))
    part_cols = tl.where(part == 0, N0, tl.where(part == 1, N1, N2))
    local = part_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (tl.where(part == 0, 0, tl.where(part == 1, N0, N0 + N1)) + local).to(tl.int64)
    return part, cols, local < part_cols


@triton.jit
def _add_delta(t, b_base, y_ptr, rows, row_ok, cols, col_ok, ranks, rank_ok, stride_bn, stride_ym,
               PRECISION: tl.constexpr):
    """y[rows, cols] += t (fp32 [rows, ranks]) @ B[cols, ranks]^T, B being the slot's."""
    b = tl.load(b_base + cols[None, :] * stride_bn + ranks[:, None], mask=col_ok[None, :] & rank_ok[:, None],
                other=0.0)
    delta = tl.dot(t.to(b.dtype), b, input_precision=PRECISION)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    y_ok = row_ok[:, None] & col_ok[None, :]
    y = tl.load(y_ptrs, mask=y_ok, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=y_ok)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, order_ptr, starts_ptr, tiles_ptr, t_ptr, K, K_PER_SPLIT, NUM_SLOTS,
                   stride_xm, stride_as, stride_ar, stride_ts, stride_tm,
                   RANK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    slot, rows, row_ok = _tile(order_ptr, tiles_ptr, starts_ptr, NUM_SLOTS, BLOCK_S, BLOCK_M)
    if slot < NUM_SLOTS:
        split = tl.program_id(1)
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < RANK
        a_base = a_ptr + slot.to(tl.int64) * stride_as
        k_lo = split * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_hi
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            a = tl.load(a_base + ranks[None, :] * stride_ar + ks[:, None],
                        mask=rank_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(x, a, acc, input_precision=PRECISION)
        tl.store(t_ptr + split * stride_ts + rows[:, None] * stride_tm + ranks[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _expand_kernel(t_ptr, b_ptr, order_ptr, starts_ptr, tiles_ptr, y_ptr, N0, N1, N2, SPLITS, NUM_SLOTS,
                   stride_ts, stride_tm, stride_bs, stride_bn, stride_ym,
                   RANK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    slot, rows, row_ok = _tile(order_ptr, tiles_ptr, starts_ptr, NUM_SLOTS, BLOCK_S, BLOCK_M)
    if slot < NUM_SLOTS:
        part, cols, col_ok = _columns(N0, N1, N2, BLOCK_N)
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < RANK
        t_ptrs = t_ptr + rows[:, None] * stride_tm + (part * RANK + ranks)[None, :]
        t_ok = row_ok[:, None] & rank_ok[None, :]
        t = tl.load(t_ptrs, mask=t_ok, other=0.0)
        # the shrink's K-split partials; unrolled so their loads are in flight together (a runtime loop would
        # wait on each in turn), the planes past SPLITS masked off
        for s in tl.static_range(1, MAX_SPLITS):
            t += tl.load(t_ptrs + s * stride_ts, mask=t_ok & (s < SPLITS), other=0.0)
        _add_delta(t, b_ptr + slot.to(tl.int64) * stride_bs, y_ptr, rows, row_ok, cols, col_ok, ranks, rank_ok,
                   stride_bn, stride_ym, PRECISION)


@triton.jit
def _fused_kernel(x_ptr, a_ptr, b_ptr, order_ptr, starts_ptr, tiles_ptr, y_ptr, K, N0, N1, N2, NUM_SLOTS,
                  stride_xm, stride_as, stride_ar, stride_bs, stride_bn, stride_ym,
                  RANK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    slot, rows, row_ok = _tile(order_ptr, tiles_ptr, starts_ptr, NUM_SLOTS, BLOCK_S, BLOCK_M)
    if slot < NUM_SLOTS:
        part, cols, col_ok = _columns(N0, N1, N2, BLOCK_N)
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < RANK
        # only this part's rank block of A: a q|k|v column tile needs r x K of it, not 3r x K
        a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + (part * RANK + ranks)[None, :] * stride_ar
        t = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            a = tl.load(a_ptrs + ks[:, None], mask=rank_ok[None, :] & k_ok[:, None], other=0.0)
            t = tl.dot(x, a, t, input_precision=PRECISION)
        _add_delta(t, b_ptr + slot.to(tl.int64) * stride_bs, y_ptr, rows, row_ok, cols, col_ok, ranks, rank_ok,
                   stride_bn, stride_ym, PRECISION)


def lora_add_(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, index: Tensor, rows_per_index: int,
              outs: tuple[int, ...] | None = None, segments: Segments | None = None, fused: bool | None = None) -> None:
    """y [M, N] += per-row LoRA of x [M, K]; slot of row m = index[m // rows_per_index]. A [S, parts * r, K] and
    B [S, N, r] (scaling folded in) stack the LoRAs of up to three linears sharing x, whose outputs `outs` (default
    (N,)) are y's column blocks in order. x and y have unit column stride; the rank intermediate is fp32.
    `segments` (from `segment_rows`) can be shared by every linear of a step; `fused` forces a path (default:
    `fuse` picks)."""
    m, k = x.shape
    outs = outs or (lora_b.shape[1],)
    rank, slots = lora_b.shape[2], lora_a.shape[0]
    if len(outs) > 3 or sum(outs) != lora_b.shape[1] or lora_a.shape[1] != rank * len(outs):
        raise ValueError(f"LoRA shapes disagree: A {list(lora_a.shape)}, B {list(lora_b.shape)}, outs {outs}")
    if m == 0:
        return
    seg = segments or segment_rows(index, rows_per_index, slots)
    block_s = triton.next_power_of_2(slots)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays exact; half types use tensor cores
    n0, n1, n2 = (*outs, 0, 0)[:3]
    expand_r = max(16, triton.next_power_of_2(rank))
    fused_tiles = sum(triton.cdiv(n, FUSED_BLOCK_N) for n in outs)
    if fused is None:
        fused = fuse(m, k, rank, fused_tiles, seg.grid, x.element_size())
    if fused:
        _fused_kernel[(seg.grid, fused_tiles)](x, lora_a, lora_b, seg.order, seg.starts, seg.tiles, y, k, n0, n1, n2,
                                               slots, x.stride(0), lora_a.stride(0), lora_a.stride(1),
                                               lora_b.stride(0), lora_b.stride(1), y.stride(0), RANK=rank,
                                               BLOCK_S=block_s, BLOCK_M=BLOCK_M, BLOCK_R=expand_r,
                                               BLOCK_N=FUSED_BLOCK_N, BLOCK_K=FUSED_BLOCK_K, PRECISION=precision)
        return
    split = plan(k, seg.grid, x.device)
    shrink_r = max(16, triton.next_power_of_2(rank * len(outs)))
    # empty: every plane a tile's rows read is written by its split; slot-0 rows are neither written nor read
    t = torch.empty((split.splits, m, shrink_r), device=x.device, dtype=torch.float32)
    _shrink_kernel[(seg.grid, split.splits)](x, lora_a, seg.order, seg.starts, seg.tiles, t, k, split.k_per_split,
                                             slots, x.stride(0), lora_a.stride(0), lora_a.stride(1), t.stride(0),
                                             t.stride(1), RANK=rank * len(outs), BLOCK_S=block_s, BLOCK_M=BLOCK_M,
                                             BLOCK_R=shrink_r, BLOCK_K=BLOCK_K, PRECISION=precision)
    col_tiles = sum(triton.cdiv(n, BLOCK_N) for n in outs)
    _expand_kernel[(seg.grid, col_tiles)](t, lora_b, seg.order, seg.starts, seg.tiles, y, n0, n1, n2, split.splits,
                                          slots, t.stride(0), t.stride(1), lora_b.stride(0), lora_b.stride(1),
                                          y.stride(0), RANK=rank, BLOCK_S=block_s, BLOCK_M=BLOCK_M,
                                          BLOCK_R=expand_r, BLOCK_N=BLOCK_N, MAX_SPLITS=MAX_SPLITS,
                                          PRECISION=precision)
