"""A fused residual unit for the AudioVAE decoder on CUDA (voxgate issue 4).

A ResidualUnit is x + conv1x1(snake2(dwconv_k7_dilated(snake1(x)))). Eagerly that is seven kernels (snake, cat with
the causal history, cuDNN depthwise conv, history copy, snake, 1x1 conv, residual add) and about 13 passes over the
activations. Here it is two launches and about 6 passes:

1. One Triton kernel computes z = snake2(dwconv(snake1(x), history) + bias) and, from the x it loaded anyway, the
   residual's start out = x + pointwise bias (reads x; writes z and out). Optionally x comes without a per-channel
   bias, as a row-strided view (`in_bias`: the decoder block's transposed conv hands over its untrimmed output's
   y[..., :n] and its bias, whose eager `y[..., :n] + bias` is one more read and write of the block's largest
   activation): the kernel adds it as it loads x, and x stands for x + in_bias everywhere below. A program owns
   ROWS rows (batch x channel) and BLOCK_T input samples, the conv's left context (HALO lanes) included, and
   computes snake1 once per sample. The taps need that tile shifted along T. Triton has no register shifts, and
   tl.gather along the contiguous axis becomes O(n^2) warp shuffles, so the tile goes through the program's own
   slot of a scratch buffer: written once (L2; at large batches also a DRAM write), read back seven times shifted
   from L1/L2.
2. out += W @ z as one batched cuBLAS GEMM, in place (`baddbmm_`, the weight broadcast over the batch with stride
   0; out of place, baddbmm would first copy its input: one more pass). Reads z and out, writes out.

Numerics follow the eager modules: x + in_bias in fp32 rounded to x's dtype (as torch adds), snake in fp32 math,
its output rounded to x's dtype (it is the conv's input and what the history stores), conv accumulation in fp32
rounded to x's dtype before snake2, output in x's dtype. The GEMM follows torch's fp32 matmul precision setting
(torch.backends.cuda.matmul), like any fp32 matmul; cuDNN runs the eager 1x1 conv in TF32 by default, the GEMM only
if that setting allows it.
Streaming: `history` [B, C, 6 * dilation] holds the conv's last input samples (snake1 outputs) and is updated in
place exactly as CausalConv1d.forward leaves it. No host syncs, shapes from host ints only: CUDA-graph capturable.
Runs on CPU under TRITON_INTERPRET=1 for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels import snake_f32

TAPS = 7  # the residual units' depthwise kernel size
_TAPS = tl.constexpr(TAPS)  # the same, readable inside kernels
MAX_BLOCK_T = 1024  # samples per row and program (halo included): long rows are split across programs
TILE = 2048  # elements per program: short rows (early stages, T of a few dozen) are stacked ROWS to a program


@triton.jit(do_not_specialize=["rows"])  # B * C varies with the batch: a new batch size must not recompile
def _residual_unit_kernel(
    x_ptr, hist_ptr, new_hist_ptr, z_ptr, out_ptr, stage_ptr,
    alpha1_ptr, weight_ptr, bias_ptr, alpha2_ptr, out_bias_ptr, in_bias_ptr,
    rows, channels, length, x_stride, slot,
    DILATION: tl.constexpr, HISTORY: tl.constexpr, RESIDUAL: tl.constexpr, IN_BIAS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_T: tl.constexpr, HALO: tl.constexpr,
):
    # HISTORY: 0 offline (zero context, nothing written), 1 streaming with the history updated in place (the grid
    # has one program per row along T), 2 streaming with the new history staged in new_hist_ptr (several programs
    # per row: one may not overwrite history that another still has to read; the launcher copies it back).
    # RESIDUAL: also write out = x + out_bias (the pointwise conv's bias), which the GEMM then adds W @ z to.
    # IN_BIAS: x is the stored x + in_bias (per channel). x_stride: elements between x's rows (z, out: length).
    # slot: scratch elements per row, BLOCK_T or (one program per row) HALO + length, all that such a row uses.
    context: tl.constexpr = 6 * DILATION  # (TAPS - 1) * DILATION
    step: tl.constexpr = BLOCK_T - HALO  # outputs per program along T
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    chan = row % channels
    row64 = row.to(tl.int64)
    t0 = tl.program_id(1) * step
    lane = tl.arange(0, BLOCK_T)
    pos = t0 - HALO + lane  # input sample of each lane; < 0 is the causal context

    # snake1 over this tile's inputs, once per sample, rounded to x's dtype as the eager module's output is
    in_x = (pos >= 0) & (pos < length)
    x = tl.load(x_ptr + row64[:, None] * x_stride + pos[None, :], mask=row_ok[:, None] & in_x[None, :], other=0.0)
    if IN_BIAS:  # as torch's x + bias: fp32 add, rounded to x's dtype; the padding lanes stay 0
        in_bias = tl.load(in_bias_ptr + chan, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        x = tl.where(in_x[None, :], (x.to(tl.float32) + in_bias).to(x.dtype), 0.0).to(x.dtype)
    alpha1 = tl.load(alpha1_ptr + chan, mask=row_ok, other=1.0).to(tl.float32)[:, None]
    xf = x.to(tl.float32)
    src = snake_f32(xf, alpha1).to(x.dtype)  # 0 where x is masked (zero padding)
    if RESIDUAL:  # lanes from HALO on are this program's own samples [t0, t0 + step)
        mine = row_ok[:, None] & ((lane >= HALO) & (pos < length))[None, :]
        out_bias = tl.load(out_bias_ptr + chan, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + row64[:, None] * length + pos[None, :], (xf + out_bias).to(x.dtype), mask=mine)

    # The tile goes through this program's scratch slot; bar.sync makes every thread's global writes visible to
    # the whole program before the shifted reads. Only samples some output reads are written and read.
    program = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
    tile = stage_ptr + (program * ROWS + tl.arange(0, ROWS))[:, None] * slot
    needed = (pos >= t0 - context) & (pos < length)
    if HISTORY != 0:
        needed = needed & (pos >= 0)  # the context comes from the history instead of zeros
    tl.store(tile + lane[None, :], src, mask=row_ok[:, None] & needed[None, :])
    hist_lane = tl.arange(0, HALO)  # narrow [ROWS, HALO] tiles for the history: no layout change of the big one
    hist_ok = row_ok[:, None] & (hist_lane < context)[None, :]
    hist_offsets = row64[:, None] * context + hist_lane[None, :]
    if HISTORY != 0:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if tl.program_id(1) == 0:  # the only program of the row reaching before sample 0 (step >= context)
            old = tl.load(hist_ptr + hist_offsets, mask=hist_ok)
            tl.store(tile + (HALO - context + hist_lane)[None, :], old, mask=hist_ok)
    tl.debug_barrier()

    acc = tl.zeros([ROWS, BLOCK_T], tl.float32) + tl.load(bias_ptr + chan, mask=row_ok, other=0.0).to(
        tl.float32)[:, None]
    t = t0 + lane
    # lanes past the step are the next program's outputs, those past the end nobody's
    computed = row_ok[:, None] & ((lane < step) & (t < length))[None, :]
    for k in tl.static_range(_TAPS):
        # output lane i (sample t0 + i) reads input lane i + HALO - context + k * DILATION
        tap = tile + (lane + (HALO - context + k * DILATION))[None, :]
        w = tl.load(weight_ptr + chan * _TAPS + k, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        acc += w * tl.load(tap, mask=computed, other=0.0).to(tl.float32)

    # snake2 on the conv output rounded to x's dtype (the eager conv's output dtype)
    y = acc.to(x.dtype).to(tl.float32)
    alpha2 = tl.load(alpha2_ptr + chan, mask=row_ok, other=1.0).to(tl.float32)[:, None]
    z = snake_f32(y, alpha2)
    tl.store(z_ptr + row64[:, None] * length + t[None, :], z.to(z_ptr.dtype.element_ty), mask=computed)

    if HISTORY != 0:  # noqa: SIM102 (a compile-time branch around a run-time one)
        # New history: the last `context` samples of cat(history, snake1(x)), samples length - context + j. The
        # row's last program holds all of them in its slot (lanes from HALO - context on, old history included
        # when length < context). In place (HISTORY 1) the barrier above separates the reads of the old history
        # from these writes.
        if t0 + step >= length:
            last = tl.load(tile + (length - context - t0 + HALO + hist_lane)[None, :], mask=hist_ok)
            tl.store(new_hist_ptr + hist_offsets, last, mask=hist_ok)


def _block_sizes(rows: int, length: int, halo: int, block_t: int | None) -> tuple[int, int]:
    """(ROWS, BLOCK_T): a row's whole input window in one program when it fits, several rows per program when the
    rows are short. block_t (a power of two > halo) overrides BLOCK_T, e.g. to test multi-program rows."""
    if block_t is None:
        block_t = min(MAX_BLOCK_T, triton.next_power_of_2(length + halo))
    if block_t & (block_t - 1) or block_t <= halo:
        raise ValueError(f"block_t must be a power of two above the halo {halo} (got {block_t})")
    return max(1, min(TILE // block_t, triton.next_power_of_2(rows))), block_t


def _launch(x: Tensor, alpha1: Tensor, weight: Tensor, bias: Tensor, alpha2: Tensor, dilation: int,
            history: Tensor | None, out_bias: Tensor | None, in_bias: Tensor | None,
            block_t: int | None) -> tuple[Tensor, Tensor | None]:
    """(z, x + out_bias or None): the fused kernel's outputs, x standing for x + in_bias when given; see
    `snake_dwconv_snake` and `residual_unit` for the arguments."""
    if x.dim() != 3 or x.shape[-1] == 0:
        raise ValueError(f"the fused residual unit needs x [B, C, T] with T > 0, got {tuple(x.shape)}")
    batch, channels, length = x.shape
    context = (TAPS - 1) * dilation
    if weight.shape != (channels, 1, TAPS) or bias.shape != (channels,) or alpha1.numel() != channels \
            or alpha2.numel() != channels or any(b is not None and b.shape != (channels,) for b in (out_bias, in_bias)):
        raise ValueError(f"the fused residual unit needs weight [C, 1, {TAPS}], C biases and C alphas for C="
                         f"{channels} (got {tuple(weight.shape)}, {tuple(bias.shape)}, {alpha1.numel()}, "
                         f"{alpha2.numel()})")
    if history is not None and (history.shape != (batch, channels, context) or history.dtype != x.dtype
                                or not history.is_contiguous()):
        raise ValueError(f"history must be contiguous {x.dtype} [{batch}, {channels}, {context}], got "
                         f"{history.dtype} {tuple(history.shape)}")
    # x is read as B * C rows `x_stride` apart: a view trimming each row's end (the transposed conv's y[..., :n])
    # is read in place, anything else made contiguous
    x_stride = x.stride(1)
    if x.stride(2) != 1 or x.stride(0) != channels * x_stride:
        x, x_stride = x.contiguous(), length
    z = x.new_empty(x.shape)
    out = None if out_bias is None else x.new_empty(x.shape)
    rows = batch * channels
    if rows == 0:
        return z, out
    # a power of two (the history tiles' width) of at least 16, which keeps each tile's first sample aligned
    halo = max(16, triton.next_power_of_2(context))
    tile_rows, block = _block_sizes(rows, length, halo, block_t)
    grid = (triton.cdiv(rows, tile_rows), triton.cdiv(length, block - halo))
    mode, new_history = 0, history
    if history is not None:
        mode = 1 if grid[1] == 1 else 2
        if mode == 2:
            new_history = torch.empty_like(history)
    slot = min(block, halo + length)  # a short row's power-of-two tile is mostly padding: no scratch for that
    stage = torch.empty(grid[0] * grid[1] * tile_rows * slot, device=x.device, dtype=x.dtype)
    _residual_unit_kernel[grid](
        x, history if history is not None else x, new_history if new_history is not None else x, z,
        out if out is not None else z, stage, alpha1.reshape(-1).contiguous(), weight.reshape(-1).contiguous(),
        bias.contiguous(), alpha2.reshape(-1).contiguous(), out_bias.contiguous() if out_bias is not None else bias,
        in_bias.contiguous() if in_bias is not None else bias, rows, channels, length, x_stride, slot,
        DILATION=dilation, HISTORY=mode, RESIDUAL=out is not None, IN_BIAS=in_bias is not None, ROWS=tile_rows,
        BLOCK_T=block, HALO=halo,
        num_warps=4 if tile_rows * block <= 1024 else 8,
    )
    if mode == 2:
        history.copy_(new_history)
    return z, out


def snake_dwconv_snake(x: Tensor, alpha1: Tensor, weight: Tensor, bias: Tensor, alpha2: Tensor, dilation: int,
                       history: Tensor | None = None, *, block_t: int | None = None) -> Tensor:
    """z = snake2(causal dilated depthwise conv k7(snake1(x)) + bias) for x [B, C, T] (one kernel) -> [B, C, T].

    alpha1/alpha2: C snake alphas (e.g. [1, C, 1]); weight [C, 1, 7], bias [C]. history: None (offline: zero
    context, as F.pad) or [B, C, 6 * dilation] of the conv's previous input samples, updated in place to the last
    6 * dilation samples of cat(history, snake1(x)). block_t: samples per program (tests)."""
    return _launch(x, alpha1, weight, bias, alpha2, dilation, history, None, None, block_t)[0]


def residual_unit(x: Tensor, alpha1: Tensor, dw_weight: Tensor, dw_bias: Tensor, alpha2: Tensor,
                  pw_weight: Tensor, pw_bias: Tensor, dilation: int, history: Tensor | None = None, *,
                  in_bias: Tensor | None = None, block_t: int | None = None) -> Tensor:
    """ResidualUnit.forward, x + conv1x1(snake2(dwconv(snake1(x)))), in two launches: the fused kernel (which also
    writes x + pw_bias), then the pointwise weight [C, C, 1] as one in-place batched GEMM. Arguments as in
    `snake_dwconv_snake`; in_bias [C]: the unit runs on x + in_bias[:, None], added as the kernel loads x (x may
    then be a row-strided view, e.g. y[..., :n], read without a copy)."""
    batch, channels, _ = x.shape
    if pw_weight.shape != (channels, channels, 1):
        raise ValueError(f"pw_weight must be [{channels}, {channels}, 1], got {tuple(pw_weight.shape)}")
    z, out = _launch(x, alpha1, dw_weight, dw_bias, alpha2, dilation, history, pw_bias, in_bias, block_t)
    assert out is not None
    return out.baddbmm_(pw_weight.reshape(channels, channels).expand(batch, -1, -1), z)
