"""The LocDiT attention's LoRA inside the short attention kernel (engine.model.lora_triton.AttentionLoRA), on CPU
under TRITON_INTERPRET=1: q|k|v's expand done by the kernel before it attends == the expand kernel on the fused qkv
output, then the kernel without LoRA; and its per-kv-head shrink planes of the output sum to o_proj's LoRA shrink.
Sequences mix adapters with slot 0 (no adapter), a rank below the slot width, with and without RoPE. fp32 and fp16
(the interpreter's bf16 tl.dot is wrong, see tests/test_kernels_interpret.py)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import interpreted

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


@pytest.fixture(scope="module")
def modules():
    """(lora_triton, attention_triton) with the interpreter on; the helpers they call reloaded first."""
    with interpreted("engine.kernels", "engine.model.lora_triton", "engine.model.attention_triton") as loaded:
        yield loaded[1], loaded[2]


def rope_table(length: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(length).float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * 1.2, emb.sin() * 1.2


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lora_in_attention_equals_expand_then_attention(modules, rope: bool, dtype: torch.dtype) -> None:
    lora_triton, attention_triton = modules
    gen = torch.Generator().manual_seed(7)
    slots = torch.tensor([2, 0, 1, 2, 0, 1])  # CFG-like: conditional rows, then unconditional ones
    seqs, length, q_heads, kv_heads, head_dim, hidden, width, rank = 6, 5, 4, 2, 16, 24, 8, 5
    num_slots, heads = 3, q_heads + 2 * kv_heads
    rows, n = seqs * length, heads * head_dim

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    a_qkv, b_qkv = rand(num_slots, 3 * width, hidden, scale=0.2), rand(num_slots, n, width, scale=0.3)
    a_o = rand(num_slots, width, q_heads * head_dim, scale=0.2)
    for t in (a_qkv, b_qkv, a_o):
        t[0] = 0  # slot 0: no adapter
    a_qkv.view(num_slots, 3, width, hidden)[:, :, rank:] = 0  # rank 5 in slots of width 8
    b_qkv[:, :, rank:] = 0
    a_o[:, rank:] = 0
    x, qkv = rand(rows, hidden), rand(rows, n)
    seg = lora_triton.segment_rows(slots, length, num_slots)
    t = lora_triton.lora_shrink(x, a_qkv, 3, width, seg)
    table = rope_table(length, head_dim) if rope else None

    def views(y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y4 = y.view(seqs, length, heads, head_dim)
        return y4[:, :, :q_heads], y4[:, :, q_heads:q_heads + kv_heads], y4[:, :, q_heads + kv_heads:]

    ours_qkv = qkv.clone()
    lora = lora_triton.AttentionLoRA.make(slots, t, b_qkv, a_o, kv_heads)
    ours = attention_triton.short_attention(*views(ours_qkv), table, lora)

    ref_qkv = qkv.clone()
    lora_triton.lora_expand_(ref_qkv, t, b_qkv, (q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), seg)
    ref = attention_triton.short_attention(*views(ref_qkv), table)

    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(ours_qkv, ref_qkv, rtol=tol, atol=tol)  # q|k|v hold their deltas, as after an expand
    assert not torch.equal(ref_qkv, qkv)  # the adapters did act
    torch.testing.assert_close(ours, ref, rtol=2 * tol, atol=2 * tol)
    live = (slots != 0).repeat_interleave(length)
    assert torch.equal(ours_qkv[~live], qkv[~live])  # slot-0 sequences untouched
    # o_proj's shrink: the kv heads' planes sum to (attention output) @ A_o[slot]^T on the rows with an adapter
    want = torch.einsum("mk,mrk->mr", ours.reshape(rows, -1).double(),
                        a_o.double()[slots.repeat_interleave(length)])[live]
    got = lora.o_t[:, live, :width].sum(0).double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seqs", [3, 1])
def test_locdit_stack_with_lora_in_attention_equals_the_hooks(modules, monkeypatch, seqs: int) -> None:
    """The LocDiT stack of a tiny VoxCPM2 with LoRA on its q/k/v/o, sequences mixing adapters and none (CFG rows:
    the slots twice), fp32: on the fused path (every CUDA kernel, interpreted) each layer's LoRA runs inside the
    attention kernel, and the output equals the eager stack's, whose linears add their LoRA through hooks. With
    the bypass on, no layer passes a LoRA to the kernel."""
    from engine.config import ModelConfig
    from engine.model import layers
    from engine.model import lora as lora_module
    from engine.model.lora import attach_lora
    from engine.model.voxcpm import VoxCPMModel
    from engine.model_configs import tiny

    _, attention_triton = modules
    torch.manual_seed(3)
    model = VoxCPMModel(ModelConfig.from_dict(tiny("voxcpm2"))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    model.fuse_projections()
    state = attach_lora(model, num_adapters=3, max_rank=4)
    gen = torch.Generator().manual_seed(5)
    for slot, rank in ((1, 4), (2, 2), (3, 3)):
        state.load_slot(slot, {path: (torch.randn(layer.lora_A.shape[1:], generator=gen) * 0.3,
                                      torch.randn(layer.lora_B.shape[1:], generator=gen) * 0.3)
                               for path, layer in state.layers.items()})
        for layer in state.layers.values():  # this adapter's rank, in the zero-padded slot
            layer.lora_A[slot, rank:] = 0
    stack = model.feat_decoder.estimator.decoder
    slots = torch.tensor([2, 0, 1][:seqs])
    state.dit = torch.cat((slots, slots))
    x = torch.randn(2 * seqs, 11, stack.norm.weight.shape[0], generator=gen)
    with torch.no_grad():
        ref = stack.forward_dense(x)
        seen = []
        kernel = attention_triton.short_attention
        monkeypatch.setattr(attention_triton, "short_attention",
                            lambda *a: seen.append(a[4] is not None) or kernel(*a))
        monkeypatch.setattr(layers, "fused", lambda t: True)  # the CUDA dispatch, on CPU tensors
        monkeypatch.setattr(lora_module, "fused", lambda t: True)
        out = stack.forward_dense(x)
        assert seen == [True] * len(stack.layers)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        state.bypass, seen[:] = True, []
        base = stack.forward_dense(x)
        assert seen == [False] * len(stack.layers)
        assert (base - out).abs().max() > 1e-2  # the adapters did act
