"""Small building blocks shared by every VoxCPM stack: RMSNorm, SwiGLU MLP, LongRoPE, FSQ, timestep embedding.

Numerics follow the official code operation by operation (fp32 norm variance, fp32 RoPE rotation, the same
LongRoPE table arithmetic), so fp32 results agree with it to rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import StackConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        variance = x.float().pow(2).mean(dim=-1, keepdim=True)
        return (x * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class SwiGLU(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE in fp32. x [..., L, heads, d]; cos/sin [..., L, d] (broadcast over heads)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos.unsqueeze(-2) + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(-2)).to(x.dtype)


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
