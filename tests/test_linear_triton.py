"""The few-rows linear (`engine.model.linear_triton.skinny_linear`) on CPU under TRITON_INTERPRET=1 == F.linear.

Cases: one row (an LM step at one stream) and 22 (the LocDiT's 2 x 11 tokens), K unsplit, split evenly and split with
a ragged last split, N not a multiple of the column tile; the split path's arrival counters are back to zero after
every call (one buffer serves every linear of a step), and the same inputs give the same bits. fp32 and fp16 (the
interpreter's bf16 dot is wrong). Needs `triton` installed (the test extras pin it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import interpreted

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


@pytest.fixture(scope="module")
def linear_triton():
    with interpreted("engine.model.linear_triton") as (module,):
        yield module


@pytest.mark.parametrize("rows", [1, 22])
@pytest.mark.parametrize(("n", "k", "splits"), [(96, 128, 1), (64, 512, 4), (130, 640, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_skinny_linear_equals_f_linear(linear_triton, rows, n, k, splits, dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)

    y = linear_triton.skinny_linear(x, w, splits=splits)

    ref = F.linear(x.double(), w.double())
    assert y.dtype == dtype and y.shape == (rows, n)
    assert ((y.double() - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 2e-3)
    assert not linear_triton._counter_buffer(x.device).any()  # every column tile's counter reset by its last split
    assert torch.equal(linear_triton.skinny_linear(x, w, splits=splits), y)


def test_leading_dims_and_refusals(linear_triton):
    x = torch.randn(2, 11, 64)
    w = torch.randn(80, 64)
    y = linear_triton.skinny_linear(x, w, splits=2)
    assert y.shape == (2, 11, 80)
    assert torch.allclose(y, F.linear(x, w), atol=1e-4)
    assert not linear_triton.supports(torch.randn(33, 64), w)  # more rows than one tile: cuBLAS
    with pytest.raises(ValueError, match="skinny_linear takes"):
        linear_triton.skinny_linear(torch.randn(3, 64), torch.randn(80, 64, dtype=torch.float64))


def test_plain_linears_take_the_skinny_path_when_switched_on(linear_triton, monkeypatch):
    """`layers.apply_linear`: a plain bias-free nn.Linear of few rows goes to skinny_linear (VOXGATE_SKINNY_LINEAR on,
    CUDA dispatch); one with a bias or a hook (LoRA) runs as the module; more rows than a tile go to F.linear."""
    from torch import nn

    from engine.model import layers

    calls = []
    skinny = linear_triton.skinny_linear
    monkeypatch.setattr(linear_triton, "skinny_linear", lambda x, w: calls.append(x.shape) or skinny(x, w))
    monkeypatch.setattr(layers, "fused", lambda t: True)  # the CUDA dispatch, on CPU tensors
    monkeypatch.setattr(layers, "SKINNY_LINEAR", True)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 64, generator=gen)
    plain, biased, hooked = nn.Linear(64, 80, bias=False), nn.Linear(64, 80), nn.Linear(64, 80, bias=False)
    hooked.register_forward_hook(lambda module, args, out: out * 2)

    assert torch.allclose(layers.apply_linear(plain, x), plain(x), atol=1e-5) and calls == [(4, 64)]
    assert torch.equal(layers.apply_linear(biased, x), biased(x))
    assert torch.equal(layers.apply_linear(hooked, x), hooked(x))
    many = torch.randn(40, 64, generator=gen)
    assert torch.equal(layers.apply_linear(plain, many), plain(many))
    assert calls == [(4, 64)]  # only the plain few-rows one
