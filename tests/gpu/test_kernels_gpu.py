"""The Triton kernels on CUDA with real shapes (VoxCPM2: 16 q / 2 kv heads, head dim 128; VoxCPM1.5: 64), bf16.
The fused RoPE paths (in the short attention, in the paged K/V store) equal RoPE first bit for bit.

Run on the GPU machine: `.venv/bin/python -m pytest -q -m gpu tests/gpu/test_kernels_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.model.attention import AttentionMetadata, FlashAttention, TorchAttention, make_attention_backend, store_kv
from engine.model.audio_vae import Snake
from engine.model.layers import LongRoPE, RMSNorm, apply_rope
from engine.model_configs import voxcpm2
from tests.test_kernels_interpret import eager_add_rms_norm, paged_case, relative_error

pytestmark = pytest.mark.gpu
BF16_TOLERANCE = 1e-2  # bf16 operands; fp32 accumulation on both sides


@pytest.fixture(scope="module")
def cuda() -> str:
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    return "cuda"


def reference(q, k, v, k_cache, v_cache, meta):
    """TorchAttention in fp32 on copies of the caches (which it updates like the backend under test)."""
    ref_k, ref_v = k_cache.float(), v_cache.float()
    return TorchAttention()(q.float(), k.float(), v.float(), ref_k, ref_v, meta), ref_k, ref_v


def random_lens(gen: torch.Generator, count: int, low: int, high: int) -> list[int]:
    return torch.randint(low, high + 1, (count,), generator=gen).tolist()


@pytest.mark.parametrize(("batch", "page", "head_dim"), [(1, 16, 128), (8, 32, 128), (64, 16, 128), (256, 16, 128),
                                                          (256, 32, 64)])
def test_decode_matches_torch(cuda, batch, page, head_dim):
    from engine.model.attention_triton import TritonAttention

    gen = torch.Generator().manual_seed(batch * page + head_dim)
    cached = random_lens(gen, batch, 0, 1023)
    tensors, meta = paged_case([1] * batch, cached, page, 16, 2, head_dim, torch.bfloat16,
                               torch.Generator(cuda).manual_seed(batch), cuda)
    ref, ref_k, ref_v = reference(*tensors, meta)
    for backend in (TritonAttention(), TritonAttention(num_splits=1)):
        q, k, v, k_cache, v_cache = (t.clone() for t in tensors)
        out = backend(q, k, v, k_cache, v_cache, meta)
        assert out.dtype == torch.bfloat16 and not out.isnan().any()
        assert relative_error(out, ref.double()) < BF16_TOLERANCE
        assert torch.equal(k_cache.float(), ref_k) and torch.equal(v_cache.float(), ref_v)


@pytest.mark.parametrize(("query_lens", "cached_lens"), [
    ([300, 1, 1, 77], [0, 900, 10, 500]),  # a prefill chunk among decodes
    ([1024], [0]),  # one long prefill
    ([128] * 8, [0, 64, 128, 256, 384, 512, 640, 896]),  # chunked prefills
    ([114] * 64, [0] * 64),  # a burst of prompts (the largest query tile)
])
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("rows", [None, 128, 256])  # the tile `rows_for` picks, and each large one forced
def test_prefill_and_mixed_match_torch(cuda, query_lens, cached_lens, head_dim, rows):
    from engine.model.attention_triton import TritonAttention

    tensors, meta = paged_case(query_lens, cached_lens, 16, 16, 2, head_dim, torch.bfloat16,
                               torch.Generator(cuda).manual_seed(len(query_lens)), cuda)
    ref, ref_k, ref_v = reference(*tensors, meta)
    q, k, v, k_cache, v_cache = tensors
    out = TritonAttention(rows_per_program=rows)(q, k, v, k_cache, v_cache, meta)
    assert relative_error(out, ref.double()) < BF16_TOLERANCE
    assert torch.equal(k_cache.float(), ref_k) and torch.equal(v_cache.float(), ref_v)


@pytest.mark.parametrize("rope", [False, True])
def test_cuda_graph_capture_and_replay(cuda, rope):
    """One decode bucket (8 sequences, up to 1024 keys) captured once, replayed on fresh lengths and block tables;
    rope: the tables handed to the backend, as forward_paged does on CUDA (RoPE + K/V store in one kernel)."""
    from engine.model.attention_triton import TritonAttention

    batch, page, width, heads, kv_heads, dim = 8, 16, 64, 16, 2, 128
    num_blocks = batch * width + 1
    gen = torch.Generator(cuda).manual_seed(0)
    q = torch.empty(batch, heads, dim, device=cuda, dtype=torch.bfloat16)
    k, v = (torch.empty(batch, kv_heads, dim, device=cuda, dtype=torch.bfloat16) for _ in range(2))
    k_cache, v_cache = (torch.randn(num_blocks, page, kv_heads, dim, generator=gen, device=cuda).bfloat16()
                        for _ in range(2))

    def fresh_meta(seed: int) -> AttentionMetadata:
        host = torch.Generator().manual_seed(seed)
        tables = torch.randperm(num_blocks, generator=host)[:batch * width].view(batch, width).tolist()
        meta = AttentionMetadata.build([1] * batch, random_lens(host, batch, 0, width * page - 1), tables, page, cuda)
        meta.max_seqlen_k = width * page  # the bucket's bound, not this batch's
        return meta

    static = fresh_meta(0)
    for t in (q, k, v):
        t.normal_(generator=gen)
    table = LongRoPE(ModelConfig.from_dict(voxcpm2()).lm)
    cos, sin = table(static.positions())  # the graph reads these buffers: replays refill them in place
    tables = (cos, sin) if rope else None
    backend = TritonAttention()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend(q, k, v, k_cache, v_cache, static, tables)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend(q, k, v, k_cache, v_cache, static, tables)

    for seed in (1, 2):
        meta = fresh_meta(seed)
        for name in ("cu_seqlens_q", "seq_lens", "slot_mapping", "block_tables"):
            getattr(static, name).copy_(getattr(meta, name))
        for t in (q, k, v):
            t.normal_(generator=gen)
        for buffer, fresh in zip((cos, sin), table(meta.positions()), strict=True):
            buffer.copy_(fresh)
        # RoPE on copies, rounded to bf16 as the kernel stores it (the graph rotates q and k themselves)
        q_ref, k_ref = (t.clone() for t in (q, k)) if tables is None else (apply_rope(t.clone(), *tables)
                                                                           for t in (q, k))
        ref, ref_k, ref_v = reference(q_ref, k_ref, v, k_cache, v_cache, meta)
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, ref.double()) < BF16_TOLERANCE
        assert torch.equal(k_cache.float(), ref_k) and torch.equal(v_cache.float(), ref_v)


def test_cuda_selects_a_fast_backend(cuda):
    from engine.model.attention_triton import TritonAttention

    assert isinstance(make_attention_backend(cuda), TritonAttention)
    assert isinstance(make_attention_backend(cuda, block_size=256), TritonAttention | FlashAttention)


@pytest.mark.parametrize(("shape", "dtype", "tolerance"), [
    ((4, 64, 7680), torch.float32, 1e-6), ((2, 2048, 3), torch.float32, 1e-6), ((4, 64, 7680), torch.bfloat16, 1e-2)])
def test_fused_snake_matches_torch(cuda, shape, dtype, tolerance):
    gen = torch.Generator().manual_seed(0)
    alpha = (torch.rand(1, shape[1], 1, generator=gen) * 2 + 0.05).to(dtype)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    fused, eager = Snake(shape[1]).to(cuda, dtype), Snake(shape[1]).double()
    with torch.no_grad():
        fused.alpha.copy_(alpha)
        eager.alpha.copy_(alpha)
        y = fused(x.to(cuda))  # Snake.forward dispatches to the fused kernel on CUDA
        ref = eager(x.double())  # the eager formula on CPU, float64, same (rounded) inputs
    assert y.dtype == dtype and y.shape == x.shape
    assert relative_error(y.cpu(), ref) < tolerance


@pytest.mark.parametrize(("rows", "dim"), [(256, 2048), (256 * 2 * 11, 1024), (1, 2048)])
def test_fused_rms_norm_matches_torch(cuda, rows, dim):
    from engine.kernels import rms_norm

    gen = torch.Generator(cuda).manual_seed(rows)
    module = RMSNorm(dim, 1e-5).to(cuda, torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(torch.rand(dim, generator=gen, device=cuda) + 0.5)
        x = (torch.randn(rows, dim, generator=gen, device=cuda) * 4).bfloat16()
        # the eager formula written out: module(x) itself runs the kernel on CUDA
        ref = (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * module.weight
    y = rms_norm(x, module.weight, 1e-5)
    assert y.dtype == torch.bfloat16
    assert relative_error(y, ref.double()) < BF16_TOLERANCE


@pytest.mark.parametrize(("rows", "dim"), [(1, 2048), (256, 2048), (256 * 2 * 11, 1024)])
@pytest.mark.parametrize("scale", [None, 0.2645751311])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_add_rms_norm_matches_torch(cuda, rows, dim, scale, dtype):
    """The residual bit for bit as eager CUDA ops round it (bf16 too, unlike the interpreter), the norm to rounding;
    x's rows strided (a slice of a wider tensor)."""
    from engine.kernels import add_rms_norm

    gen = torch.Generator(cuda).manual_seed(rows + dim)
    weight = (torch.rand(dim, generator=gen, device=cuda) + 0.5).to(dtype)
    x = (torch.randn(rows, dim + 64, generator=gen, device=cuda) * 4).to(dtype)[:, 64:]
    h = (torch.randn(rows, dim, generator=gen, device=cuda) * 4).to(dtype)
    ref_x, ref_y = eager_add_rms_norm(x, h, weight, 1e-5, scale)
    x_new, y = add_rms_norm(x, h, weight, 1e-5, scale)
    assert x_new.dtype == dtype and torch.equal(x_new, ref_x)
    assert y.dtype == dtype
    assert relative_error(y, ref_y.double()) < (1e-6 if dtype == torch.float32 else BF16_TOLERANCE)


@pytest.mark.parametrize("batch", [1, 256])
def test_fused_cfg_zero_euler_matches_torch(cuda, batch):
    from engine.kernels import cfg_zero_euler_

    gen = torch.Generator(cuda).manual_seed(batch)
    x = torch.randn(batch, 4, 64, generator=gen, device=cuda)
    v = torch.randn(2 * batch, 4, 64, generator=gen, device=cuda).bfloat16()
    w = torch.rand(batch, generator=gen, device=cuda) * 3
    v_cond, v_uncond = v[:batch].double(), v[batch:].double()
    scale = (v_cond * v_uncond).sum((1, 2), keepdim=True) / (v_uncond.pow(2).sum((1, 2), keepdim=True) + 1e-8)
    # each row its own Euler step (0 for every other row: a row whose solve has ended keeps its x bit for bit)
    dt = torch.rand(batch, generator=gen, device=cuda) * 0.2 * (torch.arange(batch, device=cuda) % 2)
    before = x.clone()
    ref = x.double() - dt.double().view(batch, 1, 1) * (
        v_uncond * scale + w.double().view(batch, 1, 1) * (v_cond - v_uncond * scale))
    cfg_zero_euler_(x, v, w, dt)
    assert relative_error(x, ref) < 1e-6
    assert torch.equal(x[::2], before[::2])


@pytest.mark.parametrize("batch,length", [(1, 11), (512, 11), (256, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_short_attention_matches_sdpa(cuda, batch, length, dtype):
    """The LocDiT (11 tokens, CFG doubles the batch) and LocEnc (5 tokens) attention at VoxCPM2's 16/2 heads of 128."""
    from engine.model.attention_triton import short_attention

    gen = torch.Generator(cuda).manual_seed(batch)
    qkv = torch.randn(batch, length, 20, 128, device=cuda, generator=gen).to(dtype)
    q, k, v = qkv[:, :, :16], qkv[:, :, 16:18], qkv[:, :, 18:]
    out = short_attention(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(1, 2), k.double().transpose(1, 2), v.double().transpose(1, 2), enable_gqa=True)
    assert relative_error(out, ref.transpose(1, 2)) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("batch,length", [(1, 11), (512, 11), (256, 5)])  # LocDiT (CFG doubles the batch), LocEnc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_short_attention_rope_equals_rope_first(cuda, batch, length, dtype):
    """RoPE inside the short attention (forward_dense on CUDA) == rope_ on the q|k heads, then the kernel without it,
    bit for bit, at VoxCPM2's LocDiT widths (16/2 heads of 128, its RoPE table); q|k|v not written."""
    from engine.kernels import rope_
    from engine.model.attention_triton import short_attention

    gen = torch.Generator(cuda).manual_seed(batch + length)
    qkv = torch.randn(batch, length, 20, 128, device=cuda, generator=gen).to(dtype)
    cos, sin = LongRoPE(ModelConfig.from_dict(voxcpm2()).dit_lm).prefix(length, torch.device(cuda))
    before = qkv.clone()
    out = short_attention(qkv[:, :, :16], qkv[:, :, 16:18], qkv[:, :, 18:], (cos, sin))
    assert torch.equal(qkv, before)
    rope_(before[:, :, :18], cos, sin)
    ref = short_attention(before[:, :, :16], before[:, :, 16:18], before[:, :, 18:])
    assert torch.equal(out, ref), f"max abs difference {(out.float() - ref.float()).abs().max().item()}"


@pytest.mark.parametrize(("query_lens", "cached_lens"), [([1] * 256, list(range(0, 1024, 4))), ([1], [37]),
                                                         ([300, 1, 77], [0, 900, 500])])
@pytest.mark.parametrize("rope", [True, False])  # False: the residual LM (no RoPE): the kernel only stores
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_rope_store_kv_equals_rope_then_store(cuda, query_lens, cached_lens, rope, cache_dtype):
    """The LMs' RoPE + K/V store kernel == rope_ on the q|k heads of the fused qkv output, then store_kv (two
    index_copy_), bit for bit: q and k rotated in place, v untouched, every slot of the NaN-poisoned caches."""
    from engine.kernels import rope_
    from engine.model.attention_triton import rope_store_kv_

    gen = torch.Generator(cuda).manual_seed(len(query_lens) + rope)
    (*_, k_cache, _), meta = paged_case(query_lens, cached_lens, 16, 16, 2, 128, torch.bfloat16, gen, cuda)
    qkv = torch.randn(meta.slot_mapping.shape[0], 20, 128, device=cuda, generator=gen).bfloat16()
    caches = [torch.full(k_cache.shape, float("nan"), device=cuda, dtype=cache_dtype) for _ in range(2)]
    tables = LongRoPE(ModelConfig.from_dict(voxcpm2()).lm)(meta.positions()) if rope else None
    ref_qkv, ref_caches = qkv.clone(), [c.clone() for c in caches]
    rope_store_kv_(qkv[:, :16], qkv[:, 16:18], qkv[:, 18:], *caches, meta.slot_mapping, tables)
    if rope:
        rope_(ref_qkv[:, :18], *tables)
    store_kv(ref_qkv[:, 16:18], ref_qkv[:, 18:], *ref_caches, meta)
    assert torch.equal(qkv, ref_qkv)
    for cache, ref in zip(caches, ref_caches, strict=True):
        assert torch.equal(cache.isnan(), ref.isnan()) and torch.equal(cache.nan_to_num(), ref.nan_to_num())
