"""`lora_linear` (the base GEMM and the per-row LoRA in one Triton launch) on CPU under TRITON_INTERPRET=1 ==
F.linear + `lora_delta_add`: every row one adapter (a LocDiT sequence: two index entries of several tokens), mixed
adapters with slot-0 rows, q|k|v parts whose column tiles end inside a part, ranks below the slot width, one row, K
split over several programs (the last arrival summing the partials, also a few planes at a time), in fp32 and fp16
(bf16 dots are wrong in the interpreter). Then the switch: `fused_linear` on the tiny model gives the unfused path's
patches, `linear_with_lora` an o_proj's output with its hook, and nothing runs the kernel while the switch is off.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from engine.model.lora import lora_delta_add
from tests.conftest import interpreted

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


@pytest.fixture(scope="module")
def kernels():
    """engine.model.lora_triton, (re)imported with the interpreter on."""
    with interpreted("engine.model.lora_triton") as (module,):
        yield module


CASES = {  # name: (slot of each index row, tokens per index row, in, outs, slot width r_max, adapter rank)
    "dit_one_adapter": ([2, 2], 5, 96, (150, 24, 40), 8, 8),  # a LocDiT sequence: CFG's two entries, one slot
    "mixed_with_slot0": ([2, 0, 1, 3, 3, 1, 0], 1, 72, (100, 20, 20), 8, 5),  # three adapters and slot-0 rows
    "dit_mixed": ([1, 3, 0, 1, 3, 0], 3, 64, (70,), 16, 3),
    "one_row": ([3], 1, 40, (24,), 4, 4),
    "split_k_one_row": ([1], 1, 700, (130, 8, 8), 8, 8),  # K 700: 6 (fp16) or 11 (fp32) splits, the last ragged
    "split_k_many_rows": ([1] * 60 + [0, 2] * 20, 1, 300, (40,), 8, 6),  # 128-row tile: one plane summed at a time
}


def make(case: str, dtype: torch.dtype):
    slots, per, fan_in, outs, width, rank = CASES[case]
    gen = torch.Generator().manual_seed(len(slots) * 31 + fan_in)
    index, rows, fan_out = torch.tensor(slots), len(slots) * per, sum(outs)
    a = torch.zeros(4, width * len(outs), fan_in)
    b = torch.zeros(4, fan_out, width)
    for j in range(len(outs)):  # each part's rank block, zero past the adapter's rank
        a[1:, j * width:j * width + rank] = torch.randn(3, rank, fan_in, generator=gen) / fan_in ** 0.5
    b[1:, :, :rank] = torch.randn(3, fan_out, rank, generator=gen) / rank ** 0.5
    x, w = torch.randn(rows, fan_in, generator=gen), torch.randn(fan_out, fan_in, generator=gen) / fan_in ** 0.5
    x, w, a, b = (t.to(dtype) for t in (x, w, a, b))
    ref = lora_delta_add(F.linear(x.double(), w.double()).view(len(slots), per, fan_out),
                         x.double().view(len(slots), per, fan_in), a.double(), b.double(), index,
                         outs).view(rows, fan_out)
    return x, w, a, b, index, per, outs, ref


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lora_linear_equals_linear_plus_lora(kernels, case: str, dtype: torch.dtype) -> None:
    x, w, a, b, index, per, outs, ref = make(case, dtype)
    seg = kernels.segment_rows(index, per, a.shape[0])
    y = kernels.lora_linear(x, w, a, b, index, per, outs if len(outs) > 1 else None, seg)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert y.dtype == dtype and y.shape == ref.shape
    assert (y.double() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())
    base = torch.tensor([s == 0 for s in CASES[case][0]]).repeat_interleave(per)
    if base.any():  # slot-0 rows: the linear alone
        assert (y[base].double() - F.linear(x[base].double(), w.double())).abs().max().item() <= tol * 10
    assert (y[~base].double() - F.linear(x[~base].double(), w.double())).abs().max() > 1e-2  # adapters add
    assert not seg.counters.any()  # each last arrival reset its column tile's counter


def test_the_split_cases_split_k(kernels) -> None:
    """The split cases really split K (else the planes and counters are not tested), the many-rows one sums fewer
    planes at a time than it has."""
    for case, splits in (("split_k_one_row", 11), ("split_k_many_rows", 5)):
        fan_in, outs = CASES[case][2], CASES[case][3]
        split = kernels.plan(fan_in, kernels.col_tiles(outs, kernels.LINEAR_BLOCK_N), torch.device("cpu"),
                             kernels.LINEAR_BLOCK_K // 2, kernels.LINEAR_PER_SM)  # fp32: half the K step
        assert split.splits == splits
    assert len(CASES["split_k_many_rows"][0]) > 64  # a 128-row tile
    assert kernels.LINEAR_PLANE_ELEMENTS // (128 * kernels.LINEAR_BLOCK_N) < 3


def test_no_adapter_is_the_linear(kernels) -> None:
    x, w = torch.randn(9, 200), torch.randn(70, 200)
    a, b = torch.randn(3, 8, 200), torch.randn(3, 70, 8)
    y = kernels.lora_linear(x, w, a, b, torch.zeros(9, dtype=torch.long), 1)
    torch.testing.assert_close(y, F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_value_errors(kernels) -> None:
    x, w, a, b, index = torch.randn(4, 16), torch.randn(24, 16), torch.randn(3, 4, 16), torch.randn(3, 24, 4), \
        torch.ones(4, dtype=torch.long)
    with pytest.raises(ValueError, match="linear shapes"):
        kernels.lora_linear(x, torch.randn(24, 8), a, b, index, 1)
    with pytest.raises(ValueError, match="LoRA shapes"):
        kernels.lora_linear(x, w, a, b, index, 1, (16, 4, 4))  # three parts need A's 3 rank blocks
    with pytest.raises(ValueError, match="rows"):
        kernels.lora_linear(x, w, a, b, index[:3], 1)
    big = kernels.LINEAR_MAX_ROWS + 1
    with pytest.raises(ValueError, match="rows"):
        kernels.lora_linear(torch.randn(big, 16), w, a, b, torch.ones(big, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="strides"):
        kernels.lora_linear(x.t().contiguous().t(), w, a, b, index, 1)


def test_linear_applies_at_decode_sizes_with_the_switch_on(kernels, monkeypatch) -> None:
    x, w, index = torch.randn(22, 64), torch.randn(96, 64), torch.ones(2, dtype=torch.long)
    assert kernels.FUSED_GEMM_MAX_ROWS == 0 and not kernels.linear_applies(x, w, index, 33)  # off by default
    monkeypatch.setattr(kernels, "FUSED_GEMM_MAX_ROWS", 64)
    assert kernels.linear_applies(x, w, index, 33)
    assert not kernels.linear_applies(torch.randn(65, 64), w, torch.ones(65, dtype=torch.long), 33)  # past the switch
    monkeypatch.setattr(kernels, "FUSED_GEMM_MAX_ROWS", 10 ** 6)
    assert not kernels.linear_applies(torch.randn(129, 64), w, torch.ones(129, dtype=torch.long), 33)  # the kernel's
    entries = kernels.LINEAR_MAX_ADAPTERS + 1
    assert not kernels.linear_applies(torch.randn(entries, 64), w, torch.ones(entries, dtype=torch.long), 33)
    assert kernels.linear_applies(torch.randn(entries, 64), w, torch.ones(entries, dtype=torch.long), 3)  # 2 slots
    assert not kernels.linear_applies(x, w.double(), index, 33)
    assert not kernels.linear_applies(x.t().contiguous().t(), w, index, 33)


@pytest.fixture(scope="module")
def tiny_lora_model(kernels):
    """The tiny VoxCPM2 with q|k|v fused (LoRA kept on the one GEMM) and random adapters in slots 1-3."""
    from engine.config import ModelConfig
    from engine.model.layers import fused_weight
    from engine.model.lora import attach_lora
    from engine.model.voxcpm import VoxCPMModel
    from engine.model_configs import tiny

    torch.manual_seed(0)
    model = VoxCPMModel(ModelConfig.from_dict(tiny("voxcpm2"))).eval()
    state = attach_lora(model, 3, 8)
    model.fuse_projections()
    attn = model.feat_decoder.estimator.decoder.layers[0].self_attn
    assert fused_weight(attn.qkv, (attn.q_proj, attn.k_proj, attn.v_proj)) is not None
    gen = torch.Generator().manual_seed(1)
    for layer in state.layers.values():
        layer.lora_A[1:].copy_(torch.randn(layer.lora_A[1:].shape, generator=gen) * 0.3)
        layer.lora_B[1:].copy_(torch.randn(layer.lora_B[1:].shape, generator=gen) * 0.3)
    return model


def test_fused_linear_with_the_kernel_equals_the_unfused_path(kernels, tiny_lora_model, monkeypatch) -> None:
    """sample_patches with the switch on (the LocDiT's q|k|v through `lora_linear`) == off (F.linear, then the torch
    LoRA); the kernel really ran, and the adapters matter."""
    model = tiny_lora_model
    b, p, d, h = 3, model.config.patch_size, model.config.feat_dim, model.config.lm.hidden_size
    gen = torch.Generator().manual_seed(2)
    lm_h, res_h = torch.randn(b, h, generator=gen), torch.randn(b, h, generator=gen)
    cond, noise = torch.randn(b, p, d, generator=gen), torch.randn(b, d, p, generator=gen)

    def patches(seqs: list[int]) -> torch.Tensor:
        model.set_lora_indices(seqs=torch.tensor(seqs))
        with torch.inference_mode():
            return model.sample_patches(lm_h, res_h, cond, noise, 3, torch.full((b,), 2.0))

    launches = []
    run = kernels.lora_linear
    monkeypatch.setattr(kernels, "lora_linear", lambda *args, **kw: launches.append(1) or run(*args, **kw))
    off = patches([1, 0, 3])
    assert not launches
    monkeypatch.setattr(kernels, "FUSED_GEMM_MAX_ROWS", 128)
    on = patches([1, 0, 3])
    assert launches
    torch.testing.assert_close(on, off, atol=1e-4, rtol=1e-4)
    assert (patches([0, 0, 0]) - on).abs().max() > 1e-3


def test_linear_with_lora_equals_the_hooked_linear(kernels, tiny_lora_model, monkeypatch) -> None:
    """An LM o_proj at decode rows: the kernel gives what the module with its LoRA hook gives; without indices or
    under bypass it is the plain linear."""
    from engine.model.lora import linear_with_lora

    model = tiny_lora_model
    o_proj = model.base_lm.layers[0].self_attn.o_proj
    x = torch.randn(5, o_proj.in_features, generator=torch.Generator().manual_seed(3))
    model.set_lora_indices(tokens=torch.tensor([2, 0, 1, 3, 2]))
    with torch.inference_mode():
        hooked = o_proj(x)
        monkeypatch.setattr(kernels, "FUSED_GEMM_MAX_ROWS", 128)
        fused = linear_with_lora(o_proj, x)
        torch.testing.assert_close(fused, hooked, atol=1e-5, rtol=1e-5)
        assert (hooked - F.linear(x, o_proj.weight)).abs().max() > 1e-3
        model.lora.bypass = True
        try:
            torch.testing.assert_close(linear_with_lora(o_proj, x), F.linear(x, o_proj.weight))
        finally:
            model.lora.bypass = False


def test_kernels_module_is_the_interpreted_one(kernels) -> None:
    assert sys.modules["engine.model.lora_triton"] is kernels and kernels._interpreted()
