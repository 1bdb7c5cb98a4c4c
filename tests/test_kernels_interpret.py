"""The Triton kernels on CPU under TRITON_INTERPRET=1: paged attention == TorchAttention; fused Snake, RMSNorm,
residual add + RMSNorm, CFG-Zero* + Euler, SiLU*mul and RoPE == their eager torch formulas; a MiniCPM stack on the
fused path == the eager path; RoPE fused into the short attention and into the paged K/V store == RoPE first, bit for
bit. Also on CPU: the fused q/k/v and gate/up projections (`fuse_projections`) change no
output and no state_dict, and step aside for LoRA; the eager stack still runs the official op order bit for bit.

Needs `triton` installed (the test extras pin it); without it these tests fail rather than skip.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import ModelConfig
from engine.model import fusion, minicpm
from engine.model.attention import AttentionMetadata, TorchAttention, dense_attention, make_attention_backend
from engine.model.audio_vae import Snake
from engine.model.layers import LongRoPE, RMSNorm, apply_rope
from engine.model.lora import attach_lora
from engine.model.minicpm import MiniCPM
from engine.model.voxcpm import VoxCPMModel
from engine.model_configs import tiny
from tests.conftest import interpreted

# The interpreter itself trips a numpy deprecation on every scalar index; it says nothing about our kernels.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


@pytest.fixture(scope="module")
def kernels():
    """The kernel modules (attention_triton, kernels), (re)imported with the interpreter on; engine.kernels first, as
    attention_triton's kernels call its RoPE helpers."""
    with interpreted("engine.kernels", "engine.model.attention_triton") as (fused, attention_triton):
        yield attention_triton, fused


def paged_case(query_lens: list[int], cached_lens: list[int], page: int, q_heads: int, kv_heads: int,
               head_dim: int, dtype: torch.dtype, gen: torch.Generator, device: str = "cpu"):
    """Random q/k/v and a random paged cache whose blocks are handed out in shuffled order (gen on `device`)."""
    need = [-(-(q + c) // page) for q, c in zip(query_lens, cached_lens, strict=True)]
    num_blocks = sum(need) + 2
    order = torch.randperm(num_blocks, generator=gen, device=device).tolist()
    tables, used = [], 0
    for count in need:
        tables.append(order[used:used + count])
        used += count
    meta = AttentionMetadata.build(query_lens, cached_lens, tables, page, device)
    n = sum(query_lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    tensors = (rand(n, q_heads, head_dim), rand(n, kv_heads, head_dim), rand(n, kv_heads, head_dim),
               rand(num_blocks, page, kv_heads, head_dim), rand(num_blocks, page, kv_heads, head_dim))
    return tensors, meta


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


CASES = {  # name: (query_lens, cached_lens)
    "decode": ([1, 1, 1, 1], [0, 6, 37, 90]),
    "prefill": ([5, 23, 1], [0, 0, 0]),
    "chunked_prefill": ([17, 9], [30, 4]),
    "mixed": ([1, 12, 0, 1, 3], [50, 0, 7, 3, 20]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("head_dim", "q_heads", "page", "dtype"), [
    (16, 4, 4, torch.float32), (64, 16, 16, torch.float16), (64, 16, 8, torch.float32), (24, 6, 4, torch.float16)])
def test_triton_attention_matches_torch(kernels, case, head_dim, q_heads, page, dtype):
    attention_triton, _ = kernels
    gen = torch.Generator().manual_seed(sum(map(ord, case)) * 1000 + head_dim * 10 + page)
    (q, k, v, k_cache, v_cache), meta = paged_case(*CASES[case], page, q_heads, 2, head_dim, dtype, gen)
    ref_k, ref_v = k_cache.double(), v_cache.double()
    ref = TorchAttention()(q.double(), k.double(), v.double(), ref_k, ref_v, meta)

    out = attention_triton.TritonAttention(block_n=16)(q, k, v, k_cache, v_cache, meta)

    assert out.dtype == dtype and out.shape == q.shape
    assert relative_error(out, ref) < (1e-5 if dtype == torch.float32 else 3e-3)
    assert torch.equal(k_cache.double(), ref_k) and torch.equal(v_cache.double(), ref_v)  # new K/V stored


@pytest.mark.parametrize("rows", [128, 256])
def test_large_query_tiles_match_torch(kernels, rows):
    """Prefill tiles of 16 / 32 tokens x 8 query heads (what `rows_for` picks for a burst of prompts), over chunks
    shorter and longer than a tile, with and without cached keys."""
    attention_triton, _ = kernels
    gen = torch.Generator().manual_seed(rows)
    (q, k, v, k_cache, v_cache), meta = paged_case([40, 7, 33, 1], [0, 0, 9, 20], 8, 16, 2, 16, torch.float32, gen)
    ref = TorchAttention()(q.double(), k.double(), v.double(), k_cache.double(), v_cache.double(), meta)

    out = attention_triton.TritonAttention(block_n=16, rows_per_program=rows)(q, k, v, k_cache, v_cache, meta)

    assert relative_error(out, ref) < 1e-5


def test_query_tile_follows_the_prompts_length_and_the_sms(kernels):
    """Large tiles for a burst of prompts; the small one when decode rows dominate (a tile computes all of its rows)
    or when larger tiles would leave SMs without a program; a set rows_per_program always wins."""
    attention_triton, _ = kernels
    backend, cpu = attention_triton.TritonAttention(), torch.device("cpu")

    def meta(query_lens):
        return AttentionMetadata.build(query_lens, [0] * len(query_lens), [[0] * 8] * len(query_lens), 16, "cpu")

    burst = meta([114] * 64)
    assert backend.rows_for(64 * 114, 64, 2, 8, burst, cpu) == 256
    joining = meta([114] * 16 + [1] * 400)  # prompts joining 400 speaking streams
    assert backend.rows_for(16 * 114 + 400, 416, 2, 8, joining, cpu) == 64
    assert backend.rows_for(114, 1, 2, 8, meta([114]), cpu) == 64  # one prompt: 8 programs at most
    assert attention_triton.TritonAttention(rows_per_program=128).rows_for(114, 1, 2, 8, meta([114]), cpu) == 128


@pytest.mark.parametrize("splits", [2, 3, 16])
def test_split_kv_decode_matches_torch(kernels, splits):
    """Flash-decoding: KV ranges split across programs (some splits empty for short sequences), merged by LSE."""
    attention_triton, _ = kernels
    gen = torch.Generator().manual_seed(splits)
    (q, k, v, k_cache, v_cache), meta = paged_case([1, 1, 1], [0, 40, 150], 8, 16, 2, 64, torch.float16, gen)
    ref = TorchAttention()(q.double(), k.double(), v.double(), k_cache.double(), v_cache.double(), meta)

    out = attention_triton.TritonAttention(num_splits=splits, block_n=16)(q, k, v, k_cache, v_cache, meta)

    assert relative_error(out, ref) < 3e-3


def test_padded_graph_bucket(kernels):
    """A CUDA-graph bucket pads the batch with empty sequences and over-states max_seqlen_q/k; the result holds."""
    attention_triton, _ = kernels
    gen = torch.Generator().manual_seed(7)
    (q, k, v, k_cache, v_cache), meta = paged_case([1, 1, 0, 0], [9, 33, 0, 0], 8, 4, 2, 16, torch.float32, gen)
    ref = TorchAttention()(q.double(), k.double(), v.double(), k_cache.double(), v_cache.double(), meta)
    meta.max_seqlen_k = 512

    out = attention_triton.TritonAttention(num_splits=4, block_n=16)(q, k, v, k_cache, v_cache, meta)

    assert relative_error(out, ref) < 1e-5


def test_padded_prefill_graph_bucket(kernels):
    """A large LM graph bucket: prompts beside many empty sequences, max_seqlen_q over-stated to the bucket's tokens.
    The programs follow the query blocks of the whole batch (each finds its sequence), so the result holds and empty
    sequences cost no programs."""
    attention_triton, _ = kernels
    gen = torch.Generator().manual_seed(11)
    query_lens = [23, 0, 0, 9, 0, 17] + [0] * 40 + [5]
    (q, k, v, k_cache, v_cache), meta = paged_case(query_lens, [0, 0, 0, 4, 0, 0] + [0] * 40 + [2], 8, 16, 2, 16,
                                                   torch.float32, gen)
    ref = TorchAttention()(q.double(), k.double(), v.double(), k_cache.double(), v_cache.double(), meta)
    meta.max_seqlen_q = meta.max_seqlen_k = 256

    out = attention_triton.TritonAttention(block_n=16, rows_per_program=64)(q, k, v, k_cache, v_cache, meta)

    assert relative_error(out, ref) < 1e-5


def test_bad_split_count_is_a_value_error(kernels):
    with pytest.raises(ValueError, match="num_splits"):
        kernels[0].TritonAttention(num_splits=0)


def test_cpu_selects_torch_attention():
    assert isinstance(make_attention_backend("cpu"), TorchAttention)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_snake_matches_torch(kernels, dtype):
    _, fused = kernels
    gen = torch.Generator().manual_seed(3)
    module = Snake(5)
    with torch.no_grad():
        module.alpha.copy_(torch.rand(1, 5, 1, generator=gen) * 2 + 0.05)
    x = (torch.randn(3, 5, 37, generator=gen) * 3).to(dtype)

    y = fused.snake(x, module.alpha.detach())

    with torch.no_grad():
        ref = module(x.double())  # the eager formula (CPU path of Snake.forward), in float64
    assert y.dtype == dtype and y.shape == x.shape
    assert relative_error(y, ref) < (1e-6 if dtype == torch.float32 else 1e-3)


def test_fused_snake_applies_a_channel_affine_first(kernels):
    """snake(x * scale + shift) in one pass (a VAE sample-rate condition folded into the Snake after it)."""
    _, fused = kernels
    gen = torch.Generator().manual_seed(4)
    module = Snake(5)
    with torch.no_grad():
        module.alpha.copy_(torch.rand(1, 5, 1, generator=gen) * 2 + 0.05)
    x = torch.randn(3, 5, 37, generator=gen) * 3
    scale, shift = torch.rand(5, generator=gen) + 0.5, torch.randn(5, generator=gen)

    y = fused.snake(x, module.alpha.detach(), (scale, shift))

    with torch.no_grad():
        ref = module(x.double() * scale.double()[:, None] + shift.double()[:, None])
        plain = module(x.double())
    assert relative_error(y, ref) < 1e-6
    assert relative_error(y, plain) > 0.1  # the affine was applied
    with pytest.raises(ValueError, match="affine"):
        fused.snake(x, module.alpha.detach(), (scale[:4], shift))



@pytest.mark.parametrize(("dtype", "weight_dtype"), [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                     (torch.float16, torch.float32)])
def test_fused_rms_norm_matches_torch(kernels, dtype, weight_dtype):
    gen = torch.Generator().manual_seed(4)
    module = RMSNorm(48, 1e-5).to(weight_dtype)
    with torch.no_grad():
        module.weight.copy_(torch.rand(48, generator=gen) + 0.5)
    x = (torch.randn(2, 5, 48, generator=gen) * 4).to(dtype)

    y = kernels[1].rms_norm(x, module.weight.detach(), 1e-5)

    with torch.no_grad():
        ref = module(x)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    assert relative_error(y, ref.double()) < (1e-6 if ref.dtype == torch.float32 else 1e-3)


def eager_add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                       scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager ops add_rms_norm replaces, written out (RMSNorm.forward's eager branch, whatever the device)."""
    x = x + (h if scale is None else h * scale)
    variance = x.float().pow(2).mean(dim=-1, keepdim=True)
    return x, (x * torch.rsqrt(variance + eps)).to(x.dtype) * weight


@pytest.mark.parametrize(("dtype", "weight_dtype"), [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                     (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("scale", [None, 0.2645751311])  # muP: scale_depth 1.4 / sqrt(28 layers)
def test_fused_add_rms_norm_matches_torch(kernels, dtype, weight_dtype, scale):
    """Strided rows (slices of wider tensors). The residual equals eager's bit for bit in fp32 and fp16; the
    interpreter truncates fp32 -> bf16 casts (the GPU rounds to nearest even, as torch does), so bf16 is only close
    here and checked exactly in tests/gpu/test_kernels_gpu.py."""
    gen = torch.Generator().manual_seed(10)
    weight = (torch.rand(48, generator=gen) + 0.5).to(weight_dtype)
    x = (torch.randn(2, 5, 64, generator=gen) * 4).to(dtype)[..., :48]
    h = (torch.randn(2, 5, 64, generator=gen) * 4).to(dtype)[..., 16:]
    x_before = x.clone()

    x_new, y = kernels[1].add_rms_norm(x, h, weight, 1e-5, scale)

    ref_x, ref_y = eager_add_rms_norm(x, h, weight, 1e-5, scale)
    assert torch.equal(x, x_before)  # the input residual is not written
    assert x_new.dtype == dtype and x_new.shape == x.shape
    assert y.dtype == ref_y.dtype and y.shape == ref_y.shape
    if dtype == torch.bfloat16:
        assert relative_error(x_new, ref_x.double()) < 1e-2
        assert relative_error(y, ref_y.double()) < 1e-2
    else:
        assert torch.equal(x_new, ref_x)
        assert relative_error(y, ref_y.double()) < (1e-6 if ref_y.dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("v_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("per_row", [False, True])
def test_fused_cfg_zero_euler_matches_torch(kernels, v_dtype, per_row):
    gen = torch.Generator().manual_seed(5)
    b = 3
    # per row: each item's own Euler step, one of them 0 (a row whose solve has ended keeps its x bit for bit)
    dt = torch.tensor([0.0625, 0.0, 0.125]) if per_row else 0.0625
    x = torch.randn(b, 4, 64, generator=gen)
    before = x.clone()
    v = torch.randn(2 * b, 4, 64, generator=gen).to(v_dtype)
    w = torch.rand(b, generator=gen) * 3

    v_cond, v_uncond = v[:b].double(), v[b:].double()  # CFG-Zero*: project the conditional onto the unconditional
    scale = (v_cond * v_uncond).sum((1, 2), keepdim=True) / (v_uncond.pow(2).sum((1, 2), keepdim=True) + 1e-8)
    step = dt.double().view(b, 1, 1) if per_row else dt
    ref = x.double() - step * (v_uncond * scale + w.double().view(b, 1, 1) * (v_cond - v_uncond * scale))
    out = kernels[1].cfg_zero_euler_(x, v, w, dt)

    assert out is x
    assert relative_error(x, ref) < 1e-6
    if per_row:
        assert torch.equal(x[1], before[1])


def test_fused_kernels_reject_bad_shapes(kernels):
    fused = kernels[1]
    with pytest.raises(ValueError, match="snake needs"):
        fused.snake(torch.zeros(2, 3, 4), torch.ones(4))
    with pytest.raises(ValueError, match="rms_norm needs"):
        fused.rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="add_rms_norm needs"):
        fused.add_rms_norm(torch.zeros(2, 8), torch.zeros(1, 8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="would not stay"):
        fused.add_rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="cfg_zero_euler_ needs"):
        fused.cfg_zero_euler_(torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2), 0.1)
    with pytest.raises(ValueError, match="dt \\[B\\] fp32"):
        fused.cfg_zero_euler_(torch.zeros(2, 4), torch.zeros(4, 4), torch.ones(2), torch.ones(3))
    with pytest.raises(ValueError, match="fp32 state"):
        fused.cfg_zero_euler_(torch.zeros(2, 4, dtype=torch.float16), torch.zeros(4, 4), torch.ones(2), 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_silu_mul_matches_torch(kernels, dtype):
    gen = torch.Generator().manual_seed(6)
    gate_up = (torch.randn(3, 5, 2 * 40, generator=gen) * 3).to(dtype)

    y = kernels[1].silu_mul(gate_up)

    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate.float()).to(dtype).double() * up.double()  # eager rounds silu first
    assert y.dtype == dtype and y.shape == (3, 5, 40)
    assert relative_error(y, ref) < (1e-6 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dense", [False, True])
def test_fused_rope_matches_torch(kernels, dtype, dense):
    """In place on the q|k heads of a fused qkv output (a strided view), for the paged LMs (one table row per
    token) and the dense stacks (one [L, D] table shared by the batch)."""
    stack = ModelConfig.from_dict(tiny("voxcpm2")).lm
    rope, d = LongRoPE(stack), stack.head_dim
    gen = torch.Generator().manual_seed(8)
    if dense:
        qkv = torch.randn(3, 7, 4 + 2 * 2, d, generator=gen).to(dtype)
        cos, sin = rope.prefix(7, torch.device("cpu"))
    else:
        qkv = torch.randn(9, 4 + 2 * 2, d, generator=gen).to(dtype)
        cos, sin = rope(torch.randint(0, 3000, (9,), generator=gen))
    before = qkv.clone()
    ref = apply_rope(qkv[..., :6, :].double(), cos.double(), sin.double())

    out = kernels[1].rope_(qkv[..., :6, :], cos, sin)

    assert out.data_ptr() == qkv.data_ptr()
    assert relative_error(qkv[..., :6, :], ref) < (1e-6 if dtype == torch.float32 else 1e-3)
    assert torch.equal(qkv[..., 6:, :], before[..., 6:, :])  # the v heads untouched


def test_rope_rejects_bad_shapes(kernels):
    with pytest.raises(ValueError, match="rope_ needs"):
        kernels[1].rope_(torch.zeros(4, 2, 16), torch.zeros(3, 16), torch.zeros(3, 16))
    with pytest.raises(ValueError, match="rope_ needs"):
        kernels[1].rope_(torch.zeros(4, 2, 12), torch.zeros(4, 12), torch.zeros(4, 12))
    with pytest.raises(ValueError, match="silu_mul needs"):
        kernels[1].silu_mul(torch.zeros(2, 5))


def tiny_model(seed: int) -> VoxCPMModel:
    torch.manual_seed(seed)
    model = VoxCPMModel(ModelConfig.from_dict(tiny("voxcpm2"))).eval()
    with torch.no_grad():
        for p in model.parameters():  # RMSNorm weights start at 1: randomise everything
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def local_outputs(model: VoxCPMModel) -> tuple[torch.Tensor, torch.Tensor]:
    """LocEnc features and sampled patches (LocDiT, 4 timesteps, CFG) of fixed random inputs."""
    cfg, gen = model.config, torch.Generator().manual_seed(9)
    b, p, d, h = 2, cfg.patch_size, cfg.feat_dim, cfg.lm.hidden_size
    with torch.no_grad():
        enc = model.encode_patches(torch.randn(3, p, d, generator=gen))
        lm_h, res_h = torch.randn(b, h, generator=gen), torch.randn(b, h, generator=gen)
        patches = model.sample_patches(lm_h, res_h, torch.randn(b, p, d, generator=gen),
                                       torch.randn(b, d, p, generator=gen), 4, torch.tensor([2.0, 1.5]))
    return enc, patches


def test_fused_projections_change_no_output_or_state_dict():
    model = tiny_model(0)
    ref = local_outputs(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    model.fuse_projections()

    attn = model.feat_decoder.estimator.decoder.layers[0].self_attn
    assert attn.qkv is not None and attn.q_proj.weight.data_ptr() == attn.qkv.data_ptr()
    after = model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], v) for k, v in state.items())
    for ours, theirs in zip(local_outputs(model), ref, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # loading a checkpoint after fusing writes through the views into the fused weights
    model.load_state_dict(tiny_model(1).state_dict())
    assert attn.q_proj.weight.data_ptr() == attn.qkv.data_ptr()
    for ours, theirs in zip(local_outputs(model), local_outputs(tiny_model(1)), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_lora_after_fusing_takes_the_unfused_path():
    model, plain = tiny_model(2), tiny_model(2)
    model.fuse_projections()
    for m in (model, plain):
        state = attach_lora(m, num_adapters=1, max_rank=2)
        gen = torch.Generator().manual_seed(3)
        state.load_slot(1, {path: (torch.randn(2, layer.lora_A.shape[2], generator=gen),
                                   torch.randn(layer.lora_B.shape[1], 2, generator=gen))
                            for path, layer in state.layers.items()})
        m.set_lora_indices(seqs=torch.tensor([1, 0]))

    ours, ref = local_outputs(model), local_outputs(plain)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours[1], local_outputs(tiny_model(2))[1], atol=1e-3)  # the adapter did act


def random_stack(mup: bool) -> MiniCPM:
    """The tiny base LM's stack with 3 layers (so a branch crosses from layer to layer), random fp32 weights."""
    stack = dataclasses.replace(ModelConfig.from_dict(tiny("voxcpm2")).lm, num_hidden_layers=3, use_mup=mup)
    torch.manual_seed(11)
    model = MiniCPM(stack).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))  # norm weights around 1
    return model


@pytest.mark.parametrize("mup", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_stack_keeps_the_official_op_order(mup, dtype):
    """Off CUDA the restructured stack (branches handed to the next norm) runs exactly the ops it ran before."""
    model = random_stack(mup).to(dtype)
    x = torch.randn(2, 6, model.norm.weight.shape[0], generator=torch.Generator().manual_seed(12)).to(dtype)
    rope = model.rope.prefix(6, x.device)

    def attend(i, q, k, v):
        return dense_attention(q, k, v)

    with torch.no_grad():
        ref = x
        for i, layer in enumerate(model.layers):  # the official DecoderLayer.forward, inlined
            s = layer.branch_scale
            h = layer.self_attn(layer.input_layernorm(ref), rope, attend, i)
            ref = ref + (h if s is None else h * s)
            h = layer.mlp(layer.post_attention_layernorm(ref))
            ref = ref + (h if s is None else h * s)
        ref = model.norm(ref)
        out = model.run(x, rope, attend)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("mup", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_stack_matches_eager(kernels, monkeypatch, mup, dtype):
    """The whole stack with every CUDA kernel on (interpreted), one add_rms_norm per residual add, against the eager
    stack. Yardstick: the fp32 eager output; in 16 bits the fused stack may not be meaningfully less accurate than
    the eager one (in bf16 it is a little, from the interpreter's truncating casts: see the add_rms_norm test)."""
    model = random_stack(mup)
    x = torch.randn(2, 6, model.norm.weight.shape[0], generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        ref = model.forward_dense(x).double()
        model.to(dtype).fuse_projections()
        eager = model.forward_dense(x.to(dtype))
        calls = []
        add_rms_norm = kernels[1].add_rms_norm
        monkeypatch.setattr(kernels[1], "add_rms_norm", lambda *a: calls.append(a[4]) or add_rms_norm(*a))
        monkeypatch.setattr(fusion, "fused", lambda t: True)  # the CUDA dispatch, on CPU tensors
        if dtype == torch.bfloat16:  # the interpreter's bf16 tl.dot is wrong: short attention is checked in fp16
            monkeypatch.setattr(kernels[0], "short_attention_fits", lambda q, k: False)  # and on the GPU
        out = model.forward_dense(x.to(dtype))
        kept = model.forward_dense(x.to(dtype), keep_last=2)  # the LocDiT's call: its last P tokens only
    assert calls[:2 * len(model.layers)] == [model.layers[0].branch_scale] * (2 * len(model.layers))  # one per add
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert relative_error(out, ref) < 1e-5
        assert relative_error(kept, out[:, -2:]) < 1e-6
    else:
        assert relative_error(out, ref) <= 1.5 * relative_error(eager, ref) + 1e-3
        assert relative_error(kept, ref[:, -2:]) <= 1.5 * relative_error(eager, ref) + 1e-3


@pytest.mark.parametrize("length,q_heads,kv_heads,head_dim", [(11, 16, 2, 32), (5, 4, 4, 16), (9, 8, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_short_attention_matches_sdpa(kernels, length, q_heads, kv_heads, head_dim, dtype):
    """The LocEnc/LocDiT attention kernel on strided views of one fused qkv output, as the stacks call it."""
    gen = torch.Generator().manual_seed(length)
    qkv = torch.randn(3, length, q_heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    q, k, v = qkv[:, :, :q_heads], qkv[:, :, q_heads:q_heads + kv_heads], qkv[:, :, q_heads + kv_heads:]
    out = kernels[0].short_attention(q, k, v)
    ref = dense_attention(q.float(), k.float(), v.float())  # SDPA on CPU
    assert out.shape == ref.shape and out.dtype == dtype
    assert relative_error(out, ref) < (1e-6 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("rope", [False, True])
def test_short_attention_keeps_the_last_tokens(kernels, rope):
    """`last`: the last tokens' outputs of the whole attention, bit for bit (every token is still a key)."""
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(3, 11, 20, 32, generator=gen)
    q, k, v = qkv[:, :, :16], qkv[:, :, 16:18], qkv[:, :, 18:]
    table = rope_table(torch.arange(11), 32) if rope else None
    out = kernels[0].short_attention(q, k, v, table, last=4)
    assert out.shape == (3, 4, 16, 32)
    assert torch.equal(out, kernels[0].short_attention(q, k, v, table)[:, -4:])
    with pytest.raises(ValueError, match="last=12"):
        kernels[0].short_attention(q, k, v, last=12)


def rope_table(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half cos/sin fp32 [N, D] of `positions`, LongRoPE-like (scale > 1), for any head dim."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = positions.float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * 1.2, emb.sin() * 1.2


@pytest.mark.parametrize("length,q_heads,kv_heads,head_dim", [(11, 16, 2, 32), (5, 4, 4, 16), (9, 8, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_short_attention_rope_equals_rope_first(kernels, length, q_heads, kv_heads, head_dim, dtype):
    """RoPE inside the short attention == `rope_` on the q|k heads of the fused qkv output, then the kernel without
    it: bit for bit (the rotation is rounded to q's dtype before the dot, as rope_ stores it); q|k|v not written."""
    attention_triton, fused = kernels
    gen = torch.Generator().manual_seed(100 + length)
    qkv = torch.randn(3, length, q_heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    cos, sin = rope_table(torch.arange(length), head_dim)
    heads = q_heads + kv_heads
    before = qkv.clone()

    out = attention_triton.short_attention(qkv[:, :, :q_heads], qkv[:, :, q_heads:heads], qkv[:, :, heads:],
                                           (cos, sin))

    assert torch.equal(qkv, before)
    fused.rope_(before[:, :, :heads], cos, sin)
    ref = attention_triton.short_attention(before[:, :, :q_heads], before[:, :, q_heads:heads], before[:, :, heads:])
    assert out.dtype == dtype and torch.equal(out, ref)


@pytest.mark.parametrize("rope", [True, False])  # False: VoxCPM2's residual LM, no RoPE: the kernel only stores
@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                    (torch.float16, torch.float32)])
def test_rope_store_kv_equals_rope_then_store(kernels, rope, dtype, cache_dtype):
    """One kernel == `rope_` on the q|k heads of a fused qkv output, then `store_kv` (two index_copy_), bit for bit:
    q and k rotated in place, v untouched, the rotated k and v at their shuffled slots (cast to the cache dtype), every
    other slot of the (NaN-poisoned) caches left as it was."""
    from engine.model.attention import store_kv

    attention_triton, fused = kernels
    gen = torch.Generator().manual_seed(21)
    q_heads, kv_heads, head_dim, page = 8, 2, 32, 4
    (*_, k_cache, _), meta = paged_case([3, 1, 5], [2, 9, 0], page, q_heads, kv_heads, head_dim, dtype, gen)
    n, heads = meta.slot_mapping.shape[0], q_heads + kv_heads
    qkv = torch.randn(n, heads + kv_heads, head_dim, generator=gen).to(dtype)
    caches = [torch.full(k_cache.shape, float("nan"), dtype=cache_dtype) for _ in range(2)]
    table = rope_table(meta.positions(), head_dim) if rope else None
    ref_qkv, ref_caches = qkv.clone(), [c.clone() for c in caches]

    attention_triton.rope_store_kv_(qkv[:, :q_heads], qkv[:, q_heads:heads], qkv[:, heads:], *caches,
                                    meta.slot_mapping, table)

    if rope:
        fused.rope_(ref_qkv[:, :heads], *table)
    store_kv(ref_qkv[:, q_heads:heads], ref_qkv[:, heads:], *ref_caches, meta)
    assert torch.equal(qkv, ref_qkv)
    for cache, ref in zip(caches, ref_caches, strict=True):
        assert torch.equal(cache.isnan(), ref.isnan()) and torch.equal(cache.nan_to_num(), ref.nan_to_num())


def test_rope_store_kv_rejects_bad_shapes(kernels):
    attention_triton = kernels[0]
    q, k, cache, slots = torch.zeros(3, 4, 16), torch.zeros(3, 2, 16), torch.zeros(2, 4, 2, 16), torch.zeros(3).long()
    with pytest.raises(ValueError, match="unsupported shapes"):
        attention_triton.rope_store_kv_(q, k, torch.zeros(3, 1, 16), cache, cache, slots, None)
    with pytest.raises(ValueError, match="rope needs"):
        attention_triton.rope_store_kv_(q, k, k, cache, cache, slots, (torch.zeros(2, 16), torch.zeros(2, 16)))
    with pytest.raises(ValueError, match="rope needs"):
        attention_triton.short_attention(q[None], k[None], k[None], (torch.zeros(2, 16), torch.zeros(2, 16)))


@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_triton_attention_rope_equals_rope_first(kernels, monkeypatch, case):
    """TritonAttention handed the RoPE tables (the CUDA path of forward_paged: one rope+store kernel) == `rope_`
    first and the backend without them (rope_, two index_copy_): output and caches bit for bit."""
    attention_triton, fused = kernels
    monkeypatch.setattr(fusion, "fused", lambda t: True)  # the CUDA dispatch, on CPU tensors
    gen = torch.Generator().manual_seed(22)
    (_, _, _, k_cache, v_cache), meta = paged_case(*CASES[case], 4, 8, 2, 16, torch.float16, gen)
    qkv = torch.randn(meta.slot_mapping.shape[0], 12, 16, generator=gen).half()
    rope = rope_table(meta.positions(), 16)
    ref_qkv, ref_k, ref_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    backend = attention_triton.TritonAttention(block_n=16)

    out = backend(qkv[:, :8], qkv[:, 8:10], qkv[:, 10:], k_cache, v_cache, meta, rope)

    fused.rope_(ref_qkv[:, :10], *rope)
    ref = backend(ref_qkv[:, :8], ref_qkv[:, 8:10], ref_qkv[:, 10:], ref_k, ref_v, meta)
    assert torch.equal(out, ref) and torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("no_rope", [False, True])
def test_fused_rope_stacks_equal_rope_first(kernels, monkeypatch, no_rope):
    """A whole stack on the CUDA path: forward_dense (RoPE in the short attention) and forward_paged (RoPE in the
    K/V store; without RoPE, as the residual LM, the store alone) launch no rope_ and give, bit for bit, what the
    layers applying `rope_` first give. fp16: the interpreter's bf16 tl.dot is wrong (see above)."""
    attention_triton, fused = kernels
    model = random_stack(False)
    model.rope = None if no_rope else model.rope
    model.half().fuse_projections()
    gen = torch.Generator().manual_seed(23)
    hidden = model.norm.weight.shape[0]
    monkeypatch.setattr(fusion, "fused", lambda t: True)
    monkeypatch.setattr(minicpm, "DENSE_ROPE_IN_ATTENTION_MIN_SEQS", 2)  # the batch below: the fused path
    ropes = []
    rope_ = fused.rope_
    monkeypatch.setattr(fused, "rope_", lambda *a: ropes.append(a) or rope_(*a))
    x = torch.randn(2, 6, hidden, generator=gen).half()
    (*_, k_cache, v_cache), meta = paged_case([3, 1], [0, 7], 4, 4, 2, 16, torch.float16, gen)
    n = meta.slot_mapping.shape[0]
    caches = [model_cache(model, k_cache, v_cache) for _ in range(2)]
    x_flat = torch.randn(n, hidden, generator=gen).half()
    backend = attention_triton.TritonAttention(block_n=16)

    with torch.no_grad():
        dense, paged = model.forward_dense(x), model.forward_paged(x_flat, meta.positions(), meta, caches[0], backend)
        assert not ropes  # no RoPE launch of its own on either path
        dense_rope = None if no_rope else model.rope.prefix(6, x.device)
        paged_rope = None if no_rope else model.rope(meta.positions())
        ref_dense = model.run(x, dense_rope, lambda i, q, k, v: dense_attention(q, k, v))
        ref_paged = model.run(x_flat, paged_rope,
                              lambda i, q, k, v: backend(q, k, v, caches[1].k[i], caches[1].v[i], meta))
    assert len(ropes) == (0 if no_rope else 2 * len(model.layers))  # the reference did rotate with rope_
    assert torch.equal(dense, ref_dense) and torch.equal(paged, ref_paged)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def model_cache(model: MiniCPM, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """A KVCache for every layer of `model`, each layer a copy of the given random [blocks, page, Hkv, D] caches."""
    from engine.model.attention import KVCache

    layers_ = len(model.layers)
    return KVCache(k_cache[None].repeat(layers_, 1, 1, 1, 1), v_cache[None].repeat(layers_, 1, 1, 1, 1))
