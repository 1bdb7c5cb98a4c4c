"""FP8 (e4m3) GEMMs for steps of many rows: the opt-in `fp8_prefill` (both LMs) and `fp8_dit` (the LocDiT).

A burst of prompts is compute-bound: 64 prompts of ~111 positions through both LMs are ~24 TFLOP of bf16
GEMMs, most of the first audio's wait. FP8 tensor cores have twice
bf16's rate. Weights are quantized once at load, per output channel; a GEMM's input per row as it runs: on CUDA by
the kernel that produces it where one can (the norms before q|k|v and gate|up, SwiGLU's silu_mul, which hand over
`Fp8Rows`), else by one quantizer kernel. The product is `torch._scaled_mm` with both row-wise scales, out in the
input's dtype.

Only GEMMs of at least `MIN_ROWS` rows run in FP8. Below that a GEMM is bound by reading its weights or by latency
(decode steps, the LocDiT of a few streams), where FP8 would buy little and would make a stream's numbers depend on
which batch it shares. So in practice: the LMs' prefill steps of many prompts or of one long prompt, and with
`fp8_dit` the LocDiT of ~47 streams or more (22 rows each). Only plain linears get an FP8 copy (not
tensor-parallel or LoRA-wrapped ones, whose own forward must run); it costs one byte per weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from engine.model import fusion
from engine.settings import EngineSettings

# rows of a GEMM's input from which it runs in FP8 (VOXGATE_FP8_MIN_ROWS, for tests): a c=64 burst's prefill is
# ~7,100 rows, decode steps at most max_num_seqs (512) rows
MIN_ROWS = EngineSettings.from_env().fp8_min_rows


@dataclass(frozen=True)
class Fp8Weight:
    """A linear's weight in FP8: weight [N, K] float8_e4m3fn, scale [1, N] float32 (one per output channel)."""

    weight: Tensor
    scale: Tensor


@dataclass(frozen=True)
class Fp8Rows:
    """A GEMM's input already in FP8, from a producer kernel that quantized it as it wrote it (the norms before
    q|k|v and gate|up, SwiGLU's act before down): q [R, K] float8_e4m3fn, scale [R, 1] float32, the dtype the
    GEMM returns, and the input's leading dims (R rows in all)."""

    q: Tensor
    scale: Tensor
    dtype: torch.dtype
    lead: tuple[int, ...]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.lead, self.q.shape[1]))


def supported(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs FP8 on this device: the CPU, or a GPU of compute capability 8.9+ (Ada, Hopper
    and later)."""
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9))


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [R, K] -> (x / s as float8_e4m3fn, s [R, 1] float32) with s = max|row| / 448 per row."""
    if fusion.fused(x):
        from engine import kernels

        return kernels.quantize_rows_fp8(x)
    return quantize_rows_eager(x)


def quantize_rows_eager(x: Tensor) -> tuple[Tensor, Tensor]:
    """`quantize_rows` in torch ops (the CPU's path, and the reference for the CUDA kernel)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return (xf / scale).to(torch.float8_e4m3fn), scale


def quantized(linears: Sequence[nn.Module]) -> Fp8Weight | None:
    """One FP8 weight for the linears' outputs side by side; None unless all are plain bias-free nn.Linear without
    hooks, with widths `torch._scaled_mm` takes (multiples of 16)."""
    if not all(type(m) is nn.Linear and m.bias is None and not m._forward_hooks and not m._forward_pre_hooks
               for m in linears):
        return None
    weight = torch.cat([m.weight.detach() for m in linears])
    if weight.shape[0] % 16 or weight.shape[1] % 16:
        return None
    q, scale = quantize_rows(weight)
    return Fp8Weight(q, scale.view(1, -1))


def wants(x: Tensor, w: Fp8Weight | None) -> bool:
    """Whether the GEMM of x [..., K] by w runs in FP8: w is set and x has at least `MIN_ROWS` rows."""
    return w is not None and x.numel() >= MIN_ROWS * x.shape[-1]


def linear(x: Tensor | Fp8Rows, w: Fp8Weight | None) -> Tensor | None:
    """x [..., K] @ w^T in FP8, in x's dtype, when `wants(x, w)` (always for rows already in FP8: w must be set);
    None otherwise (the caller runs its own GEMM)."""
    if isinstance(x, Fp8Rows):
        assert w is not None, "FP8 rows need the FP8 weight they were made for"
        y = _scaled_mm(x.q, x.scale, w, x.dtype)
        return y.view(*x.lead, y.shape[-1])
    if not wants(x, w):
        return None
    q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    y = _scaled_mm(q, scale, w, x.dtype)
    return y.view(*x.shape[:-1], y.shape[-1])


def silu_mul(gate_up: Tensor, w_next: Fp8Weight | None) -> Tensor | Fp8Rows:
    """SwiGLU's act of gate_up [..., 2F] for the down projection `w_next`: already quantized for it, in the same
    kernel, when that GEMM runs in FP8 on the fused path; else `fusion.silu_mul`'s."""
    if wants(gate_up, w_next) and fusion.fused(gate_up):
        from engine import kernels

        if gate_up.shape[-1] // 2 <= kernels.FP8_ROW_MAX:
            q, scale = kernels.silu_mul_fp8(gate_up.reshape(-1, gate_up.shape[-1]))
            return Fp8Rows(q, scale, gate_up.dtype, tuple(gate_up.shape[:-1]))
    return fusion.silu_mul(gate_up)


def _scaled_mm(q: Tensor, scale: Tensor, w: Fp8Weight, dtype: torch.dtype) -> Tensor:
    # row-wise scales on CUDA give bf16 only (the engine's LM dtype there); a float32 model gets it widened
    y = torch._scaled_mm(q, w.weight.t(), scale_a=scale, scale_b=w.scale,
                         out_dtype=torch.bfloat16 if q.is_cuda else dtype)
    return y.to(dtype)


def weights(module: nn.Module) -> list[Fp8Weight]:
    """The FP8 weights kept by the module's layers (`quantize_fp8`)."""
    return [w for m in module.modules() for w in vars(m).values() if isinstance(w, Fp8Weight)]


def warm_up(module: nn.Module, max_rows: int) -> None:
    """Run each of the module's FP8 GEMM shapes once at row counts from MIN_ROWS to `max_rows` (CUDA), so cuBLASLt
    picks and loads its kernels at start and not in the first burst (whose prefill step would wait on those loads)."""
    by_shape = {w.weight.shape: w for w in weights(module)}
    if not by_shape or next(iter(by_shape.values())).weight.device.type != "cuda":
        return
    dtype = next(module.parameters()).dtype
    sizes = sorted({*range(MIN_ROWS, min(max_rows, 16384) + 1, 512), *(2 ** i for i in range(14, 20)
                                                                           if MIN_ROWS <= 2 ** i <= max_rows)})
    for w in by_shape.values():
        x = torch.zeros(sizes[-1], w.weight.shape[1], device=w.weight.device, dtype=dtype)
        for rows in sizes:
            linear(x[:rows], w)
    torch.cuda.synchronize(next(iter(by_shape.values())).weight.device)
