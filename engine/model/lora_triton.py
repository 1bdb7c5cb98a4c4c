"""Triton batched-LoRA kernels, Punica/S-LoRA shrink/expand: y[m] += (x[m] @ A[slot(m)]^T) @ B[slot(m)]^T.

Rows are grouped by slot on the device once per step and row group (`segment_rows`): a stable sort of the row slots,
each slot's segment cut into tiles of BLOCK_M rows, and a tile table (each tile's slot and row ids, written by one
small kernel) from which a LoRA program reads its rows with one load instead of searching the segments (a chain of
dependent loads every launch would pay again). A program handles one tile, so the adapter's weights are read once per
tile, not once per row. Every tile runs as `tl.dot`, a partial one (decode rows: a few rows per adapter) with its
missing rows masked: on tensor cores a 16-row tile with one valid row costs what a matvec costs, without a serial row
loop. Slot 0 (no adapter) gets no tiles: programs beyond the last tile read and write nothing (masks and empty K
ranges rather than an early exit, which would make the compiler load the rows only after the slot). Every offset is
read in-kernel and every launch shape comes from host ints (rows, index entries, slots, K, SM count), so a fixed batch
shape replays under a CUDA graph with new slots.

The shrink maps x to rank space (fp32) over the stacked A's of linears sharing x (q/k/v: [S, 3r, in]); the expand adds
each linear's part into its own column block of one fused output (B's stacked [S, q+k+v, r]). A linear runs one of
three ways (`Variant.path`); `choose` picks from host ints (SMALL_VARIANT where `fuse` allows one launch, LARGE_VARIANT
elsewhere), `lora_add_` runs any, and `VARIANTS` names the ones bench/lora_bench.py --step compares:

- "two": shrink, then expand. The shrink is split over K: program (tile, split) reduces one K range and stores its fp32
  partial in its own plane of t [splits, M, r]; the expand sums the planes while it loads t. So a decode step's few
  tiles still spread over the SMs (one tile alone would walk K=2048 serially on one SM), with no atomics (the result is
  bit-reproducible) and no memset of t (slot-0 rows are never written nor read). With `pdl` the expand is launched as a
  programmatic dependent of the shrink (Hopper): its programs start while the shrink runs, load their B and y tiles
  (which the shrink does not write) and wait for the shrink only before reading t, hiding the second launch.
- "one": one launch (`_fused_kernel`): program (tile, column tile) recomputes its tile's shrink over all of K, for the
  rank block of its column tile's part only, keeps t in registers and adds t @ B^T into its y tile. The shrink is
  repeated once per column tile, from L2, and each program walks all of K serially: with cold weights (a step's layers
  evict each other's from L2) that walk is a chain of HBM round trips.
- "split": one launch with K split as well (`_split_kernel`): program (tile, column tile, split) reduces its K range
  for its part into its own fp32 plane and counts its arrival on the (tile, column tile)'s counter; the last to arrive
  sums the planes (one fixed reduction: bit-reproducible, whoever is last) and adds t @ B^T. Its B and y tiles are
  loaded before the shrink, so their latency hides behind it. The counters are zeroed once per step (in `Segments`)
  and each last arrival resets its own, so the linears sharing the segments need no memset; they must run in stream
  order (one stream, as the engine runs). When the plan gives one split it is the "one" kernel (no planes, no
  counter).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.kernels import dot_precision
from engine.settings import EngineSettings

BLOCK_M = 16
BLOCK_K = 64  # bf16 q|k|v shrink (A tile [64, 128]): ptxas sm_90a 80 registers, no spills, 36 KB shared (3 stages)
BLOCK_N = 64
MAX_SPLITS = 16  # at most; the planes of t are loaded all at once, [next power of 2 of splits, BLOCK_M, r] fp32
PROGRAMS_PER_SM = 2  # split K until programs x splits reaches this many programs per SM
CPU_SMS = 132  # an H200's SM count: CPU tensors (interpreter tests, compile cases) plan like the GPU the engine uses
# The one-launch kernels' tiles. bf16, 4 warps: t 16 x r fp32, A 128 x r, B r x 128, x 16 x 128, y 16 x 128 fp32 are
# ~60 registers a thread at r 32; ptxas sm_90a (one launch / split): 72 / 80 registers at r 32, 80 / 96 at r 64,
# 126 / 135 at r 128, no spills, 32 KB shared at r 32 (tests/test_lora_kernel_compile.py checks every variant's).
# A column tile of 128 halves the repeated shrinks (and the programs) against 64.
FUSED_BLOCK_N = 128
FUSED_BLOCK_K = 128  # the K walk is serial in each program: fewer, larger steps keep more loads in flight
FUSED_MAX_ROWS = 256  # decode sizes; prefill chunks keep the two launches
FUSED_MAX_BYTES = 32 << 20  # A and x the one-launch kernel reads in all, mostly again from L2 (see `fuse`)
TABLE_TILES = 64  # tiles per program of the tile table kernel at up to 64 slots (a few programs: trivial work)
COUNTER_COLS = 64  # column tiles per row tile the split kernel counts arrivals for (8192 columns at 128)
SLOT_SHIFT = 22  # tile table entries: slot << 22 | row + 1 in an int32, so up to 511 slots and 4M rows - 1 a step
# what the kernels read (a kernel reads globals as constexprs only)
_SHIFT, _ROW_MASK = tl.constexpr(SLOT_SHIFT), tl.constexpr((1 << SLOT_SHIFT) - 1)


class Variant(NamedTuple):
    """How `lora_add_` runs one linear. `path`: "two" (shrink, expand), "one" (`_fused_kernel`) or "split"
    (`_split_kernel`). `block_n`: the expand's / one launch's column tile; `block_k`: the K step of the shrink loop;
    `warps`, `stages`: Triton's num_warps and num_stages (the K loop's software pipeline depth); `per_sm`: programs
    per SM the K split aims at ("two" and "split"); `pdl` ("two"): the expand as a programmatic dependent launch."""

    path: str
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3
    per_sm: int = PROGRAMS_PER_SM
    pdl: bool = False


VARIANTS: dict[str, Variant] = {
    "two": Variant("two", BLOCK_N, BLOCK_K),
    # half / a quarter of the expand programs, each paying its prologue (tile table, t planes) for more columns
    "two_n128": Variant("two", 128, BLOCK_K),
    "two_n256_w8": Variant("two", 256, BLOCK_K, warps=8),
    "two_pdl": Variant("two", 128, BLOCK_K, pdl=True),
    "one": Variant("one", FUSED_BLOCK_N, FUSED_BLOCK_K),
    "one_k256": Variant("one", FUSED_BLOCK_N, 256, stages=4),  # half the serial K steps, 4 in flight (96 KB shared)
    "split": Variant("split", FUSED_BLOCK_N, FUSED_BLOCK_K),
    "split_n64": Variant("split", 64, FUSED_BLOCK_K),  # twice the column tiles, so fewer K splits
    "split_4sm": Variant("split", FUSED_BLOCK_N, FUSED_BLOCK_K, per_sm=4),  # twice the K splits: shorter K walks
}
# What `lora_add_` runs by default (see `choose`): flip these after bench/lora_bench.py --step has measured them.
# Each is the fastest op in a graph of a whole step's layers at its sizes (docs/decisions.md, LoRA kernels).
SMALL_VARIANT = "one_k256"  # where `fuse` allows one launch (decode sizes)
# everywhere else; VOXGATE_LORA_LARGE_VARIANT picks another for an end-to-end A/B (bench/gpu_run.sh lora_variants)
LARGE_VARIANT = EngineSettings.from_env().lora_large_variant
if LARGE_VARIANT not in VARIANTS:
    raise ValueError(f"VOXGATE_LORA_LARGE_VARIANT={LARGE_VARIANT!r} is not one of {sorted(VARIANTS)}")


class Segments(NamedTuple):
    """Rows grouped by slot: `order` [M] row ids sorted by slot, `starts` [S+1] each slot's first position in
    `order`, `tiles` [S+1] each slot's first tile (slot 0 has none); `table` [grid, BLOCK_M] int32, tile i's slot and
    row ids (slot << SLOT_SHIFT | row + 1; row + 1 = 0 past the slot's rows, slot S past the last tile); `counters`
    [grid * COUNTER_COLS] zeros for the split kernel; `grid` bounds the tile count from shapes."""

    order: Tensor
    starts: Tensor
    tiles: Tensor
    table: Tensor
    counters: Tensor
    grid: int


class Plan(NamedTuple):
    """Launch shape of one linear's K split: `splits` K ranges of `k_per_split` columns (a multiple of the K step)."""

    splits: int
    k_per_split: int


def tile_grid(entries: int, rows_per_index: int, num_slots: int) -> int:
    """A bound on the tiles of `entries` index entries of `rows_per_index` rows each (the LoRA kernels' grid)."""
    rows = entries * rows_per_index
    # each adapter in use adds at most one partial tile, and at most min(slots, index entries) are in use: a LocDiT
    # step of one sequence (22 rows, 2 entries) needs 4 programs, not one per row
    partial = min(num_slots - 1, entries)
    return max(1, min(rows, triton.cdiv(rows, BLOCK_M) + partial))


def segment_rows(index: Tensor, rows_per_index: int, num_slots: int) -> Segments:
    """Group the rows (slot of row m = index[m // rows_per_index]) by slot with device ops only (no host sync, so
    a CUDA graph can capture it); computed once per step and row group, shared by every linear."""
    rows = index.shape[0] * rows_per_index
    if num_slots >= 1 << (31 - SLOT_SHIFT) or rows >= 1 << SLOT_SHIFT:
        raise ValueError(f"the LoRA tile table holds under {1 << (31 - SLOT_SHIFT)} slots and {1 << SLOT_SHIFT} rows "
                         f"(got {num_slots} slots, {rows} rows)")
    slots = index[:, None].expand(-1, rows_per_index).reshape(-1)  # repeat_interleave would sync
    ordered, order = torch.sort(slots, stable=True)
    starts = torch.searchsorted(ordered, torch.arange(num_slots + 1, device=index.device, dtype=ordered.dtype))
    tiles = (starts.diff() + BLOCK_M - 1) // BLOCK_M
    # slot 0: the linear's output as it is; zero_() because `tiles[0] = 0` copies a CPU scalar (refused in capture)
    tiles[:1].zero_()
    tiles = torch.cat((tiles.new_zeros(1), tiles.cumsum(0))).to(torch.int32)
    grid = tile_grid(index.shape[0], rows_per_index, num_slots)
    order, starts = order.to(torch.int32), starts.to(torch.int32)
    table = torch.empty(grid, BLOCK_M, device=index.device, dtype=torch.int32)
    block_s = triton.next_power_of_2(num_slots)
    block_t = max(8, min(TABLE_TILES, TABLE_TILES * 64 // block_s))  # a [tiles, slots] compare of <= 4096 elements
    _tile_table_kernel[(triton.cdiv(grid, block_t),)](order, starts, tiles, table, num_slots, grid, BLOCK_S=block_s,
                                                     BLOCK_M=BLOCK_M, BLOCK_T=block_t)
    counters = torch.zeros(grid * COUNTER_COLS, device=index.device, dtype=torch.int32)
    return Segments(order, starts, tiles, table, counters, grid)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's SM count (CPU_SMS for CPU tensors)."""
    if device.type != "cuda":
        return CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan(k: int, programs: int, device: torch.device, block_k: int = BLOCK_K, per_sm: int = PROGRAMS_PER_SM) -> Plan:
    """Split K so that programs x splits >= per_sm x SMs (capped by MAX_SPLITS and K's block_k chunks); from host
    ints only, so one graph bucket always gets the same plan."""
    chunks = triton.cdiv(k, block_k)
    splits = max(1, min(MAX_SPLITS, chunks, triton.cdiv(per_sm * sm_count(device), programs)))
    per = triton.cdiv(chunks, splits)
    return Plan(triton.cdiv(chunks, per), per * block_k)  # no empty split: the last one may be shorter


def fuse(m: int, k: int, rank: int, col_tiles: int, grid: int, itemsize: int) -> bool:
    """Whether one launch suits the linear (`col_tiles` of the one-launch column tile); from host ints only, so one
    graph bucket always takes the same path."""
    # Each (tile, column tile) reads its part's A block (rank x K) and its tile's rows of x (masked rows are not read;
    # each row is in one tile): col_tiles x K x itemsize x (grid x rank + m) bytes, the first pass from HBM and the
    # repeats from L2 (split over K or not). Two launches read A once (3r rows for q|k|v) but pay a second launch
    # (~3-5 us in a graph) and t's fp32 round trip. 32 MiB is ~5 us of L2 reads at ~6 TB/s: about the launch saved.
    # VoxCPM2 at r 32, bf16 (fused tiles: q|k|v 16+2+2, LM o 16, LocDiT o 8), 32 adapters: LocDiT q|k|v (K 1024)
    # 22 rows (grid 4) 5.9 MiB, 88 rows (grid 14) 21 MiB, 176 rows (grid 27) 41 MiB, 1408 rows (grid 120) 205 MiB;
    # LM q|k|v (K 2048) 1 row 2.6 MiB, 8 rows 21 MiB, 16 rows 41 MiB. So LocDiT up to 4 sequences, LM up to 8.
    return m <= FUSED_MAX_ROWS and col_tiles * k * itemsize * (grid * rank + m) <= FUSED_MAX_BYTES


def col_tiles(outs: tuple[int, ...], block_n: int) -> int:
    """Column tiles of a fused output: each part's columns tiled on their own (a tile never spans two parts)."""
    return sum(triton.cdiv(n, block_n) for n in outs)


def choose(m: int, k: int, rank: int, outs: tuple[int, ...], grid: int, itemsize: int) -> Variant:
    """The variant `lora_add_` runs by default: SMALL_VARIANT where `fuse` allows one launch, else LARGE_VARIANT. From
    host ints only, so one graph bucket always runs the same kernels."""
    small = VARIANTS[SMALL_VARIANT]
    fits = fuse(m, k, rank, col_tiles(outs, small.block_n), grid, itemsize)
    return small if fits else VARIANTS[LARGE_VARIANT]


@triton.jit
def _tile_table_kernel(order_ptr, starts_ptr, tiles_ptr, table_ptr, NUM_SLOTS, GRID,
                       BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr):
    """The tile table's BLOCK_T rows from program_id(0) * BLOCK_T: tile i's BLOCK_M entries, slot << SLOT_SHIFT |
    row + 1 (row + 1 = 0 past the slot's rows; slot NUM_SLOTS: no tile)."""
    tile = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # a tile's slot: how many slots end at or before it (tiles[s + 1]: the end of slot s's tiles); the library's sum
    # combine, which the interpreter runs with numpy (any other, element by element)
    s = tl.arange(0, BLOCK_S)
    ends = tl.load(tiles_ptr + 1 + s, mask=s < NUM_SLOTS, other=2 ** 30)
    slot = tl.reduce((ends[None, :] <= tile[:, None]).to(tl.int32), 1, tl.standard._sum_combine)
    safe = tl.minimum(slot, NUM_SLOTS - 1)
    first = tl.load(starts_ptr + safe) + (tile - tl.load(tiles_ptr + safe)) * BLOCK_M
    m = tl.arange(0, BLOCK_M)
    # a partial tile (the slot's last rows) masks the rest; a tile past the slots' masks all
    row_ok = (m[None, :] < (tl.load(starts_ptr + safe + 1) - first)[:, None]) & (slot < NUM_SLOTS)[:, None]
    rows = tl.load(order_ptr + first[:, None] + m[None, :], mask=row_ok, other=-1)
    entry = (slot << _SHIFT)[:, None] + rows + 1
    tl.store(table_ptr + tile[:, None] * BLOCK_M + m[None, :], entry, mask=(tile < GRID)[:, None])


@triton.jit
def _tile(table_ptr, NUM_SLOTS, BLOCK_M: tl.constexpr):
    """(whether there is a tile, the slot clamped for addresses (int64), row ids [BLOCK_M] int64, which of them are
    valid) of program_id(0)'s tile: one 32-bit load of its tile table row, everything else derived from it (loaded
    apart, or as the halves of 64-bit entries, the rows' load is issued after the slot's wait: two round trips)."""
    entry = tl.load(table_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    # a reduction over a size-1 axis: the same values, but now the compiler moves them between the layouts their
    # uses need (registers, shared memory) instead of loading them again per layout, which it issues after the
    # slot's wait (a second round trip). The library's max combine: the interpreter runs it with numpy.
    entry = tl.reduce(entry[None, :], 0, tl.standard._elementwise_max)
    slot = tl.reduce(entry >> _SHIFT, 0, tl.standard._elementwise_max)  # every entry holds it
    rows = (entry & _ROW_MASK).to(tl.int64) - 1
    return slot < NUM_SLOTS, tl.minimum(slot, NUM_SLOTS - 1).to(tl.int64), tl.maximum(rows, 0), rows >= 0


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
def _shrink(x_ptr, a_ptrs, rows, row_ok, rank_ok, k_lo, k_hi, stride_xm, BLOCK_M: tl.constexpr,
            BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_R] = x[rows, k_lo:k_hi] @ A^T; a_ptrs [1, BLOCK_R] point at the A rows (K contiguous)."""
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptrs + ks[:, None], mask=rank_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(x, a, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _load_b(b_ptr, slot, has_tile, cols, col_ok, ranks, rank_ok, stride_bs, stride_bn):
    """B[slot][cols, ranks]^T [BLOCK_R, BLOCK_N]; zeros (nothing read) for a program without a tile."""
    return tl.load(b_ptr + slot * stride_bs + cols[None, :] * stride_bn + ranks[:, None],
                   mask=col_ok[None, :] & rank_ok[:, None] & has_tile, other=0.0)


@triton.jit
def _load_y(y_ptr, rows, row_ok, cols, col_ok, stride_ym):
    """The output tile: its pointers, its mask and its values (added to, then stored back through the same)."""
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    y_ok = row_ok[:, None] & col_ok[None, :]
    return y_ptrs, y_ok, tl.load(y_ptrs, mask=y_ok, other=0.0)


@triton.jit
def _sum_planes(ptrs, ok, stride, SPLITS, PLANES: tl.constexpr, CACHE: tl.constexpr):
    """The sum of the fp32 tiles at ptrs + s * stride for s < SPLITS <= PLANES (a K split's partials), the same bits
    whatever order they were written in. One masked [PLANES, ...] load, so every plane is in flight at once, and one
    reduction: summed plane by plane, the compiler moves the dot's layout conversion (through shared memory, with a
    barrier) onto each load, which then waits for each in turn."""
    s = tl.arange(0, PLANES)[:, None, None]
    planes = tl.load(ptrs[None, :, :] + s * stride, mask=ok[None, :, :] & (s < SPLITS), other=0.0,
                     cache_modifier=CACHE)
    # the library's own sum combine: the interpreter sums it with numpy (any other runs element by element)
    return tl.reduce(planes, 0, tl.standard._sum_combine)


@triton.jit
def _add_delta(t, b, y, y_ptrs, y_ok, PRECISION: tl.constexpr):
    """y tile (loaded from y_ptrs) += t (fp32 [rows, ranks]) @ b ([ranks, cols], the slot's B^T)."""
    delta = tl.dot(t.to(b.dtype), b, input_precision=PRECISION)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=y_ok)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, table_ptr, t_ptr, K, K_PER_SPLIT, NUM_SLOTS,
                   stride_xm, stride_as, stride_ar, stride_ts, stride_tm,
                   RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr, PRECISION: tl.constexpr):
    if PDL:
        gdc_launch_dependents()  # the expand may start now: it waits for this grid before reading t
    has_tile, slot, rows, row_ok = _tile(table_ptr, NUM_SLOTS, BLOCK_M)
    split = tl.program_id(1)
    ranks = tl.arange(0, BLOCK_R)
    k_lo = split * K_PER_SPLIT
    # no branch: a program without a tile walks no K and stores nothing (its rows are all masked)
    k_hi = tl.where(has_tile, tl.minimum(k_lo + K_PER_SPLIT, K), k_lo)
    acc = _shrink(x_ptr, a_ptr + slot * stride_as + ranks[None, :] * stride_ar, rows, row_ok, ranks < RANK, k_lo,
                  k_hi, stride_xm, BLOCK_M, BLOCK_R, BLOCK_K, PRECISION)
    tl.store(t_ptr + split * stride_ts + rows[:, None] * stride_tm + ranks[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _expand_kernel(t_ptr, b_ptr, table_ptr, y_ptr, N0, N1, N2, SPLITS, NUM_SLOTS,
                   stride_ts, stride_tm, stride_bs, stride_bn, stride_ym,
                   RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                   PLANES: tl.constexpr, PDL: tl.constexpr, PRECISION: tl.constexpr):
    has_tile, slot, rows, row_ok = _tile(table_ptr, NUM_SLOTS, BLOCK_M)
    part, cols, col_ok = _columns(N0, N1, N2, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < RANK
    # B's and y's tiles first: the shrink writes neither, so under PDL they load while it still runs
    b = _load_b(b_ptr, slot, has_tile, cols, col_ok, ranks, rank_ok, stride_bs, stride_bn)
    y_ptrs, y_ok, y = _load_y(y_ptr, rows, row_ok, cols, col_ok, stride_ym)
    if PDL:
        gdc_wait()  # every program, tile or not, so this grid never completes before the shrink
    if has_tile:
        t = _sum_planes(t_ptr + rows[:, None] * stride_tm + (part * RANK + ranks)[None, :],
                        row_ok[:, None] & rank_ok[None, :], stride_ts, SPLITS, PLANES, "")
        _add_delta(t, b, y, y_ptrs, y_ok, PRECISION)


@triton.jit
def _fused_kernel(x_ptr, a_ptr, b_ptr, table_ptr, y_ptr, K, N0, N1, N2, NUM_SLOTS,
                  stride_xm, stride_as, stride_ar, stride_bs, stride_bn, stride_ym,
                  RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    has_tile, slot, rows, row_ok = _tile(table_ptr, NUM_SLOTS, BLOCK_M)
    part, cols, col_ok = _columns(N0, N1, N2, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < RANK
    # B's and y's tiles before the K walk, whose latency then covers theirs
    b = _load_b(b_ptr, slot, has_tile, cols, col_ok, ranks, rank_ok, stride_bs, stride_bn)
    y_ptrs, y_ok, y = _load_y(y_ptr, rows, row_ok, cols, col_ok, stride_ym)
    # only this part's rank block of A: a q|k|v column tile needs r x K of it, not 3r x K. No branch: a program
    # without a tile walks no K and stores nothing
    a_ptrs = a_ptr + slot * stride_as + (part * RANK + ranks)[None, :] * stride_ar
    t = _shrink(x_ptr, a_ptrs, rows, row_ok, rank_ok, 0, tl.where(has_tile, K, 0), stride_xm, BLOCK_M, BLOCK_R,
                BLOCK_K, PRECISION)
    _add_delta(t, b, y, y_ptrs, y_ok, PRECISION)


@triton.jit
def _split_kernel(x_ptr, a_ptr, b_ptr, table_ptr, t_ptr, count_ptr, y_ptr, K, K_PER_SPLIT, N0, N1, N2,
                  NUM_SLOTS, SPLITS, stride_xm, stride_as, stride_ar, stride_bs, stride_bn, stride_ym,
                  RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PLANES: tl.constexpr, PRECISION: tl.constexpr):
    has_tile, slot, rows, row_ok = _tile(table_ptr, NUM_SLOTS, BLOCK_M)
    part, cols, col_ok = _columns(N0, N1, N2, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < RANK
    # B's and y's tiles before the shrink: only the last arrival uses them, but their (cold) latency then hides
    # behind the shrink instead of following it; the repeats come from L2
    b = _load_b(b_ptr, slot, has_tile, cols, col_ok, ranks, rank_ok, stride_bs, stride_bn)
    y_ptrs, y_ok, y = _load_y(y_ptr, rows, row_ok, cols, col_ok, stride_ym)
    split = tl.program_id(2)
    k_lo = split * K_PER_SPLIT
    a_ptrs = a_ptr + slot * stride_as + (part * RANK + ranks)[None, :] * stride_ar
    k_hi = tl.where(has_tile, tl.minimum(k_lo + K_PER_SPLIT, K), k_lo)  # a program without a tile walks no K
    t = _shrink(x_ptr, a_ptrs, rows, row_ok, rank_ok, k_lo, k_hi, stride_xm, BLOCK_M, BLOCK_R, BLOCK_K, PRECISION)
    if has_tile:
        # this split's partial in its own plane of the (tile, column tile)'s SPLITS planes
        pair = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        plane = BLOCK_M * BLOCK_R
        planes = (t_ptr + pair.to(tl.int64) * SPLITS * plane + tl.arange(0, BLOCK_M)[:, None] * BLOCK_R
                  + ranks[None, :])
        tl.store(planes + split * plane, t)
        # every warp's part of the plane is stored before the arrival counts (the atomic is one thread's; its
        # release then covers the whole program's stores)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:  # the last: every plane is stored and visible (acquire)
            tl.store(count_ptr + pair, 0)  # back to zero for the next linear sharing these segments
            # .cg: from L2, where the other SMs' stores are (never a stale L1 line)
            total = _sum_planes(planes, row_ok[:, None] & rank_ok[None, :], plane, SPLITS, PLANES, ".cg")
            _add_delta(total, b, y, y_ptrs, y_ok, PRECISION)


def lora_add_(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, index: Tensor, rows_per_index: int,
              outs: tuple[int, ...] | None = None, segments: Segments | None = None, fused: bool | None = None,
              variant: Variant | str | None = None) -> None:
    """y [M, N] += per-row LoRA of x [M, K]; slot of row m = index[m // rows_per_index]. A [S, parts * r, K] and
    B [S, N, r] (scaling folded in) stack the LoRAs of up to three linears sharing x, whose outputs `outs` (default
    (N,)) are y's column blocks in order. x and y have unit column stride; the rank intermediate is fp32.
    `segments` (from `segment_rows`) can be shared by every linear of a step. How it runs: `variant` (a Variant or a
    VARIANTS name), else `fused` (True: one launch, K split as `plan` says; False: two launches, the module's tiles),
    else `choose`."""
    m, k = x.shape
    outs = outs or (lora_b.shape[1],)
    rank, slots = lora_b.shape[2], lora_a.shape[0]
    if len(outs) > 3 or sum(outs) != lora_b.shape[1] or lora_a.shape[1] != rank * len(outs):
        raise ValueError(f"LoRA shapes disagree: A {list(lora_a.shape)}, B {list(lora_b.shape)}, outs {outs}")
    if m == 0:
        return
    seg = segments or segment_rows(index, rows_per_index, slots)
    if isinstance(variant, str):
        variant = VARIANTS[variant]
    elif variant is None and fused is not None:  # read at the call: a bench may set the module's tiles
        variant = Variant("split", FUSED_BLOCK_N, FUSED_BLOCK_K) if fused else Variant("two", BLOCK_N, BLOCK_K)
    elif variant is None:
        variant = choose(m, k, rank, outs, seg.grid, x.element_size())
    launch = {"two": _two_launches, "one": _one_launch, "split": _one_launch}[variant.path]
    launch(y, x, lora_a, lora_b, outs, seg, variant, dot_precision(x))


def _planes(split: Plan) -> int:
    """The planes of t a sum loads (a power of 2, the ones past the splits masked): a constexpr per split count, so
    a kernel holds no more of them in registers than its plan needs."""
    return triton.next_power_of_2(split.splits)


def _pdl(v: Variant, device: torch.device) -> bool:
    """Whether the expand launches as a programmatic dependent: a GPU launch attribute of sm_90+ (griddepcontrol),
    so neither before Hopper nor in Triton's interpreter (which run the variant's tiles without it). CPU tensors
    outside the interpreter only stand in for an H200 (the compile cases)."""
    return (v.pdl and isinstance(_expand_kernel, triton.runtime.JITFunction)
            and (device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9))


def _two_launches(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, outs: tuple[int, ...], seg: Segments,
                  v: Variant, precision: str) -> None:
    """Shrink (K split as `plan` says) into t's planes, then expand (summing them)."""
    m, k = x.shape
    rank, slots = lora_b.shape[2], lora_a.shape[0]
    split = plan(k, seg.grid, x.device, v.block_k, v.per_sm)
    pdl = _pdl(v, x.device)
    shrink_r = max(16, triton.next_power_of_2(rank * len(outs)))
    # empty: every plane a tile's rows read is written by its split; slot-0 rows are neither written nor read
    t = torch.empty((split.splits, m, shrink_r), device=x.device, dtype=torch.float32)
    _shrink_kernel[(seg.grid, split.splits)](x, lora_a, seg.table, t, k, split.k_per_split, slots,
                                             x.stride(0), lora_a.stride(0), lora_a.stride(1), t.stride(0),
                                             t.stride(1), RANK=rank * len(outs), BLOCK_M=BLOCK_M, BLOCK_R=shrink_r,
                                             BLOCK_K=v.block_k, PDL=pdl, PRECISION=precision, num_warps=v.warps,
                                             num_stages=v.stages)
    n0, n1, n2 = (*outs, 0, 0)[:3]
    _expand_kernel[(seg.grid, col_tiles(outs, v.block_n))](t, lora_b, seg.table, y, n0, n1, n2,
                                                           split.splits, slots, t.stride(0), t.stride(1),
                                                           lora_b.stride(0), lora_b.stride(1), y.stride(0),
                                                           RANK=rank, BLOCK_M=BLOCK_M,
                                                           BLOCK_R=max(16, triton.next_power_of_2(rank)),
                                                           BLOCK_N=v.block_n, PLANES=_planes(split), PDL=pdl,
                                                           PRECISION=precision, num_warps=v.warps, launch_pdl=pdl)


def _one_launch(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, outs: tuple[int, ...], seg: Segments,
                v: Variant, precision: str) -> None:
    """`_split_kernel` where the variant splits K, the plan gives several splits and the counters cover the column
    tiles, else `_fused_kernel`."""
    k = x.shape[1]
    rank, slots = lora_b.shape[2], lora_a.shape[0]
    n0, n1, n2 = (*outs, 0, 0)[:3]
    tiles = col_tiles(outs, v.block_n)
    block_r = max(16, triton.next_power_of_2(rank))
    split = plan(k, seg.grid * tiles, x.device, v.block_k, v.per_sm) if v.path == "split" else Plan(1, k)
    options = {"num_warps": v.warps, "num_stages": v.stages}
    if split.splits > 1 and tiles <= COUNTER_COLS:
        t = torch.empty(seg.grid * tiles * split.splits * BLOCK_M * block_r, device=x.device, dtype=torch.float32)
        _split_kernel[(seg.grid, tiles, split.splits)](x, lora_a, lora_b, seg.table, t, seg.counters, y, k,
                                                       split.k_per_split, n0, n1, n2, slots, split.splits,
                                                       x.stride(0), lora_a.stride(0), lora_a.stride(1),
                                                       lora_b.stride(0), lora_b.stride(1), y.stride(0), RANK=rank,
                                                       BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_N=v.block_n,
                                                       BLOCK_K=v.block_k, PLANES=_planes(split),
                                                       PRECISION=precision, **options)
        return
    _fused_kernel[(seg.grid, tiles)](x, lora_a, lora_b, seg.table, y, k, n0, n1, n2, slots, x.stride(0),
                                     lora_a.stride(0), lora_a.stride(1), lora_b.stride(0), lora_b.stride(1),
                                     y.stride(0), RANK=rank, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_N=v.block_n,
                                     BLOCK_K=v.block_k, PRECISION=precision, **options)
