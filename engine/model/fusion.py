"""Whether an op runs as one of `engine.kernels`' Triton kernels, and the element-wise ops both the plain layers
(`engine.model.layers`) and the FP8 path (`engine.model.fp8`) use."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from engine.settings import EngineSettings

# Off (VOXGATE_FUSED_KERNELS=0): plain torch ops on CUDA too, for A/B timing and as a fallback.
FUSED_KERNELS = EngineSettings.from_env().fused_kernels


def fused(x: Tensor) -> bool:
    """Whether x's op runs as one of engine.kernels' Triton kernels (CUDA, unless switched off)."""
    return x.is_cuda and FUSED_KERNELS


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of a [..., 2F] gate | up tensor: one Triton kernel on CUDA."""
    if fused(gate_up):
        from engine import kernels

        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
