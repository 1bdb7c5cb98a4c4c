"""The decode-step fusions on CUDA at real VoxCPM2 size: fused q/k/v + gate/up GEMMs, Triton RMSNorm, SiLU*mul,
RoPE and CFG-Zero* + Euler give the unfused results, and launch fewer kernels (counts printed; run with -s).
RoPE inside the attention kernels (short attention; the paged K/V store) gives the rope-first stacks' results bit for
bit with one launch less per layer (two for the LMs with RoPE).

Run on the GPU machine: `python -m pytest -q -m gpu -s tests/gpu/test_fusion_gpu.py` (bench/gpu_run.sh does).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from engine import kernels
from engine.checkpoint import load_model
from engine.config import ModelConfig
from engine.model import fusion
from engine.model.attention import AttentionMetadata, KVCache, dense_attention, make_attention_backend, rotate, store_kv
from engine.model.layers import LongRoPE, apply_rope
from engine.model.minicpm import DENSE_ROPE_IN_ATTENTION_MIN_SEQS, MiniCPM
from engine.model_configs import voxcpm2


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def kernel_count(fn) -> int:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.lower().startswith(("memcpy", "memset")))


def test_silu_mul_and_rope_at_real_shapes(cuda):
    gen = torch.Generator(cuda).manual_seed(0)
    gate_up = torch.randn(512, 2 * 6144, device=cuda, generator=gen).bfloat16()
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert relative_error(kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up) < 1e-2

    stack = ModelConfig.from_dict(voxcpm2()).lm
    rope = LongRoPE(stack)
    qkv = torch.randn(256, 20, stack.head_dim, device=cuda, generator=gen).bfloat16()
    cos, sin = rope(torch.randint(0, 30000, (256,), device=cuda, generator=gen))
    ref = apply_rope(qkv[:, :18].cpu().float(), cos.cpu(), sin.cpu())  # the eager formula, fp32 on CPU
    v_before = qkv[:, 18:].clone()
    kernels.rope_(qkv[:, :18], cos, sin)
    assert relative_error(qkv[:, :18].cpu(), ref) < 1e-2
    assert torch.equal(qkv[:, 18:], v_before)


def step_outputs(model, b: int, cuda: str) -> list[torch.Tensor]:
    """LocEnc, both LMs (one decode token per sequence over a paged cache) and the sampled patches (10 steps, CFG)."""
    cfg, dtype = model.config, next(model.parameters()).dtype
    gen = torch.Generator(cuda).manual_seed(b)
    p, d, h = cfg.patch_size, cfg.feat_dim, cfg.lm.hidden_size
    caches = tuple(KVCache.allocate(s, b * 4 + 1, 16, cuda, dtype) for s in (cfg.lm, cfg.residual_lm))
    meta = AttentionMetadata.build([1] * b, [40] * b, [list(range(4 * j, 4 * j + 4)) for j in range(b)], 16, cuda)
    patches = torch.randn(b, p, d, device=cuda, generator=gen)
    lm_h, res_h = model.forward_lms(torch.zeros(b, dtype=torch.long, device=cuda), patches.to(dtype),
                                    torch.ones(b, dtype=torch.long, device=cuda), meta.positions(), meta, caches,
                                    torch.arange(b, device=cuda))
    x = torch.randn(b, h, device=cuda, generator=gen).to(dtype)
    noise = torch.randn(b, d, p, device=cuda, generator=gen)
    sampled = model.sample_patches(x, x, patches, noise, 10, torch.full((b,), 2.0, device=cuda))
    return [model.encode_patches(patches), lm_h, res_h, sampled]


@torch.inference_mode()
def test_fused_step_matches_unfused_and_launches_fewer_kernels(cuda, voxcpm2_dir):
    model = load_model(voxcpm2_dir, cuda, torch.float32).model
    model.attention = make_attention_backend(cuda, 16)
    ref = step_outputs(model, 4, cuda)
    unfused_kernels = kernel_count(lambda: step_outputs(model, 1, cuda))

    model.fuse_projections()
    fused = step_outputs(model, 4, cuda)
    fused_kernels = kernel_count(lambda: step_outputs(model, 1, cuda))
    errors = [relative_error(o, r) for o, r in zip(fused, ref, strict=True)]
    print(f"\nfusion fp32 relative errors (LocEnc, base LM, residual LM, patches): {errors}")
    print(f"kernels per batch-1 step (eager; the graph holds the same): unfused {unfused_kernels}, "
          f"fused {fused_kernels}")
    assert all(e < 1e-4 for e in errors)
    assert fused_kernels < unfused_kernels

    model.to(torch.bfloat16)  # new weight storage: the fused views are stale, the unfused path runs
    fusion.FUSED_KERNELS = False
    try:
        plain = step_outputs(model, 4, cuda)
    finally:
        fusion.FUSED_KERNELS = True
    model.fuse_projections()
    bf16 = step_outputs(model, 4, cuda)
    plain_errors = [relative_error(o.float(), r) for o, r in zip(plain, ref, strict=True)]
    errors = [relative_error(o.float(), r) for o, r in zip(bf16, ref, strict=True)]
    print(f"bf16 vs fp32 relative errors, plain torch: {plain_errors}; fused: {errors}")
    # Random weights amplify bf16 rounding through 28 layers, so the bound is relative to plain bf16's own error:
    # fusing must not make bf16 meaningfully worse.
    assert all(e <= 1.5 * p + 1e-3 for e, p in zip(errors, plain_errors, strict=True))


def random_stack(stack, cuda: str) -> MiniCPM:
    """A VoxCPM2 stack with random bf16 weights (norm weights around 1) and fused projections, as the engine runs."""
    torch.manual_seed(0)
    model = MiniCPM(stack).to(cuda).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.02 + (1.0 if p.dim() == 1 else 0.0))
    model.to(torch.bfloat16).fuse_projections()
    return model


@pytest.mark.parametrize("batch", [2, DENSE_ROPE_IN_ATTENTION_MIN_SEQS])
@pytest.mark.parametrize("name", ["LocDiT", "LocEnc"])
@torch.inference_mode()
def test_rope_in_dense_attention_equals_rope_first(cuda, name, batch):
    """LocDiT (L=11) and LocEnc (L=5): forward_dense, RoPE inside the short attention kernel from
    DENSE_ROPE_IN_ATTENTION_MIN_SEQS sequences on (one kernel less per layer), else rope_ first, == the layers
    applying rope_ first (the path before the fusion), bit for bit."""
    cfg = ModelConfig.from_dict(voxcpm2())
    stack, length = (cfg.dit_lm, 2 * cfg.patch_size + 3) if name == "LocDiT" else (cfg.encoder_lm, cfg.patch_size + 1)
    model = random_stack(stack, cuda)
    x = torch.randn(batch, length, stack.hidden_size, device=cuda, generator=torch.Generator(cuda).manual_seed(1))
    x = x.bfloat16()

    def rope_first() -> torch.Tensor:
        rope = model.rope.prefix(length, x.device)
        return model.run(x, rope, lambda i, q, k, v: dense_attention(q, k, v))

    fused, ref = model.forward_dense(x), rope_first()
    saved = kernel_count(rope_first) - kernel_count(lambda: model.forward_dense(x))
    print(f"\n{name}: {saved} kernels fewer per pass ({len(model.layers)} layers)")
    assert torch.equal(fused, ref), f"max abs difference {(fused - ref).abs().max().item()}"
    assert saved == (len(model.layers) if batch >= DENSE_ROPE_IN_ATTENTION_MIN_SEQS else 0)


@pytest.mark.parametrize("name", ["base LM", "residual LM"])
@pytest.mark.parametrize(("query_lens", "cached_lens"), [([1] * 8, [40] * 8), ([37, 1, 1], [0, 90, 15])])
@torch.inference_mode()
def test_rope_in_kv_store_equals_rope_first(cuda, name, query_lens, cached_lens):
    """Base LM and residual LM (no RoPE): forward_paged with the Triton backend, RoPE + K/V store in one kernel, ==
    the layers applying rope_ first and the backend storing with index_copy_ (the path before the fusion): hidden
    states and caches bit for bit, for a decode batch and a mixed prefill + decode batch; fewer kernels per layer
    (rope_ and one index_copy_; the residual LM: one index_copy_)."""
    from engine.model import attention_triton

    def rope_then_store(q, k, v, k_cache, v_cache, meta, rope):  # before the fusion: rope_, two index_copy_
        q, k = rotate(q, k, rope)
        store_kv(k, v, k_cache, v_cache, meta)
        return q

    cfg = ModelConfig.from_dict(voxcpm2())
    stack = cfg.lm if name == "base LM" else cfg.residual_lm
    model, backend = random_stack(stack, cuda), attention_triton.TritonAttention()
    blocks = [list(range(8 * j, 8 * j + 8)) for j in range(len(query_lens))]
    meta = AttentionMetadata.build(query_lens, cached_lens, blocks, 16, cuda)
    positions = meta.positions()
    gen = torch.Generator(cuda).manual_seed(len(query_lens))
    x = torch.randn(sum(query_lens), stack.hidden_size, device=cuda, generator=gen).bfloat16()
    fused_cache, ref_cache = (KVCache.allocate(stack, 8 * len(query_lens), 16, cuda, torch.bfloat16) for _ in "ab")
    for mine, theirs in ((fused_cache.k, ref_cache.k), (fused_cache.v, ref_cache.v)):
        theirs.copy_(mine.normal_(generator=gen))

    def rope_first() -> torch.Tensor:
        rope = None if model.rope is None else model.rope(positions)
        with mock.patch.object(attention_triton, "rope_and_store_kv", rope_then_store):
            return model.run(x, rope, lambda i, q, k, v: backend(q, k, v, ref_cache.k[i], ref_cache.v[i], meta))

    def fused() -> torch.Tensor:
        return model.forward_paged(x, positions, meta, fused_cache, backend)

    out, ref = fused(), rope_first()
    assert torch.equal(out, ref), f"max abs difference {(out - ref).abs().max().item()}"
    assert torch.equal(fused_cache.k, ref_cache.k) and torch.equal(fused_cache.v, ref_cache.v)
    saved = kernel_count(rope_first) - kernel_count(fused)
    print(f"\n{name} {query_lens}: {saved} kernels fewer per step ({len(model.layers)} layers)")
    assert saved >= (1 if model.rope is None else 2) * len(model.layers)
