"""A fused residual unit for the AudioVAE decoder on CUDA (voxgate issue 4).

A ResidualUnit is x + conv1x1(snake2(dwconv_k7_dilated(snake1(x)))). Eagerly that is seven kernels (snake, cat with
the causal history, cuDNN depthwise conv, history copy, snake, 1x1 conv, residual add) and about 13 passes over the
activations. Here it is two launches and about 6 passes:

1. One Triton kernel computes z = snake2(dwconv(snake1(x), history) + bias) and, from the x it loaded anyway, the
   residual's start out = x + pointwise bias (reads x; writes z and out). A program owns ROWS rows (batch x channel)
   and BLOCK_T input samples, the conv's left context (HALO lanes) included, and computes snake1 once per sample.
   The taps need that tile shifted along T. Triton has no register shifts, and tl.gather along the contiguous axis
   becomes O(n^2) warp shuffles, so the tile goes through the program's own slot of a scratch buffer: written once
   (L2; at large batches also a DRAM write), read back seven times shifted from L1/L2.
2. out += W @ z as one batched cuBLAS GEMM, in place (`baddbmm_`, the weight broadcast over the batch with stride
   0; out of place, baddbmm would first copy its input: one more pass). Reads z and out, writes out.

Up to 128 channels (`whole_unit`: VoxCPM2's last three stages, nearly all of the decoder's activation bytes) one
launch does both: a program holds all C channels of one stream over its time window, so W @ z (a tl.dot, C output
rows at a time) needs nothing from other programs; z stays in the program's scratch slot (L1/L2) and the unit reads
x once and writes out once: 2 passes instead of 6.

Numerics follow the eager modules: snake in fp32 math, its output rounded to x's dtype (it is the conv's input and
what the history stores), conv accumulation in fp32 rounded to x's dtype before snake2, output in x's dtype. The
GEMM follows torch's fp32 matmul precision setting (torch.backends.cuda.matmul), like any fp32 matmul; cuDNN runs the
eager 1x1 conv in TF32 by default, the GEMM only if that setting allows it.
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
    alpha1_ptr, weight_ptr, bias_ptr, alpha2_ptr, out_bias_ptr, pw_ptr,
    rows, channels, length, slot,
    DILATION: tl.constexpr, HISTORY: tl.constexpr, RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_T: tl.constexpr, HALO: tl.constexpr,
    POINTWISE: tl.constexpr = False, CHUNK: tl.constexpr = 32, PRECISION: tl.constexpr = "ieee",
):
    # HISTORY: 0 offline (zero context, nothing written), 1 streaming with the history updated in place (the grid
    # has one program per row along T), 2 streaming with the new history staged in new_hist_ptr (several programs
    # per row: one may not overwrite history that another still has to read; the launcher copies it back).
    # RESIDUAL: also write out = x + out_bias (the pointwise conv's bias), which the GEMM then adds W @ z to.
    # POINTWISE: the whole unit, out = x + out_bias + W @ z with W [C, C] at pw_ptr. ROWS is then all C channels of
    # one stream, so the 1x1 conv's channel mix stays inside the program and z never goes to memory; the rows are
    # taken CHUNK at a time, their z left in the scratch slot, then W @ z is formed CHUNK output channels at a time
    # (whole [C, BLOCK_T] tensors in registers spilled kilobytes a thread). PRECISION: that dot's (fp32 operands).
    # slot: scratch elements per row, BLOCK_T or (one program per row) HALO + length, all that such a row uses.
    if POINTWISE:
        for r0 in tl.static_range(0, ROWS, CHUNK):
            _unit_rows(r0 + tl.arange(0, CHUNK), x_ptr, hist_ptr, new_hist_ptr, z_ptr, out_ptr, stage_ptr, alpha1_ptr,
                       weight_ptr, bias_ptr, alpha2_ptr, out_bias_ptr, rows, channels, length, slot, DILATION,
                       HISTORY, False, ROWS, BLOCK_T, HALO, True)
        tl.debug_barrier()  # every chunk's z is in the slot
        step: tl.constexpr = BLOCK_T - HALO
        lane = tl.arange(0, BLOCK_T)
        t = tl.program_id(1) * step + lane
        mine = ((lane < step) & (t < length))[None, :]
        program = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
        slots = stage_ptr + (program * ROWS + tl.arange(0, ROWS))[:, None] * slot + lane[None, :]
        first = tl.program_id(0).to(tl.int64) * ROWS * length  # this stream's first element: offsets fit int32
        for c0 in tl.static_range(0, ROWS, CHUNK):
            oc = c0 + tl.arange(0, CHUNK)
            w = tl.load(pw_ptr + oc[:, None] * ROWS + tl.arange(0, ROWS)[None, :]).to(tl.float32)
            # z in x's dtype as the eager snake leaves it, the dot in fp32 either way: bf16 values are exact in
            # TF32 (and Triton's interpreter mis-multiplies bf16 made by a conversion)
            z = tl.load(slots, mask=mine, other=0.0).to(tl.float32)
            mixed = tl.dot(w, z, input_precision=PRECISION)  # [CHUNK, BLOCK_T]: columns are samples
            offsets = oc[:, None] * length + t[None, :]
            x = tl.load(x_ptr + first + offsets, mask=mine, other=0.0)
            out_bias = tl.load(out_bias_ptr + oc).to(tl.float32)[:, None]
            tl.store(out_ptr + first + offsets, (x.to(tl.float32) + out_bias + mixed).to(x.dtype), mask=mine)
    else:
        _unit_rows(tl.arange(0, ROWS), x_ptr, hist_ptr, new_hist_ptr, z_ptr, out_ptr, stage_ptr, alpha1_ptr,
                   weight_ptr, bias_ptr, alpha2_ptr, out_bias_ptr, rows, channels, length, slot, DILATION, HISTORY,
                   RESIDUAL, ROWS, BLOCK_T, HALO, False)


@triton.jit
def _unit_rows(local, x_ptr, hist_ptr, new_hist_ptr, z_ptr, out_ptr, stage_ptr,
               alpha1_ptr, weight_ptr, bias_ptr, alpha2_ptr, out_bias_ptr,
               rows, channels, length, slot,
               DILATION: tl.constexpr, HISTORY: tl.constexpr, RESIDUAL: tl.constexpr,
               ROWS: tl.constexpr, BLOCK_T: tl.constexpr, HALO: tl.constexpr, Z_IN_SLOT: tl.constexpr):
    """z = snake2(dwconv(snake1(x))) of the program's rows `local` (of its ROWS), the history kept; z to z_ptr, or
    with Z_IN_SLOT into the rows' scratch slots (once nothing reads their snake1 samples any more)."""
    context: tl.constexpr = 6 * DILATION  # (TAPS - 1) * DILATION
    step: tl.constexpr = BLOCK_T - HALO  # outputs per program along T
    row = tl.program_id(0) * ROWS + local
    row_ok = row < rows
    chan = row % channels
    row64 = row.to(tl.int64)
    t0 = tl.program_id(1) * step
    lane = tl.arange(0, BLOCK_T)
    pos = t0 - HALO + lane  # input sample of each lane; < 0 is the causal context

    # snake1 over this tile's inputs, once per sample, rounded to x's dtype as the eager module's output is
    in_x = (pos >= 0) & (pos < length)
    x = tl.load(x_ptr + row64[:, None] * length + pos[None, :], mask=row_ok[:, None] & in_x[None, :], other=0.0)
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
    tile = stage_ptr + (program * ROWS + local)[:, None] * slot
    needed = (pos >= t0 - context) & (pos < length)
    if HISTORY != 0:
        needed = needed & (pos >= 0)  # the context comes from the history instead of zeros
    tl.store(tile + lane[None, :], src, mask=row_ok[:, None] & needed[None, :])
    hist_lane = tl.arange(0, HALO)  # narrow [rows, HALO] tiles for the history: no layout change of the big one
    hist_ok = row_ok[:, None] & (hist_lane < context)[None, :]
    hist_offsets = row64[:, None] * context + hist_lane[None, :]
    if HISTORY != 0:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if tl.program_id(1) == 0:  # the only program of the row reaching before sample 0 (step >= context)
            old = tl.load(hist_ptr + hist_offsets, mask=hist_ok)
            tl.store(tile + (HALO - context + hist_lane)[None, :], old, mask=hist_ok)
    tl.debug_barrier()

    acc = tl.zeros([local.shape[0], BLOCK_T], tl.float32) + tl.load(bias_ptr + chan, mask=row_ok, other=0.0).to(
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
    z = snake_f32(y, alpha2).to(x.dtype)
    if not Z_IN_SLOT:
        tl.store(z_ptr + row64[:, None] * length + t[None, :], z, mask=computed)

    if HISTORY != 0:  # noqa: SIM102 (a compile-time branch around a run-time one)
        # New history: the last `context` samples of cat(history, snake1(x)), samples length - context + j. The
        # row's last program holds all of them in its slot (lanes from HALO - context on, old history included
        # when length < context). In place (HISTORY 1) the barrier above separates the reads of the old history
        # from these writes.
        if t0 + step >= length:
            last = tl.load(tile + (length - context - t0 + HALO + hist_lane)[None, :], mask=hist_ok)
            tl.store(new_hist_ptr + hist_offsets, last, mask=hist_ok)
    if Z_IN_SLOT:
        tl.debug_barrier()  # every read of these rows' snake1 samples is done
        tl.store(tile + lane[None, :], z, mask=computed)


def _block_sizes(rows: int, length: int, halo: int, block_t: int | None) -> tuple[int, int]:
    """(ROWS, BLOCK_T): a row's whole input window in one program when it fits, several rows per program when the
    rows are short. block_t (a power of two > halo) overrides BLOCK_T, e.g. to test multi-program rows."""
    if block_t is None:
        block_t = min(MAX_BLOCK_T, triton.next_power_of_2(length + halo))
    _check_block(block_t, halo)
    return max(1, min(TILE // block_t, triton.next_power_of_2(rows))), block_t


def _check_block(block_t: int, halo: int) -> None:
    if block_t & (block_t - 1) or block_t <= halo:
        raise ValueError(f"block_t must be a power of two above the halo {halo} (got {block_t})")


def whole_unit(channels: int) -> bool:
    """Whether one launch runs the whole unit (`POINTWISE`): C channels of a stream fit one program's tile with a
    time window of at least twice the largest halo. Wider stages (few samples per row: their activations are
    small) keep the kernel + GEMM pair."""
    return channels & (channels - 1) == 0 and MIN_UNIT_CHANNELS <= channels <= MAX_UNIT_CHANNELS


MIN_UNIT_CHANNELS = 32  # the whole unit's row chunk (CHUNK): no smaller stage
# One launch for the whole unit up to this many channels: VoxCPM2's last three decoder stages (128, 64, 32 channels
# x 1,920-7,680 samples a patch) hold nearly all the decoder's activation bytes, and there the pair moved each
# activation six times (kernel: x in, z and x + bias out; GEMM: z and out in, out out); one launch moves it twice.
MAX_UNIT_CHANNELS = 128
# A whole-unit program's [C, BLOCK_T] tile: about this many elements (at least 64 samples, and twice the halo:
# 16,384 for 128 channels at dilation 9), 8 warps up to 4,096, 16 above. ptxas sm_90a: 62-166 registers a thread,
# no spills, fp32 and bf16 (a 32 x 256 fp32 tile spilled); tests/test_kernels_compile.py compiles them all.
UNIT_TILE = 4096


def _launch(x: Tensor, alpha1: Tensor, weight: Tensor, bias: Tensor, alpha2: Tensor, dilation: int,
            history: Tensor | None, out_bias: Tensor | None, block_t: int | None,
            pw_weight: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """(z, x + out_bias or None): the fused kernel's outputs; see `snake_dwconv_snake` for the arguments. With
    `pw_weight` [C, C] (and `out_bias`) it is the whole unit: (nothing, x + out_bias + W @ z)."""
    if x.dim() != 3 or x.shape[-1] == 0:
        raise ValueError(f"the fused residual unit needs x [B, C, T] with T > 0, got {tuple(x.shape)}")
    batch, channels, length = x.shape
    context = (TAPS - 1) * dilation
    if weight.shape != (channels, 1, TAPS) or bias.shape != (channels,) or alpha1.numel() != channels \
            or alpha2.numel() != channels or (out_bias is not None and out_bias.shape != (channels,)):
        raise ValueError(f"the fused residual unit needs weight [C, 1, {TAPS}], C biases and C alphas for C="
                         f"{channels} (got {tuple(weight.shape)}, {tuple(bias.shape)}, {alpha1.numel()}, "
                         f"{alpha2.numel()})")
    if history is not None and (history.shape != (batch, channels, context) or history.dtype != x.dtype
                                or not history.is_contiguous()):
        raise ValueError(f"history must be contiguous {x.dtype} [{batch}, {channels}, {context}], got "
                         f"{history.dtype} {tuple(history.shape)}")
    x = x.contiguous()
    unit = pw_weight is not None
    z = x if unit else torch.empty_like(x)  # the whole unit writes no z (the argument is unused)
    out = None if out_bias is None else torch.empty_like(x)
    rows = batch * channels
    if rows == 0:
        return z, out
    # a power of two (the history tiles' width) of at least 16, which keeps each tile's first sample aligned
    halo = max(16, triton.next_power_of_2(context))
    if unit:
        tile_rows = channels  # one stream a program
        block = block_t or max(2 * halo, 64, min(MAX_BLOCK_T, triton.next_power_of_2(length + halo),
                                                 UNIT_TILE // channels))
        _check_block(block, halo)
    else:
        tile_rows, block = _block_sizes(rows, length, halo, block_t)
    grid = (triton.cdiv(rows, tile_rows), triton.cdiv(length, block - halo))
    mode, new_history = 0, history
    if history is not None:
        mode = 1 if grid[1] == 1 else 2
        if mode == 2:
            new_history = torch.empty_like(history)
    slot = min(block, halo + length)  # a short row's power-of-two tile is mostly padding: no scratch for that
    stage = torch.empty(grid[0] * grid[1] * tile_rows * slot, device=x.device, dtype=x.dtype)
    # fp32: the dot in TF32 exactly when torch's fp32 matmuls are (the decoder sets that as cuDNN's convs, whose
    # GEMM this replaces: `audio_vae.gemms_like_convs`)
    precision = "ieee" if x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"
    tile = tile_rows * block
    _residual_unit_kernel[grid](
        x, history if history is not None else x, new_history if new_history is not None else x, z,
        out if out is not None else z, stage, alpha1.reshape(-1).contiguous(), weight.reshape(-1).contiguous(),
        bias.contiguous(), alpha2.reshape(-1).contiguous(), out_bias.contiguous() if out_bias is not None else bias,
        pw_weight.contiguous() if unit else bias, rows, channels, length, slot,
        DILATION=dilation, HISTORY=mode, RESIDUAL=out is not None and not unit, ROWS=tile_rows, BLOCK_T=block,
        HALO=halo, POINTWISE=unit, CHUNK=MIN_UNIT_CHANNELS, PRECISION=precision,
        num_warps=4 if tile <= 1024 else 8 if tile <= 4096 else 16,
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
    return _launch(x, alpha1, weight, bias, alpha2, dilation, history, None, block_t)[0]


def residual_unit(x: Tensor, alpha1: Tensor, dw_weight: Tensor, dw_bias: Tensor, alpha2: Tensor,
                  pw_weight: Tensor, pw_bias: Tensor, dilation: int, history: Tensor | None = None, *,
                  block_t: int | None = None) -> Tensor:
    """ResidualUnit.forward, x + conv1x1(snake2(dwconv(snake1(x)))): one launch where `whole_unit(C)`, else two:
    the fused kernel (which also writes x + pw_bias), then the pointwise weight [C, C, 1] as one in-place batched
    GEMM. Arguments as in `snake_dwconv_snake`."""
    batch, channels, _ = x.shape
    if pw_weight.shape != (channels, channels, 1):
        raise ValueError(f"pw_weight must be [{channels}, {channels}, 1], got {tuple(pw_weight.shape)}")
    square = pw_weight.reshape(channels, channels)
    if whole_unit(channels) and pw_weight.dtype == x.dtype:
        out = _launch(x, alpha1, dw_weight, dw_bias, alpha2, dilation, history, pw_bias, block_t, square)[1]
        assert out is not None
        return out
    z, out = _launch(x, alpha1, dw_weight, dw_bias, alpha2, dilation, history, pw_bias, block_t)
    assert out is not None
    return out.baddbmm_(square.expand(batch, -1, -1), z)
