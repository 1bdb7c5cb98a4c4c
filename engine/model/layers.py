"""Small building blocks shared by every VoxCPM stack: RMSNorm, SwiGLU MLP, LongRoPE, FSQ, timestep embedding.

Numerics follow the official code operation by operation (fp32 norm variance, fp32 RoPE rotation, the same
LongRoPE table arithmetic), so fp32 results agree with it to rounding. On CUDA the elementwise chains run as the
fused Triton kernels of engine.kernels (same formulas; `RMSNorm.add_and_norm` also takes in the residual add before
the norm), and `fuse_linears` lets q/k/v and gate/up run as one GEMM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import StackConfig
from engine.model import fp8, fusion


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if fusion.fused(x):
            from engine.kernels import rms_norm

            return rms_norm(x, self.weight, self.eps)
        variance = x.float().pow(2).mean(dim=-1, keepdim=True)
        return (x * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight

    def add_and_norm(self, x: Tensor, branch: Tensor | None, scale: float | None = None,
                     fp8_for: fp8.Fp8Weight | None = None) -> tuple[Tensor, Tensor | fp8.Fp8Rows]:
        """A residual add and this norm after it: (x + branch [* scale], its norm); (x, norm(x)) without a branch.
        CUDA: one Triton kernel instead of the add, the muP mul and the norm; elsewhere exactly those eager ops.
        `fp8_for`: the FP8 weight of the GEMM the norm feeds; when that GEMM runs in FP8 (`fp8.wants`), the same
        kernel hands the norm over already quantized for it (`fp8.Fp8Rows`)."""
        if fp8_for is not None and self._fuses_fp8(x, branch, fp8_for):
            from engine import kernels

            rows, lead = x.reshape(-1, x.shape[-1]), tuple(x.shape[:-1])
            if branch is None:
                return x, fp8.Fp8Rows(*kernels.rms_norm_fp8(rows, self.weight, self.eps), x.dtype, lead)
            out, q, q_scale = kernels.add_rms_norm_fp8(rows, branch.reshape(rows.shape), self.weight, self.eps, scale)
            return out.view(x.shape), fp8.Fp8Rows(q, q_scale, x.dtype, lead)
        if branch is None:
            return x, self(x)
        # the kernel would skip hooks on the norm, and eager's sum would broadcast or promote other branches
        if (fusion.fused(x) and branch.dtype == x.dtype and branch.shape == x.shape
                and not (self._forward_hooks or self._forward_pre_hooks)):
            from engine.kernels import add_rms_norm

            return add_rms_norm(x, branch, self.weight, self.eps, scale)
        x = x + (branch if scale is None else branch * scale)
        return x, self(x)

    def _fuses_fp8(self, x: Tensor, branch: Tensor | None, w: fp8.Fp8Weight) -> bool:
        # the FP8 norm kernels take weight and branch in x's dtype (as the plain kernels, else eager would promote),
        # and skip hooks
        return (fp8.wants(x, w) and fusion.fused(x) and self.weight.dtype == x.dtype
                and (branch is None or (branch.dtype == x.dtype and branch.shape == x.shape))
                and not (self._forward_hooks or self._forward_pre_hooks))


def fuse_linears(linears: Sequence[nn.Module]) -> Tensor | None:
    """One [sum(out), in] weight whose row blocks become the linears' weights (their parameters turn into views of
    it: no extra memory, state_dict names unchanged), so one GEMM can replace len(linears). None, and nothing
    changed, unless all are plain bias-free nn.Linear (a TP wrapper keeps them apart) without hooks other than one
    shared LoRA (see `fused_linear`)."""
    if not _fusable(linears):
        return None
    fused = torch.cat([m.weight.detach() for m in linears])
    start = 0
    for m in linears:
        m.weight = nn.Parameter(fused[start:start + m.out_features], requires_grad=m.weight.requires_grad)
        start += m.out_features
    return fused


def fused_weight(fused: Tensor | None, linears: Sequence[nn.Module]) -> Tensor | None:
    """`fused` while the linears still are its plain views; None once a hook other than a shared LoRA was attached,
    a weight was replaced (TP sharding, `.to()`) since `fuse_linears`: the caller then runs them one by one."""
    if fused is None or not _fusable(linears):
        return None
    row_bytes, start = fused.stride(0) * fused.element_size(), 0
    for m in linears:
        if m.weight.data_ptr() != fused.data_ptr() + start * row_bytes:
            return None
        start += m.out_features
    return fused if start == fused.shape[0] else None


def _fusable(linears: Sequence[nn.Module]) -> bool:
    # a LoRA hook is fine when the linears share one FusedLoRA (engine.model.lora), intact: `fused_linear` adds it
    lora = getattr(linears[0], "fused_lora", None)
    shared = lora is not None and all(getattr(m, "fused_lora", None) is lora for m in linears) and lora.intact()
    return all(type(m) is nn.Linear and m.bias is None and not m._forward_pre_hooks
               and len(m._forward_hooks) <= (1 if shared else 0) for m in linears)


def fused_linear(x: Tensor, weight: Tensor, linears: Sequence[nn.Module]) -> Tensor:
    """The linears' outputs side by side from one GEMM with their fused weight, plus their shared LoRA's deltas
    (one shrink and one expand) when they carry one."""
    y = F.linear(x, weight)
    lora = getattr(linears[0], "fused_lora", None)
    return y if lora is None else lora(x, y)


class SwiGLU(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.gate_up: Tensor | None = None  # from `fuse`
        self.gate_up8: fp8.Fp8Weight | None = None  # from `quantize_fp8`
        self.down8: fp8.Fp8Weight | None = None

    def fuse(self) -> None:
        """Run gate and up as one GEMM from now on (when they are plain linears)."""
        self.gate_up = fuse_linears((self.gate_proj, self.up_proj))

    def quantize_fp8(self) -> None:
        """Keep FP8 copies of the weights for large GEMMs (`engine.model.fp8`)."""
        self.gate_up8 = fp8.quantized((self.gate_proj, self.up_proj))
        self.down8 = fp8.quantized((self.down_proj,))

    def forward(self, x: Tensor | fp8.Fp8Rows) -> Tensor:
        """x [..., H], or rows already quantized for `gate_up8` (from the norm before, `RMSNorm.add_and_norm`)."""
        gate_up_out = fp8.linear(x, self.gate_up8)
        if gate_up_out is None and (gate_up := fused_weight(self.gate_up, (self.gate_proj, self.up_proj))) is not None:
            gate_up_out = fused_linear(x, gate_up, (self.gate_proj, self.up_proj))
        if gate_up_out is not None:
            act = fp8.silu_mul(gate_up_out, self.down8)
        else:
            act = F.silu(self.gate_proj(x)) * self.up_proj(x)
        down = fp8.linear(act, self.down8)
        return self.down_proj(act) if down is None else down


class LongRoPE:
    """cos/sin for absolute positions, computed in fp32 on the fly (no table, nothing for `.to(dtype)` to round).

    Plain object, not a module: the official rope tables are non-persistent buffers, absent from state_dict."""

    def __init__(self, stack: StackConfig):
        dim = stack.head_dim
        self.inv_freq = 1.0 / (stack.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
        self.inv_factors = 1.0 / torch.tensor(stack.rope_factors, dtype=torch.float32)
        original = stack.rope_scaling.original_max_position_embeddings
        self.scale = math.sqrt(1 + math.log(stack.max_position_embeddings / original) / math.log(original))
        self._device_tables: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self._prefix_tables: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}

    def _tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if device not in self._device_tables:  # filled on the first (eager) call, so CUDA graphs can reuse it
            self._device_tables[device] = (self.inv_factors.to(device), self.inv_freq.to(device))
        return self._device_tables[device]

    def __call__(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [...] -> (cos, sin) [..., head_dim] in fp32."""
        inv_factors, inv_freq = self._tables(positions.device)
        # Same order of operations as the official table: (pos * 1/factor) * inv_freq.
        freqs = positions.float().unsqueeze(-1) * inv_factors * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scale, emb.sin() * self.scale

    def prefix(self, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """(cos, sin) [length, head_dim] of positions 0..length-1, computed once per (length, device): the local
        stacks' positions always restart at 0, so every patch (and every CUDA graph replay) shares one table."""
        key = (length, device)
        if key not in self._prefix_tables:
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable in and out of inference mode
                self._prefix_tables[key] = self(torch.arange(length, device=device))
        return self._prefix_tables[key]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE in fp32. x [..., L, heads, d]; cos/sin [L, d] (broadcast over heads and leading dims).
    CUDA: one Triton kernel, in place on x (x may be the q|k heads of a fused qkv output)."""
    if fusion.fused(x) and cos.dim() == 2 and _power_of_two(x.shape[-1]):
        from engine.kernels import rope_

        return rope_(x, cos, sin)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos.unsqueeze(-2) + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(-2)).to(x.dtype)


def _power_of_two(n: int) -> bool:
    return n > 1 and not n & (n - 1)


class FSQ(nn.Module):
    """Finite scalar quantisation bottleneck: out_proj(round(tanh(in_proj(h)) * scale) / scale)."""

    def __init__(self, dim: int, latent_dim: int, scale: int):
        super().__init__()
        self.in_proj = nn.Linear(dim, latent_dim)
        self.out_proj = nn.Linear(latent_dim, dim)
        self.scale = scale

    def forward(self, h: Tensor) -> Tensor:
        return self.out_proj(torch.round(torch.tanh(self.in_proj(h)) * self.scale) / self.scale)


class TimestepMLP(nn.Module):
    """Linear-SiLU-Linear (names as the official TimestepEmbedding)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


def sinusoidal_embedding(t: Tensor, dim: int, scale: float = 1000.0) -> Tensor:
    """[sin, cos] embedding of diffusion times t [B] -> [B, dim], computed in t's dtype like the official code."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=t.dtype, device=t.device) * -(math.log(10000) / (half - 1)))
    emb = scale * t.unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat((emb.sin(), emb.cos()), dim=-1)
