"""The interpreter's bounds check (tests/triton_bounds.py) is on for the CPU suite and catches a stray access."""

from __future__ import annotations

import os

import pytest
import torch
from triton.runtime.errors import InterpreterError

from tests.conftest import interpreted

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only (CPU)")


def test_a_load_or_store_past_the_tensors_raises():
    with interpreted("tests.triton_bounds_kernel") as (module,):
        x, y = torch.arange(64, dtype=torch.float32), torch.zeros(16)
        module.shifted_copy(x, y, 48)  # the last 16 elements: inside
        assert torch.equal(y, x[48:])
        with pytest.raises(InterpreterError, match="TritonOutOfBounds.*load of 8 of 16 addresses"):
            module.shifted_copy(x, y, 56)
        with pytest.raises(InterpreterError, match="TritonOutOfBounds.*store of 8 of 16 addresses"):
            module.shifted_copy(x, torch.zeros(8), 0)
        module.shifted_copy(x, torch.zeros(8), 56, count=8)  # masked-off lanes are not accesses
        # the bound is the argument's storage: a view's writes past its end but inside its base pass unseen
        module.shifted_copy(x, y[:8], 0)
        assert torch.equal(y, x[:16])
