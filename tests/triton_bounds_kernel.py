"""A one-kernel module for tests/test_triton_bounds.py (imported under the interpreter)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shifted_copy_kernel(x_ptr, y_ptr, shift, count, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + shift + i, mask=i < count), mask=i < count)


def shifted_copy(x: torch.Tensor, y: torch.Tensor, shift: int, count: int = 16) -> None:
    """y[:count] = x[shift:shift + count], with no bounds of its own (what the check must catch)."""
    _shifted_copy_kernel[(1,)](x, y, shift, count, BLOCK=16)
