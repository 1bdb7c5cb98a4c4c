"""LoRA on the GPU: the Triton shrink/expand kernels == the torch gather/bmm path at real VoxCPM2 shapes (bf16 and
fp32; one linear and the fused q/k/v), a CUDA graph (row grouping included) replays with new slots and with none, and
the tiny model's LoRA step on CUDA (fused q/k/v GEMM kept) equals the CPU one."""

from __future__ import annotations

import pytest
import torch

from engine.model.lora import lora_delta_add
from engine.model.lora_triton import lora_add_


def case(rows: int, per: int, fan_in: int, fan_out: int, width: int, dtype: torch.dtype, slots: list[int]):
    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + fan_in)
    s = max(slots) + 1
    a = torch.randn(s, width, fan_in, device="cuda", generator=gen) / fan_in ** 0.5
    b = torch.randn(s, fan_out, width, device="cuda", generator=gen) / width ** 0.5
    a[0], b[0] = 0, 0
    x = torch.randn(rows * per, fan_in, device="cuda", generator=gen)
    y = torch.randn(rows * per, fan_out, device="cuda", generator=gen)
    index = torch.tensor(slots, device="cuda")
    return (t.to(dtype) for t in (x, y, a, b)), index


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "per", "fan_in", "fan_out", "pattern"), [
    (256, 1, 2048, 2048, "decode"),     # VoxCPM2 q_proj, one decode row per sequence, 256 sequences
    (1024, 1, 2048, 512, "prefill"),    # k_proj over four 256-token prefill chunks
    (128, 10, 1024, 1024, "dit"),       # LocDiT rows: 2 x 64 sequences, 10 tokens each
])
def test_triton_matches_torch(cuda, dtype, rows, per, fan_in, fan_out, pattern) -> None:
    if pattern == "prefill":
        slots = [i // 256 for i in range(rows)]
    else:
        slots = [(i * 7) % 33 for i in range(rows)]
    (x, y, a, b), index = case(rows, per, fan_in, fan_out, 32, dtype, slots)
    ref = lora_delta_add(y.float().view(rows, per, -1), x.float().view(rows, per, -1), a.float(), b.float(),
                         index).view(rows * per, -1)
    out = y.clone()
    lora_add_(out, x, a, b, index, per)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert (out.float() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_qkv_matches_torch(cuda, dtype) -> None:
    outs, rank = (2048, 512, 512), 32  # VoxCPM2 base LM q/k/v
    slots = [(i * 7) % 33 for i in range(64)] + [5] * 40  # decode rows, then a prefill chunk of one adapter
    (x, y, a, b), index = case(len(slots), 1, 2048, sum(outs), rank, dtype, slots)
    a = torch.randn(a.shape[0], 3 * rank, 2048, device="cuda", dtype=dtype) / 2048 ** 0.5
    a[0] = 0
    ref = lora_delta_add(y.float(), x.float(), a.float(), b.float(), index, outs)
    out = y.clone()
    lora_add_(out, x, a, b, index, 1, outs)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert (out.float() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def test_graph_replays_with_new_slots(cuda) -> None:
    (x, y, a, b), index = case(64, 1, 512, 512, 16, torch.bfloat16, [i % 5 for i in range(64)])
    out = torch.empty_like(y)

    def body() -> None:
        out.copy_(y)
        lora_add_(out, x, a, b, index, 1)

    body()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for shift in (1, 3):
        index.copy_(torch.tensor([(i + shift) % 5 for i in range(64)], device="cuda"))
        graph.replay()
        expected = y.clone()
        lora_add_(expected, x, a, b, index, 1)
        torch.testing.assert_close(out, expected)
    index.zero_()  # a step without adapters: the programs exit, y stays the linear's output
    graph.replay()
    assert torch.equal(out, y)


def test_tiny_model_step_on_cuda_equals_cpu(cuda) -> None:
    from engine.config import ModelConfig
    from engine.model.layers import fused_weight
    from engine.model.lora import attach_lora
    from engine.model.voxcpm import VoxCPMModel
    from engine.model_configs import tiny

    torch.manual_seed(0)
    cpu = VoxCPMModel(ModelConfig.from_dict(tiny("voxcpm2"))).eval()
    state = attach_lora(cpu, 3, 8)
    gen = torch.Generator().manual_seed(1)
    for layer in state.layers.values():
        layer.lora_A[1:].copy_(torch.randn(layer.lora_A[1:].shape, generator=gen) * 0.1)
        layer.lora_B[1:].copy_(torch.randn(layer.lora_B[1:].shape, generator=gen) * 0.1)
    gpu = VoxCPMModel(cpu.config).eval()
    gpu.load_state_dict(cpu.state_dict())
    gpu_state = attach_lora(gpu.to("cuda"), 3, 8)
    gpu.fuse_projections()
    attn = gpu.feat_decoder.estimator.decoder.layers[0].self_attn
    assert fused_weight(attn.qkv, (attn.q_proj, attn.k_proj, attn.v_proj)) is not None  # LoRA keeps one GEMM
    for path, layer in gpu_state.layers.items():
        layer.lora_A.copy_(state.layers[path].lora_A)
        layer.lora_B.copy_(state.layers[path].lora_B)
    b, p, d, h = 4, cpu.config.patch_size, cpu.config.feat_dim, cpu.config.lm.hidden_size
    lm_h, res_h = torch.randn(b, h), torch.randn(b, h)
    cond, noise = torch.randn(b, p, d), torch.randn(b, d, p)
    seqs = torch.tensor([0, 1, 2, 3])
    outs = []
    for model, dev in ((cpu, "cpu"), (gpu, "cuda")):
        model.set_lora_indices(seqs=seqs.to(dev))
        with torch.inference_mode():
            outs.append(model.sample_patches(lm_h.to(dev), res_h.to(dev), cond.to(dev), noise.to(dev), 4,
                                             torch.full((b,), 2.0, device=dev)).cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-3, rtol=1e-3)
