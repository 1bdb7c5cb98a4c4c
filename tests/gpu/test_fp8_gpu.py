"""FP8 prefill on CUDA: the Triton row quantizer gives torch's bits (its CPU twin, tests/test_fp8.py, is checked
against torch ops there), the FP8 GEMM at VoxCPM2's LM widths is within FP8's error of fp32, and the tiny model's
LMs with FP8 copies agree with the model's own prefill.

Run on the GPU machine: `.venv/bin/python -m pytest -q -m gpu tests/gpu/test_fp8_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.config import ModelConfig
from engine.model import fp8
from engine.model.voxcpm import VoxCPMModel
from engine.model_configs import tiny
from tests.test_fp8 import prefill, rel, three_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "width"), [(7104, 2048), (300, 6144), (5, 100), (3, 12288)])
def test_triton_quantizer_gives_torchs_bits(rows: int, width: int, dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows + width)
    x = (torch.randn(rows, width, device="cuda", generator=g) * 3).to(dtype)
    x[0] = 0  # an all-zero row
    x[-1, ::7] *= 1e3  # an outlier row
    q, scale = kernels.quantize_rows_fp8(x)
    want_q, want_scale = fp8.quantize_rows_eager(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize(("k", "n"), [(2048, 2560), (2048, 2048), (2048, 12288), (6144, 2048)])
def test_fp8_gemm_at_the_lm_widths_is_within_fp8_error(k: int, n: int, monkeypatch) -> None:
    monkeypatch.setattr(fp8, "MIN_ROWS", 1024)
    g = torch.Generator(device="cuda").manual_seed(k + n)
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, device="cuda", generator=g) * k ** -0.5)
    w = fp8.quantized((linear,))
    x = torch.randn(1111, k, device="cuda", generator=g, dtype=torch.bfloat16)
    y = fp8.linear(x, w)
    assert y is not None and y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    want = x.float() @ linear.weight.float().t()
    assert 1e-3 < rel(y, want) < 0.05
    assert fp8.linear(x[:1023], w) is None


def test_tiny_lms_prefill_in_fp8_on_cuda_agrees_with_the_model(monkeypatch) -> None:
    """fp32 (run_lms feeds fp32 patches), fused q|k|v and gate|up as the runner sets them up on CUDA."""
    torch.manual_seed(0)
    model = VoxCPMModel(ModelConfig.from_dict(tiny("voxcpm2"))).eval().to("cuda")
    model.fuse_projections()
    with torch.no_grad():
        want = prefill(model, three_prompts())
        model.quantize_lms_fp8()
        monkeypatch.setattr(fp8, "MIN_ROWS", 16)
        got = prefill(model, three_prompts())
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all() and 1e-3 < rel(g, w) < 0.1


def test_warm_up_runs_every_fp8_shape_at_every_row_count(monkeypatch) -> None:
    torch.manual_seed(0)
    model = VoxCPMModel(ModelConfig.from_dict(tiny("voxcpm2"))).eval().to("cuda", torch.bfloat16)
    model.fuse_projections()
    model.quantize_lms_fp8()
    monkeypatch.setattr(fp8, "MIN_ROWS", 1024)
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **k: calls.append((a.shape[0], tuple(b.shape))) or real(
        a, b, **k))
    fp8.warm_up(model, 3000)
    shapes = {tuple(w.weight.t().shape) for w in fp8.weights(model)}
    assert len(shapes) >= 3 and sorted(calls) == sorted((rows, s) for s in shapes for rows in (1024, 1536, 2048, 2560))


@pytest.mark.parametrize(("rows", "width"), [(7104, 2048), (300, 6144), (5, 64)])
def test_fused_fp8_producers_give_the_bits_of_producing_then_quantizing(rows: int, width: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows + width)
    x, h = ((torch.randn(rows, width, device="cuda", generator=g) * 2).bfloat16() for _ in range(2))
    weight = (1 + torch.randn(width, device="cuda", generator=g) / 4).bfloat16()

    def same(got, want) -> bool:
        return torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))

    assert same(kernels.rms_norm_fp8(x, weight, 1e-5), kernels.quantize_rows_fp8(kernels.rms_norm(x, weight, 1e-5)))
    out, y = kernels.add_rms_norm(x, h, weight, 1e-5, 0.26)
    got_out, *got = kernels.add_rms_norm_fp8(x, h, weight, 1e-5, 0.26)
    assert torch.equal(got_out, out) and same(got, kernels.quantize_rows_fp8(y))
    gate_up = torch.cat((x, h), 1)
    assert same(kernels.silu_mul_fp8(gate_up), kernels.quantize_rows_fp8(kernels.silu_mul(gate_up)))


def test_a_bf16_decoder_layer_with_fused_fp8_producers_equals_quantizing_after(monkeypatch) -> None:
    from engine.model import layers
    from engine.model.attention import dense_attention
    from engine.model.minicpm import DecoderLayer

    torch.manual_seed(3)
    stack = ModelConfig.from_dict(tiny("voxcpm2")).lm
    layer = DecoderLayer(stack).eval().to("cuda", torch.bfloat16)
    layer.self_attn.fuse()
    layer.mlp.fuse()
    layer.self_attn.quantize_fp8()
    layer.mlp.quantize_fp8()
    monkeypatch.setattr(fp8, "MIN_ROWS", 8)
    x, branch = (torch.randn(1100, stack.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    attend = lambda i, q, k, v: dense_attention(q[None], k[None], v[None])[0]  # noqa: E731
    with torch.no_grad():
        with monkeypatch.context() as apart:
            apart.setattr(layers.RMSNorm, "_fuses_fp8", lambda *a: False)
            apart.setattr(kernels, "FP8_ROW_MAX", 0)
            want = [layer(x, b, None, attend, 0) for b in (None, branch)]
        got = [layer(x, b, None, attend, 0) for b in (None, branch)]
    for (x0, h0), (x1, h1) in zip(want, got, strict=True):
        assert torch.equal(x0, x1) and torch.equal(h0, h1)
