"""Small fused Triton kernels for the CUDA path (paged attention lives in engine/model/attention_triton.py).

Each replaces a chain of eager torch kernels with one pass over memory, with the same formula:
- `snake`: the AudioVAE's Snake activation (five eager kernels over its largest activations).
- `rms_norm`: MiniCPM's RMSNorm (variance in fp32, normalise, round to x's dtype, scale by the weight).
- `add_rms_norm`: a residual add (with muP's branch scale) and the RMSNorm after it (two or three kernels -> one).
- `cfg_zero_euler_`: the CFG-Zero* guidance combine and the Euler update of the CFM solver, per batch item.
- `silu_mul`: SwiGLU's act silu(gate) * up from one fused gate|up GEMM output (three kernels -> one).
- `quantize_rows_fp8`: per-row FP8 (e4m3) quantization of a GEMM's input for `engine.model.fp8` (four eager
  kernels and an fp32 copy -> one pass); `rms_norm_fp8`, `add_rms_norm_fp8` and `silu_mul_fp8` produce a GEMM's
  input already quantized (the same bits, one kernel and one write instead of two).
- `rope_`: rotate-half RoPE in place on the q and k heads of one token at once (about ten kernels -> one). Its
  formula (`rope_f32`) also runs inside the attention kernels (engine/model/attention_triton.py), which rotate
  q and k themselves on the fused path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


def dot_precision(x: Tensor) -> str:
    """tl.dot's input precision for x's dtype: exact fp32 products for fp32 (the reference path), else tf32 (16-bit
    inputs have nothing to choose)."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


@triton.jit
def snake_f32(x, alpha):
    """The Snake formula on fp32 values: x + 1/(alpha + 1e-9) * sin(alpha x)^2 (also used by the fused VAE unit)."""
    s = tl.sin(alpha * x)
    return x + (1.0 / (alpha + 1e-9)) * (s * s)


@triton.jit(do_not_specialize=["numel", "length"])  # sizes vary with batch: no recompiles
def _snake_kernel(x_ptr, alpha_ptr, scale_ptr, shift_ptr, y_ptr, numel, channels, length, AFFINE: tl.constexpr,
                  BLOCK: tl.constexpr):
    # Flat over B*C*T so short streaming chunks (a few samples per channel) still fill whole blocks.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    chan = (offsets // length) % channels
    alpha = tl.load(alpha_ptr + chan, mask=mask, other=1.0).to(tl.float32)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if AFFINE:  # the per-channel x * scale + shift before it, in fp32
        scale = tl.load(scale_ptr + chan, mask=mask, other=1.0).to(tl.float32)
        shift = tl.load(shift_ptr + chan, mask=mask, other=0.0).to(tl.float32)
        x = x * scale + shift
    tl.store(y_ptr + offsets, snake_f32(x, alpha).to(y_ptr.dtype.element_ty), mask=mask)


def snake(x: Tensor, alpha: Tensor, affine: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """y = x + 1/(alpha + 1e-9) * sin(alpha x)^2 over x [B, C, T], one alpha per channel (e.g. [1, C, 1]); fp32 math.
    `affine` (scale, shift), each [C]: snake of x * scale + shift instead, in the same pass."""
    if x.dim() != 3 or alpha.numel() != x.shape[1]:
        raise ValueError(f"snake needs x [B, C, T] and C alphas (got x {tuple(x.shape)}, alpha {tuple(alpha.shape)})")
    if affine is not None and any(t.numel() != x.shape[1] for t in affine):
        raise ValueError(f"snake's affine needs {x.shape[1]} scales and shifts")
    x = x.contiguous()
    y = torch.empty_like(x)
    alpha = alpha.reshape(-1).contiguous()
    scale, shift = (alpha, alpha) if affine is None else (t.reshape(-1).contiguous() for t in affine)
    if y.numel():
        _snake_kernel[(triton.cdiv(y.numel(), 1024),)](
            x, alpha, scale, shift, y, y.numel(), x.shape[1], x.shape[2], AFFINE=affine is not None, BLOCK=1024,
            num_warps=4)
    return y


@triton.jit
def _rms_norm_row(x, weight_ptr, cols, mask, dim, eps):
    """One row's RMSNorm in fp32 (masked columns of x must be 0), shared by both norm kernels."""
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / dim + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)  # rounded to x's dtype before the weight, as in eager
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return normed * weight


@triton.jit
def _store_norm_row(y, x, y_ptr, scale_ptr, row, stride_y, cols, mask, FP8: tl.constexpr):
    """A norm's output row: in y's dtype, or (FP8) rounded to x's dtype as the eager norm's output would be, then
    quantized for the GEMM it feeds."""
    if FP8:
        _store_fp8_row(y.to(x.dtype).to(tl.float32), y_ptr, scale_ptr, row, stride_y, cols, mask)
    else:
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, y_ptr, scale_ptr, stride_x, stride_y, dim, eps, BLOCK: tl.constexpr,
                     FP8: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    y = _rms_norm_row(x, weight_ptr, cols, mask, dim, eps)
    _store_norm_row(y, x, y_ptr, scale_ptr, row, stride_y, cols, mask, FP8)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim of x [..., H] with weight [H]; result dtype as torch would promote x and weight."""
    rows = _norm_rows(x, weight)
    y = torch.empty(rows.shape, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    _launch_rms_norm(rows, weight, eps, y, y)
    return y.view(x.shape)


def rms_norm_fp8(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`rms_norm` of x [R, H] (weight in x's dtype) quantized for an FP8 GEMM in the same pass: what
    `quantize_rows_fp8(rms_norm(x, weight, eps))` gives, bit for bit."""
    rows = _norm_rows(x, weight, fp8=True)
    q, scale = _fp8_rows(*rows.shape, x.device)
    _launch_rms_norm(rows, weight, eps, q, scale)
    return q, scale


def _norm_rows(x: Tensor, weight: Tensor, fp8: bool = False) -> Tensor:
    if x.shape[-1:] != weight.shape:
        raise ValueError(f"rms_norm needs x [..., H] and weight [H] (got {tuple(x.shape)}, {tuple(weight.shape)})")
    if fp8 and (x.dim() != 2 or weight.dtype != x.dtype):  # eager would promote x * weight past x's dtype
        raise ValueError(f"the FP8 norms need x [R, H] and weight in x's dtype (got {tuple(x.shape)}, "
                         f"{x.dtype}, {weight.dtype})")
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _fp8_rows(rows: int, width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Empty FP8 rows [rows, width] and their scales [rows, 1] float32."""
    return (torch.empty(rows, width, device=device, dtype=torch.float8_e4m3fn),
            torch.empty(rows, 1, device=device, dtype=torch.float32))


def _launch_rms_norm(rows: Tensor, weight: Tensor, eps: float, y: Tensor, scale: Tensor) -> None:
    if rows.numel():
        block = triton.next_power_of_2(rows.shape[1])
        _rms_norm_kernel[(rows.shape[0],)](rows, weight.contiguous(), y, scale, rows.stride(0), y.stride(0),
                                           rows.shape[1], eps, BLOCK=block, FP8=y.dtype == torch.float8_e4m3fn,
                                           num_warps=min(16, max(1, block // 256)))


@triton.jit
def _add_rms_norm_kernel(x_ptr, h_ptr, weight_ptr, out_ptr, y_ptr, y_scale_ptr, stride_x, stride_h, stride_out,
                         stride_y, dim, eps, scale, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    if HAS_SCALE:  # eager's h * scale is its own kernel: the product is rounded to h's dtype before the add
        h = (h.to(tl.float32) * scale).to(h.dtype)
    x = (x.to(tl.float32) + h.to(tl.float32)).to(x.dtype)  # the residual, in x's dtype like eager's x + h
    tl.store(out_ptr + row * stride_out + cols, x, mask=mask)
    y = _rms_norm_row(x, weight_ptr, cols, mask, dim, eps)
    _store_norm_row(y, x, y_ptr, y_scale_ptr, row, stride_y, cols, mask, FP8)


def add_rms_norm(x: Tensor, h: Tensor, weight: Tensor, eps: float,
                 scale: float | None = None) -> tuple[Tensor, Tensor]:
    """(x_new, rms_norm(x_new, weight, eps)) with x_new = x + h (or x + h * scale), in one pass over memory.

    x, h [..., H] (rows may be strided; h's dtype must promote into x's), weight [H]. x_new is new memory of x's
    shape and dtype (x is not written: it may be a caller's or a CUDA graph's input); every rounding is eager's."""
    if x.shape != h.shape or x.shape[-1:] != weight.shape:
        raise ValueError(f"add_rms_norm needs x, h [..., H] and weight [H] "
                         f"(got {tuple(x.shape)}, {tuple(h.shape)}, {tuple(weight.shape)})")
    if torch.promote_types(x.dtype, h.dtype) != x.dtype:
        raise ValueError(f"add_rms_norm: x + h would not stay {x.dtype} (h is {h.dtype})")
    x_rows, h_rows = _rows(x), _rows(h)
    out = torch.empty(x_rows.shape, device=x.device, dtype=x.dtype)
    y = torch.empty(x_rows.shape, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    _launch_add_rms_norm(x_rows, h_rows, weight, eps, scale, out, y, y)
    return out.view(x.shape), y.view(x.shape)


def add_rms_norm_fp8(x: Tensor, h: Tensor, weight: Tensor, eps: float,
                     scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`add_rms_norm` of x, h [R, H] (weight in x's dtype) with the norm quantized for an FP8 GEMM in the same pass:
    (x_new, q, q's scales [R, 1]), the bits of `quantize_rows_fp8` of `add_rms_norm`'s norm."""
    if x.shape != h.shape or x.dtype != h.dtype:
        raise ValueError(f"add_rms_norm_fp8 needs x, h of one shape and dtype (got {tuple(x.shape)} {x.dtype}, "
                         f"{tuple(h.shape)} {h.dtype})")
    x_rows, h_rows = _norm_rows(x, weight, fp8=True), _rows(h)
    out = torch.empty(x_rows.shape, device=x.device, dtype=x.dtype)
    q, q_scale = _fp8_rows(*x_rows.shape, x.device)
    _launch_add_rms_norm(x_rows, h_rows, weight, eps, scale, out, q, q_scale)
    return out, q, q_scale


def _launch_add_rms_norm(x_rows: Tensor, h_rows: Tensor, weight: Tensor, eps: float, scale: float | None,
                         out: Tensor, y: Tensor, y_scale: Tensor) -> None:
    if out.numel():
        block = triton.next_power_of_2(x_rows.shape[1])
        # enable_fp_fusion=False: fp32 x + h * scale must not become one fma (eager rounds the product first)
        _add_rms_norm_kernel[(x_rows.shape[0],)](
            x_rows, h_rows, weight.contiguous(), out, y, y_scale, x_rows.stride(0), h_rows.stride(0), out.stride(0),
            y.stride(0), x_rows.shape[1], eps, 1.0 if scale is None else float(scale), HAS_SCALE=scale is not None,
            BLOCK=block, FP8=y.dtype == torch.float8_e4m3fn, num_warps=min(16, max(1, block // 256)),
            enable_fp_fusion=False)


def _rows(x: Tensor) -> Tensor:
    """x [..., H] as [rows, H] with unit column stride: a view when the leading dims flatten, else a copy."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


@triton.jit(do_not_specialize=["batch", "numel"])  # the batch varies step to step
def _cfg_zero_euler_kernel(x_ptr, v_ptr, cfg_ptr, dt_ptr, batch, numel, BLOCK: tl.constexpr):
    item = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < numel
    v_cond = tl.load(v_ptr + item * numel + offsets, mask=mask, other=0.0).to(tl.float32)
    v_uncond = tl.load(v_ptr + (batch + item) * numel + offsets, mask=mask, other=0.0).to(tl.float32)
    scale = tl.sum(v_cond * v_uncond, 0) / (tl.sum(v_uncond * v_uncond, 0) + 1e-8)
    cfg = tl.load(cfg_ptr + item).to(tl.float32)
    v = v_uncond * scale + cfg * (v_cond - v_uncond * scale)
    dt = tl.load(dt_ptr + item)
    x = tl.load(x_ptr + item * numel + offsets, mask=mask, other=0.0)
    tl.store(x_ptr + item * numel + offsets, x - dt * v, mask=mask)


def cfg_zero_euler_(x: Tensor, v: Tensor, cfg_value: Tensor, dt: Tensor | float) -> Tensor:
    """In place x -= dt * CFG-Zero*(v): x [B, ...] fp32 contiguous; v [2B, ...] (conditional rows first, then
    unconditional); cfg_value [B]; dt [B] fp32, each item's Euler step (or one float for all). Guidance per item:
    s = <vc, vu> / (|vu|^2 + 1e-8), v = vu s + w (vc - vu s)."""
    b = x.shape[0]
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError("cfg_zero_euler_ updates a contiguous fp32 state x in place")
    if v.shape != (2 * b, *x.shape[1:]) or cfg_value.numel() != b:
        raise ValueError(f"cfg_zero_euler_ needs v [2B, ...] and cfg_value [B] for x {tuple(x.shape)} "
                         f"(got v {tuple(v.shape)}, cfg_value {tuple(cfg_value.shape)})")
    if not isinstance(dt, Tensor):
        dt = torch.full((b,), dt, device=x.device)
    if dt.numel() != b or dt.dtype != torch.float32:
        raise ValueError(f"cfg_zero_euler_ needs dt [B] fp32 for x {tuple(x.shape)} (got {tuple(dt.shape)} {dt.dtype})")
    numel = x[0].numel()
    if x.numel():
        _cfg_zero_euler_kernel[(b,)](x, v.contiguous(), cfg_value.contiguous(), dt.contiguous(), b, numel,
                                     BLOCK=triton.next_power_of_2(numel), num_warps=4)
    return x


@triton.jit
def _silu_mul_row(gu_ptr, row, stride_gu, cols, mask, ffn):
    """silu(gate) * up over one row's `cols`, in fp32, every rounding eager's (masked columns 0)."""
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * stride_gu + ffn + cols, mask=mask, other=0.0)
    # eager rounds silu(gate) to the activation dtype before the product; so does this
    act = (gate.to(tl.float32) * tl.sigmoid(gate.to(tl.float32))).to(gate.dtype).to(tl.float32)
    return act * up.to(tl.float32)


@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, stride_gu, stride_y, ffn, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ffn
    y = _silu_mul_row(gu_ptr, row, stride_gu, cols, mask, ffn)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_fp8_kernel(gu_ptr, q_ptr, scale_ptr, stride_gu, stride_q, ffn, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one program per row: the scale needs the whole row
    cols = tl.arange(0, BLOCK)
    mask = cols < ffn
    y = _silu_mul_row(gu_ptr, row, stride_gu, cols, mask, ffn)
    _store_fp8_row(y.to(gu_ptr.dtype.element_ty).to(tl.float32), q_ptr, scale_ptr, row, stride_q, cols, mask)


FP8_ROW_MAX = 8192  # the widest row the fused FP8 producers hold in registers (16 warps, 16 values a thread)


def silu_mul_fp8(gate_up: Tensor) -> tuple[Tensor, Tensor]:
    """silu(gate) * up of gate_up [R, 2F] (F <= FP8_ROW_MAX) quantized for an FP8 GEMM in the same pass: the bits of
    `quantize_rows_fp8(silu_mul(gate_up))`."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.shape[1] // 2 > FP8_ROW_MAX:
        raise ValueError(f"silu_mul_fp8 needs gate_up [R, 2F] with F <= {FP8_ROW_MAX}, got {tuple(gate_up.shape)}")
    ffn = gate_up.shape[1] // 2
    rows = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    q, scale = _fp8_rows(rows.shape[0], ffn, rows.device)
    if q.numel():
        block = triton.next_power_of_2(ffn)
        _silu_mul_fp8_kernel[(rows.shape[0],)](rows, q, scale, rows.stride(0), q.stride(0), ffn, BLOCK=block,
                                               num_warps=min(16, max(1, block // 512)))
    return q, scale


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up where gate_up [..., 2F] is gate | up side by side (one GEMM's output) -> [..., F]."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul needs an even last dim (gate | up), got {tuple(gate_up.shape)}")
    ffn = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * ffn)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape[0], ffn, device=gate_up.device, dtype=gate_up.dtype)
    if y.numel():
        block = min(1024, triton.next_power_of_2(ffn))
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(ffn, block))](rows, y, rows.stride(0), y.stride(0), ffn,
                                                                   BLOCK=block, num_warps=4)
    return y.view(*gate_up.shape[:-1], ffn)


E4M3_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn (a constexpr: kernels may read it)


@triton.jit
def _store_fp8_row(y, q_ptr, scale_ptr, row, stride_q, cols, mask):
    """Store one row held in fp32 (masked columns 0) as FP8 e4m3 with its scale max|y| / 448, as torch would:
    the quantizer's and the fused producers' (norms, silu_mul) last step."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / E4M3_MAX
    tl.store(scale_ptr + row, scale)
    tl.store(q_ptr + row * stride_q + cols, tl.math.div_rn(y, scale).to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit  # width specialized (divisible by 16): 16-byte loads under the row mask; LM widths are few
def _quantize_rows_fp8_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, width, BLOCK: tl.constexpr,
                              ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:  # the row in registers: one read of x
        cols = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < width, other=0.0).to(tl.float32)
        _store_fp8_row(x, q_ptr, scale_ptr, row, stride_q, cols, cols < width)
    else:  # rows too wide for registers: the largest magnitude first, then x / scale (from L2)
        amax = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + cols, mask=cols < width, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / E4M3_MAX
        tl.store(scale_ptr + row, scale)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + cols, mask=cols < width, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * stride_q + cols, tl.math.div_rn(x, scale).to(q_ptr.dtype.element_ty),
                     mask=cols < width)


def quantize_rows_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [R, K] -> (x / s as float8_e4m3fn [R, K], s [R, 1] float32), s = max|row| / 448 (at least 1e-12 / 448):
    what `engine.model.fp8.quantize_rows` computes with torch ops."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows_fp8 needs x [R, K], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    q, scale = _fp8_rows(*x.shape, x.device)
    if x.numel():
        # a row of up to 8,192 stays in registers (16 warps: 16 values a thread at most), so x is read once: two
        # passes read it twice, the second waiting on the first's reduction
        block = min(8192, triton.next_power_of_2(x.shape[1]))
        _quantize_rows_fp8_kernel[(x.shape[0],)](x, q, scale, x.stride(0), q.stride(0), x.shape[1], BLOCK=block,
                                                 ONE_PASS=block >= x.shape[1], num_warps=min(16, max(1, block // 256)))
    return q, scale


@triton.jit
def rope_f32(x, rotated, cos, sin):
    """Rotate-half RoPE on fp32 values: x * cos + rotate_half(x) * sin, where `rotated` is rotate_half(x) at the
    same place (-x2 in the first half, x1 in the second). Every RoPE kernel calls this: one explicit fma, so the
    rotation rounds the same in each of them (a compiler contracts a plain a * b + c * d either way)."""
    return tl.fma(x, cos, rotated * sin)


@triton.jit
def rope_heads_(x_ptr, stride_h, heads, cos_ptr, sin_ptr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate the `heads` heads of one token in place: x_ptr at its first head, cos_ptr/sin_ptr at its table row.
    Returns the rotated halves ([BLOCK_H, HALF] each, in x's dtype) for a caller that also stores them elsewhere."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < heads
    first = x_ptr + h * stride_h + d
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    out1 = rope_f32(x1f, -x2f, tl.load(cos_ptr + d), tl.load(sin_ptr + d)).to(x1.dtype)
    out2 = rope_f32(x2f, x1f, tl.load(cos_ptr + HALF + d), tl.load(sin_ptr + HALF + d)).to(x1.dtype)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    return out1, out2


@triton.jit(do_not_specialize=["positions"])  # token counts vary step to step
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ct, heads, positions,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    row = token % positions  # cos/sin rows repeat every `positions` tokens (dense stacks: one table per patch)
    rope_heads_(x_ptr + token * stride_xt, stride_xh, heads, cos_ptr + row * stride_ct, sin_ptr + row * stride_ct,
                HALF, BLOCK_H)


def rope_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """In place rotate-half RoPE, fp32 math: x [..., T, heads, D] (last dim contiguous, e.g. the q|k heads of a
    fused qkv output); cos/sin fp32 [T, D] contiguous, repeated over x's leading dims. Returns x."""
    t, heads, dim = x.shape[-3:]
    if cos.shape != (t, dim) or sin.shape != cos.shape or dim % 2 or dim & (dim - 1):
        raise ValueError(f"rope_ needs x [..., T, H, D] (D a power of two) and cos/sin [T, D] "
                         f"(got x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)})")
    if x.stride(-1) != 1:
        raise ValueError("rope_ needs x's last dim contiguous")
    try:
        tokens = x.view(-1, heads, dim)  # a view, so the kernel writes into x
    except RuntimeError as e:
        raise ValueError(f"rope_ needs x's token dims to flatten into one strided dim ({e})") from None
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    if tokens.numel():
        _rope_kernel[(tokens.shape[0],)](tokens, cos, sin, tokens.stride(0), tokens.stride(1), cos.stride(0), heads,
                                         t, HALF=dim // 2, BLOCK_H=triton.next_power_of_2(heads), num_warps=4)
    return x
