"""The fused AudioVAE residual unit (engine.model.vae_triton) on CPU under TRITON_INTERPRET=1 (set by conftest.py).

The reference is the eager modules as the CUDA path runs them: each layer in fp32 math, its output rounded to the
activation dtype (the fused snake kernel and cuDNN's fp32-accumulating conv do the same). Shapes are tiny: the
interpreter runs each program in numpy.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine.config import AudioVAEConfig
from engine.model import audio_vae, vae_triton
from engine.model.audio_vae import AudioVAE, ResidualUnit

# The interpreter itself trips a numpy deprecation on every scalar index; it says nothing about our kernels.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # bf16: a rounding can land one ulp apart


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def random_unit(channels: int, dilation: int, dtype: torch.dtype, seed: int) -> ResidualUnit:
    torch.manual_seed(seed)
    unit = ResidualUnit(channels, dilation)
    with torch.no_grad():
        for name, p in unit.named_parameters():
            p.uniform_(0.5, 2.0) if name.endswith("alpha") else p.normal_(0.0, 0.5)
    unit.block[1].slot = 0  # the history's index in the states list
    return unit.to(dtype)


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t rounded to dtype as the kernel rounds it here: Triton's interpreter truncates fp32 -> bf16 (on the GPU it
    rounds to nearest even, as torch does), so the reference truncates too and stays within an ulp of the kernel."""
    if dtype != torch.bfloat16:
        return t.to(dtype)
    return (t.float().view(torch.int32) & -(1 << 16)).view(torch.float32).to(dtype)


def eager_three(unit: ResidualUnit, x: torch.Tensor, history: torch.Tensor | None):
    """Snake, dilated depthwise CausalConv1d, Snake of `unit`; (z, the conv's new history)."""
    ref = copy.deepcopy(unit).float()
    states = None if history is None else [history.float()]
    y = x.float()
    for layer in ref.block[:3]:
        y = rounded(layer(y, states), x.dtype).float()
    return y.to(x.dtype), None if states is None else states[0].to(x.dtype)


def launch(unit: ResidualUnit, x: torch.Tensor, history: torch.Tensor | None, block_t: int | None) -> torch.Tensor:
    snake1, conv, snake2, _ = unit.block
    return vae_triton.snake_dwconv_snake(x, snake1.alpha, conv.weight, conv.bias, snake2.alpha, conv.dilation[0],
                                         history, block_t=block_t)


@pytest.mark.parametrize("streaming", [False, True], ids=["offline", "streaming"])
@pytest.mark.parametrize("dilation", [1, 3, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_eager_three_layers(dtype, dilation, streaming):
    unit = random_unit(3, dilation, dtype, seed=dilation)
    context = 6 * dilation
    halo = max(16, 1 << (context - 1).bit_length())  # as the launcher pads the context
    gen = torch.Generator().manual_seed(10 * dilation + streaming)
    # (batch, chunk lengths, block_t): chunks shorter than the history; one program per row; several programs per
    # row (block_t forced small, so the new history is staged)
    for batch, lengths, block_t in [(2, [5, 3], None), (3, [40, 70], None), (2, [150, 9], 2 * halo)]:
        history = torch.randn(batch, 3, context, generator=gen).to(dtype) if streaming else None
        ref_history = None if history is None else history.clone()
        for length in lengths:  # consecutive chunks: the second reads the history the first left
            x = (2 * torch.randn(batch, 3, length, generator=gen)).to(dtype)
            want, ref_history = eager_three(unit, x, ref_history)
            got = launch(unit, x, history, block_t)
            assert got.dtype == dtype and got.shape == x.shape
            assert rel_err(got, want) < TOLERANCE[dtype], (batch, length, block_t)
            if streaming:
                assert rel_err(history, ref_history) < TOLERANCE[dtype], (batch, length, block_t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_residual_unit_matches_eager(monkeypatch, dtype):
    """The whole unit: the fused kernel (also writing x + pointwise bias) and the in-place GEMM for W @ z."""
    unit = random_unit(5, 3, dtype, seed=1)
    snake1, conv, snake2, pointwise = unit.block
    gen = torch.Generator().manual_seed(1)
    for length, block_t in [(33, None), (100, 64)]:  # one program per row; three (the history staged)
        x = torch.randn(2, 5, length, generator=gen).to(dtype)
        history = torch.randn(2, 5, 18, generator=gen).to(dtype)
        z, ref_history = eager_three(unit, x, history.clone())
        want = x.float() + torch.nn.functional.conv1d(z.float(), pointwise.weight.float(), pointwise.bias.float())
        x_before = x.clone()
        got = vae_triton.residual_unit(x, snake1.alpha, conv.weight, conv.bias, snake2.alpha, pointwise.weight,
                                       pointwise.bias, 3, history, block_t=block_t)
        assert got.dtype == dtype and rel_err(got, want) < TOLERANCE[dtype], length
        assert rel_err(history, ref_history) < TOLERANCE[dtype] and torch.equal(x, x_before)

    monkeypatch.setattr(audio_vae, "FUSED_DECODER", True)  # ResidualUnit.forward takes the same path
    with torch.no_grad():
        assert torch.equal(unit(x, [history.clone()]), vae_triton.residual_unit(
            x, snake1.alpha, conv.weight, conv.bias, snake2.alpha, pointwise.weight, pointwise.bias, 3,
            history.clone()))


@pytest.mark.parametrize("streaming", [False, True], ids=["offline", "streaming"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_in_bias_on_a_strided_x_matches_eager(dtype, streaming):
    """in_bias: the unit on x + in_bias, with x a view of rows longer than T (the transposed conv's y[..., :n]) read
    in place: equal to the kernel on the contiguous biased x, and to the eager unit on it; the same history."""
    unit = random_unit(5, 3, dtype, seed=2)
    snake1, conv, snake2, pointwise = unit.block
    gen = torch.Generator().manual_seed(2 + streaming)
    bias = torch.randn(5, generator=gen).to(dtype)
    history = torch.randn(2, 5, 18, generator=gen).to(dtype) if streaming else None
    ref_history = None if history is None else history.clone()
    # chunks shorter than the history; one program per row; several (the history staged)
    for length, block_t in [(7, None), (33, None), (100, 64)]:
        y = (2 * torch.randn(2, 5, length + 4, generator=gen)).to(dtype)
        x = y[..., :length]
        assert not x.is_contiguous()
        biased = rounded(x.float() + bias.float()[:, None], dtype)  # as the kernel adds it (and as eager's x + bias)
        plain_history = None if history is None else history.clone()
        plain = vae_triton.residual_unit(biased, snake1.alpha, conv.weight, conv.bias, snake2.alpha, pointwise.weight,
                                         pointwise.bias, 3, plain_history, block_t=block_t)
        z, ref_history = eager_three(unit, biased, ref_history)
        want = biased.float() + torch.nn.functional.conv1d(z.float(), pointwise.weight.float(),
                                                           pointwise.bias.float())
        y_before = y.clone()
        got = vae_triton.residual_unit(x, snake1.alpha, conv.weight, conv.bias, snake2.alpha, pointwise.weight,
                                       pointwise.bias, 3, history, in_bias=bias, block_t=block_t)
        assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
        assert torch.equal(got, plain), length  # the same kernel on the same values
        assert rel_err(got, want) < TOLERANCE[dtype], length
        assert torch.equal(y, y_before)  # read in place, nothing written
        if streaming:
            assert torch.equal(history, plain_history), length  # snake1 outputs of the biased x
            assert rel_err(history, ref_history) < TOLERANCE[dtype], length


def random_block(cin: int, cout: int, stride: int) -> audio_vae.DecoderBlock:
    torch.manual_seed(stride)
    block = audio_vae.DecoderBlock(cin, cout, stride).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.uniform_(0.5, 2.0) if name.endswith("alpha") else p.normal_(0.0, 0.5)
    stateful = [m for m in block.modules() if isinstance(m, audio_vae.CausalConvTranspose1d)
                or (isinstance(m, audio_vae.CausalConv1d) and m.context)]
    for slot, module in enumerate(stateful):
        module.slot = slot
    return block


@pytest.mark.parametrize("frames", [3, 30], ids=["gemm-upsampling", "conv-upsampling"])
def test_decoder_block_on_the_fused_path_equals_eager(monkeypatch, frames):
    """A DecoderBlock on the fused path hands the upsampling's unbiased view and bias to its first residual unit
    (no separate bias pass): offline and streaming (two chunks) equal the eager block, the same state too."""
    block = random_block(6, 4, 5)
    states_shapes = [(4, 5)] + [(4, 6 * d) for d in (1, 3, 9)]  # the upsampling's overlap, the three histories
    x = torch.randn(2, 6, frames)
    with torch.no_grad():
        want = block(x)  # eager (FUSED_DECODER None: False on CPU)
        eager_states = [torch.randn(2, c, n) for c, n in states_shapes]
        fused_states = [s.clone() for s in eager_states]
        want_stream = [block(part, eager_states) for part in (x[..., :2], x[..., 2:])]

        monkeypatch.setattr(audio_vae, "FUSED_DECODER", True)
        monkeypatch.setattr(vae_triton, "MAX_BLOCK_T", 128)  # 150 samples: two programs per row
        calls, residual_unit = [], vae_triton.residual_unit

        def spy(x, *args, **kwargs):
            calls.append((x, kwargs))
            return residual_unit(x, *args, **kwargs)

        monkeypatch.setattr(vae_triton, "residual_unit", spy)
        got = block(x)
        assert [k["in_bias"] is block.block[1].bias for _, k in calls] == [True, False, False]
        assert not calls[0][0].is_contiguous()  # the view of the untrimmed output, no copy
        got_stream = [block(part, fused_states) for part in (x[..., :2], x[..., 2:])]
    assert rel_err(got, want) < 1e-5
    assert rel_err(torch.cat(got_stream, -1), torch.cat(want_stream, -1)) < 1e-5
    for fused_state, eager_state in zip(fused_states, eager_states, strict=True):
        assert rel_err(fused_state, eager_state) < 1e-5


def small_vae() -> AudioVAE:
    """A VoxCPM2-style VAE with two decoder blocks (16 -> 8 -> 4 channels, hop 20): every residual unit runs."""
    torch.manual_seed(3)
    vae = AudioVAE(AudioVAEConfig(version=2, encoder_dim=4, encoder_rates=(4, 5), latent_dim=8, decoder_dim=16,
                                  decoder_rates=(4, 5), sr_bin_boundaries=(20000, 30000, 40000),
                                  sample_rate=16000, out_sample_rate=48000)).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("alpha"):
                p.uniform_(0.5, 2.0)
            elif "scale_embed" in name:  # the sample-rate conditions (ones and zeros at init) really act
                p.uniform_(0.5, 1.5)
            elif "bias_embed" in name:
                p.normal_(std=0.1)
    return vae


def test_decode_stream_on_the_fused_path_equals_eager_decode(monkeypatch):
    vae = small_vae()
    latents = torch.randn(2, 8, 7)
    want = vae.decode(latents)  # eager (FUSED_DECODER None follows fused(x): False on CPU)
    monkeypatch.setattr(audio_vae, "FUSED_DECODER", True)
    monkeypatch.setattr(vae_triton, "MAX_BLOCK_T", 128)  # the 80-sample chunk spans two programs per row
    state = vae.stream_state(2)
    chunks, start = [], 0
    for size in (1, 4, 2):  # 20 / 80 / 40 samples at 48 kHz; the first is shorter than the dilation-9 history
        chunks.append(vae.decode_stream(latents[..., start:start + size], state))
        start += size
    assert want.abs().max() > 0.05
    assert rel_err(torch.cat(chunks, dim=-1), want) < 1e-5
    assert rel_err(vae.decode(latents), want) < 1e-5  # offline on the fused path too


def test_bad_shapes_are_value_errors():
    unit = random_unit(3, 3, torch.float32, seed=4)
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="history"):
        launch(unit, x, torch.zeros(2, 3, 17), None)
    with pytest.raises(ValueError, match="block_t"):
        launch(unit, x, None, 32)  # not above the 32-sample halo of dilation 3
    with pytest.raises(ValueError, match=r"\[B, C, T\]"):
        launch(unit, x[..., :0], None, None)
    with pytest.raises(ValueError, match="pw_weight"):
        snake1, conv, snake2, _ = unit.block
        vae_triton.residual_unit(x, snake1.alpha, conv.weight, conv.bias, snake2.alpha, torch.zeros(3, 3, 2),
                                 torch.zeros(3), 3)
