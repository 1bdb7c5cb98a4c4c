"""FP8 GEMMs (`engine.model.fp8`, the engine's opt-in `fp8_prefill` and `fp8_dit`): per-row quantization keeps
FP8's precision; the Triton quantizer and the producers that quantize as they write (norms, silu_mul) give the bits
of producing then quantizing, alone and in a whole layer; large GEMMs run in FP8 and small ones do not; only plain
linears get an FP8 copy; the LMs' prefill and the LocDiT's samples stay within FP8's error of the model's own; the
engine refuses what it cannot combine with and serves with either switch on.

CPU: `torch._scaled_mm` runs FP8 here too. The Triton kernels run in Triton's interpreter, with its FP8 cast replaced
by torch's (the interpreter's own drops the carry into the exponent); on the GPU, tests/gpu/test_fp8_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_model_oracle import caches, new_seq, prompt, run_lms, sample
from torch import nn

from engine.config import ModelConfig
from engine.errors import InvalidParameter
from engine.model import fp8, fusion
from engine.model.voxcpm import VoxCPMModel
from engine.model_configs import tiny
from tests.conftest import interpreted

E4M3 = torch.finfo(torch.float8_e4m3fn)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def three_prompts() -> list:
    """Zero-shot, reference and continuation prompts in blocks of their own: one prefill batch."""
    return [new_seq(*prompt("voxcpm2", mode, seed), first_block=16 * i)
            for i, (mode, seed) in enumerate((("zero-shot", 0), ("reference", 1), ("continuation", 2)))]


def prefill(model: VoxCPMModel, seqs: list, kv: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both LMs' hidden states at the end of each prompt, from one flat prefill of `seqs`."""
    return run_lms(model, caches(model) if kv is None else kv, seqs, [(0, len(s.tokens)) for s in seqs])


def test_rows_quantize_to_their_own_scale_within_fp8_precision() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 96, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 1.0, 0.0])[:, None]
    q, scale = fp8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1) and scale.dtype == torch.float32
    deq = q.float() * scale
    for r in range(5):  # each row's largest magnitude lands on e4m3's largest value; the row within its rounding
        assert q[r].float().abs().max() == E4M3.max
        assert rel(deq[r], x[r]) < 0.04
    assert torch.all(q[5].float() == 0) and torch.isfinite(scale[5]).all()  # an all-zero row stays zero


@pytest.fixture
def interpreted_kernels(monkeypatch):
    """engine.kernels under Triton's interpreter, with its float -> float8_e4m3fn cast made right: Triton 3.6's
    interpreter rounds without carrying into the exponent (125.9 / 448-scaled lands on 64, not 128), which the GPU's
    `cvt.rn.satfinite` does not do. The stand-in is torch's CPU cast (round to nearest even), the GPU's rounding."""
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    real = interpreter._convert_float
    sources = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16}

    def convert(data, src, dst, rounding):
        if dst != tl.float8e4nv or src not in sources:
            return real(data, src, dst, rounding)
        return torch.from_numpy(np.ascontiguousarray(data)).view(sources[src]).to(torch.float8_e4m3fn) \
            .view(torch.uint8).numpy()

    monkeypatch.setattr(interpreter, "_convert_float", convert)
    with interpreted("engine.kernels") as (kernels,):
        yield kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [96, 2048, 12288])  # one pass from registers; 12,288: two passes
def test_triton_row_quantizer_gives_the_eager_bits(interpreted_kernels, width: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(4, width, generator=g) * 3).to(dtype)
    x[0] = 0
    x[-1, ::7] *= 1e3
    q, scale = interpreted_kernels.quantize_rows_fp8(x)
    want_q, want_scale = fp8.quantize_rows_eager(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))



def same_fp8(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 2048])
def test_fused_fp8_producers_give_the_bits_of_producing_then_quantizing(interpreted_kernels, width: int,
                                                                        dtype: torch.dtype) -> None:
    """The norms and silu_mul with FP8 output: exactly their plain output quantized (their plain output is eager's
    bit for bit, tests/test_kernels_interpret.py)."""
    k = interpreted_kernels
    g = torch.Generator().manual_seed(width)
    x, h = ((torch.randn(5, width, generator=g) * 2).to(dtype) for _ in range(2))
    weight = (1 + torch.randn(width, generator=g) / 4).to(dtype)
    assert same_fp8(k.rms_norm_fp8(x, weight, 1e-5), fp8.quantize_rows_eager(k.rms_norm(x, weight, 1e-5)))
    for scale in (None, 0.26):
        out, y = k.add_rms_norm(x, h, weight, 1e-5, scale)
        got_out, *got = k.add_rms_norm_fp8(x, h, weight, 1e-5, scale)
        assert torch.equal(got_out, out) and same_fp8(got, fp8.quantize_rows_eager(y))
    gate_up = (torch.randn(5, 2 * width, generator=g) * 2).to(dtype)
    assert same_fp8(k.silu_mul_fp8(gate_up), fp8.quantize_rows_eager(k.silu_mul(gate_up)))


def test_fused_fp8_producers_refuse_what_they_cannot_match(interpreted_kernels) -> None:
    k = interpreted_kernels
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="weight in x's dtype"):
        k.rms_norm_fp8(x.bfloat16(), torch.ones(64), 1e-5)  # eager would promote the norm to fp32
    with pytest.raises(ValueError, match="x, h of one shape and dtype"):
        k.add_rms_norm_fp8(x, x[:2], torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="silu_mul_fp8 needs"):
        k.silu_mul_fp8(torch.randn(3, 2 * (k.FP8_ROW_MAX + 16)))


@pytest.mark.parametrize("lead", [(12,), (2, 6)])  # the LMs' flat rows, the LocDiT's [B, L] sequences
def test_a_decoder_layer_with_fused_fp8_producers_equals_quantizing_after(interpreted_kernels, monkeypatch,
                                                                          lead: tuple[int, ...]) -> None:
    """One layer in FP8 down the CUDA path (its kernels in the interpreter): with the norms and silu_mul handing
    their GEMMs FP8 rows, the bits of the same layer producing each GEMM's input and then quantizing it."""
    from engine.model import layers
    from engine.model.attention import dense_attention
    from engine.model.minicpm import DecoderLayer

    torch.manual_seed(3)
    stack = ModelConfig.from_dict(tiny("voxcpm2")).lm
    layer = DecoderLayer(stack).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    layer.self_attn.fuse()
    layer.mlp.fuse()
    layer.self_attn.quantize_fp8()
    layer.mlp.quantize_fp8()
    monkeypatch.setattr(fp8, "MIN_ROWS", 8)
    x, branch = torch.randn(*lead, stack.hidden_size), torch.randn(*lead, stack.hidden_size)
    if len(lead) == 1:  # the flat rows as one sequence
        attend = lambda i, q, k, v: dense_attention(q[None], k[None], v[None])[0]  # noqa: E731
    else:
        attend = lambda i, q, k, v: dense_attention(q, k, v)  # noqa: E731
    fused_calls = []
    for name in ("rms_norm_fp8", "add_rms_norm_fp8", "silu_mul_fp8"):
        real = getattr(interpreted_kernels, name)
        monkeypatch.setattr(interpreted_kernels, name,
                            lambda *a, _real=real, _name=name, **k: fused_calls.append(_name) or _real(*a, **k))
    monkeypatch.setattr(fusion, "fused", lambda t: True)  # the CUDA path's kernels (interpreted)
    with torch.no_grad():
        with monkeypatch.context() as apart:  # first each producer, then the quantizer
            apart.setattr(layers.RMSNorm, "_fuses_fp8", lambda *a: False)
            apart.setattr(interpreted_kernels, "FP8_ROW_MAX", 0)
            want = [layer(x, b, None, attend, 0) for b in (None, branch)]
        assert fused_calls == []
        got = [layer(x, b, None, attend, 0) for b in (None, branch)]
    assert sorted(fused_calls) == ["add_rms_norm_fp8", "add_rms_norm_fp8", "add_rms_norm_fp8", "rms_norm_fp8",
                                   "silu_mul_fp8", "silu_mul_fp8"]
    for (x0, h0), (x1, h1) in zip(want, got, strict=True):
        assert torch.equal(x0, x1) and torch.equal(h0, h1)


def test_large_gemms_run_in_fp8_close_to_full_precision_and_small_ones_do_not(monkeypatch) -> None:
    monkeypatch.setattr(fp8, "MIN_ROWS", 8)
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=g) / 8)
    w = fp8.quantized((linear,))
    assert w is not None and w.weight.dtype == torch.float8_e4m3fn and w.scale.shape == (1, 48)
    small, large = torch.randn(7, 64, generator=g), torch.randn(2, 4, 64, generator=g)
    assert fp8.linear(small, w) is None  # the caller's own GEMM
    y = fp8.linear(large, w)
    want = linear(large)
    assert y.shape == want.shape and y.dtype == large.dtype
    assert 1e-3 < rel(y, want) < 0.05  # FP8's rounding: present, and small
    assert rel(fp8.linear(large.bfloat16(), w), want) < 0.05


def test_only_plain_linears_of_fp8_widths_get_an_fp8_copy() -> None:
    plain, other = nn.Linear(32, 16, bias=False), nn.Linear(32, 32, bias=False)
    fused = fp8.quantized((plain, other))
    assert fused is not None and fused.weight.shape == (48, 32)  # side by side, as the fused GEMMs run
    assert fp8.quantized((nn.Linear(32, 16),)) is None  # a bias
    assert fp8.quantized((nn.Linear(32, 24, bias=False),)) is None  # a width _scaled_mm does not take
    hooked = nn.Linear(32, 16, bias=False)
    hooked.register_forward_hook(lambda *_: None)  # as a LoRA or tensor-parallel wrapper hooks its linear
    assert fp8.quantized((plain, hooked)) is None


def test_the_lms_prefill_in_fp8_stays_within_fp8_error_of_the_model(monkeypatch) -> None:
    """A batch of prompts through both LMs, their GEMMs in FP8, against the same model without: every FP8 copy used
    (each LM layer's four GEMMs), the hidden states within FP8's error, and decode rows below MIN_ROWS untouched."""
    torch.manual_seed(0)
    model = VoxCPMModel(ModelConfig.from_dict(tiny("voxcpm2"))).eval()
    with torch.no_grad():
        want = prefill(model, three_prompts())
        model.quantize_lms_fp8()
        layers = [*model.base_lm.layers, *model.residual_lm.layers]
        assert all(x is not None for layer in layers for x in (layer.self_attn.qkv8, layer.self_attn.o8,
                                                                layer.mlp.gate_up8, layer.mlp.down8))
        assert model.feat_decoder.estimator.decoder.layers[0].mlp.down8 is None  # the LocDiT stays as it is
        calls = []
        real = torch._scaled_mm
        monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
        monkeypatch.setattr(fp8, "MIN_ROWS", 16)
        batch, kv = three_prompts(), caches(model)
        rows = sum(len(s.tokens) for s in batch)
        got = prefill(model, batch, kv)
        assert len(calls) == 4 * len(layers) and set(calls) == {rows}
        for g, w in zip(got, want, strict=True):
            assert 1e-4 < rel(g, w) < 0.1
        calls.clear()
        run_lms(model, kv, batch, [(-1, -1)] * len(batch))  # decode: 3 rows, below MIN_ROWS
        assert calls == []


def test_the_locdit_in_fp8_samples_within_fp8_error_of_the_model(monkeypatch) -> None:
    """One patch for three prompts with the LocDiT's GEMMs in FP8 (every CFG evaluation, all four GEMMs of each
    layer on the [B, L] rows), against the same model without: within FP8's error; below MIN_ROWS, untouched."""
    torch.manual_seed(1)
    model = VoxCPMModel(ModelConfig.from_dict(tiny("voxcpm2"))).eval()
    noises = [torch.randn(64, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    timesteps, dit = 4, model.feat_decoder.estimator.decoder

    def one_patch() -> torch.Tensor:
        seqs = three_prompts()
        with torch.no_grad():
            lm_h, res_h = prefill(model, seqs)
            sample(model, seqs, lm_h, res_h, noises, timesteps, [2.0, 2.0, 1.5])
        return torch.stack([s.patches[-1] for s in seqs])

    want = one_patch()
    model.quantize_dit_fp8()
    assert all(layer.mlp.down8 is not None for layer in dit.layers)
    assert model.base_lm.layers[0].mlp.down8 is None  # the LMs stay as they are
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    assert torch.equal(one_patch(), want) and calls == []  # below MIN_ROWS
    monkeypatch.setattr(fp8, "MIN_ROWS", 8)
    got = one_patch()
    assert len(calls) == 4 * len(dit.layers) * (timesteps - 1)  # every layer's GEMMs in each of the solver's steps
    assert 1e-4 < rel(got, want) < 0.1


@pytest.mark.asyncio
async def test_engine_refuses_fp8_with_lora_slots_or_tensor_parallelism(tiny_v2_dir) -> None:
    from engine import Engine

    with pytest.raises(InvalidParameter, match="fp8_prefill and fp8_dit do not combine with LoRA"):
        Engine(str(tiny_v2_dir), fp8_prefill=True, max_loras=2)
    with pytest.raises(InvalidParameter, match="do not combine with tensor parallelism"):
        Engine(str(tiny_v2_dir), fp8_dit=True, devices=["cpu", "cpu"], tensor_parallel_size=2)


@pytest.mark.asyncio
async def test_engine_serves_with_fp8_gemms(tiny_v2_dir, monkeypatch) -> None:
    """The real engine (its own worker process) with FP8 from 8 rows on, in the LMs' prefill or in the LocDiT: the
    same request as without (which gives the same bits twice), in the same number of samples, finite, and not
    bit-equal (those GEMMs ran in FP8)."""
    from engine import Engine

    monkeypatch.setenv("VOXGATE_FP8_MIN_ROWS", "8")  # the worker process reads it when it imports the model
    audio = []
    for switch in ({}, {}, {"fp8_prefill": True}, {"fp8_dit": True}):
        engine = Engine(str(tiny_v2_dir), max_num_seqs=2, **switch)
        try:
            await engine.wait_for_ready()
            audio.append(np.concatenate([c.audio async for c in engine.generate(
                "A prompt long enough for eight rows.", seed=7, min_length=3, max_length=3)]))
        finally:
            await engine.stop()
    assert np.array_equal(audio[0], audio[1])
    for fp8_audio in audio[2:]:
        assert fp8_audio.shape == audio[0].shape and np.isfinite(fp8_audio).all() and np.abs(fp8_audio).max() > 0
        assert not np.array_equal(fp8_audio, audio[0])
