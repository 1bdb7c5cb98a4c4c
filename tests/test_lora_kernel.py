"""The Triton batched-LoRA kernels on CPU under TRITON_INTERPRET=1 == the torch gather/bmm path.

Cases cover blocks where every row shares one adapter (full tiles: prefill chunks), blocks mixing adapters and
slot 0 (partial tiles with masked rows: decode rows), LocDiT-style rows repeating one index over several tokens, ranks
below the slot width (zero padding), ragged sizes, and K split over several programs (one decode row: 9 splits of two
K blocks, the last one ragged), each through every variant (`VARIANTS`: two launches, shrink and expand, at several
tiles; one launch walking all of K; one launch with K split and the last arrival adding) and the legacy `fused` flag,
and which one `choose` picks. The split kernel's counters are back to zero after each linear (segments shared by the
linears of a step stay usable). PDL is a GPU launch attribute: in the interpreter its variant runs without it. Needs
`triton` installed (the test extras pin it).
"""

from __future__ import annotations

import sys

import pytest
import torch

from engine.model import lora_triton as _collected
from engine.model.lora import lora_delta_add
from tests.conftest import interpreted

VARIANTS = list(_collected.VARIANTS)  # names only: the kernels run from the module the fixture re-imports

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


@pytest.fixture(scope="module")
def lora_add_():
    """The kernel, (re)imported with the interpreter on."""
    with interpreted("engine.model.lora_triton") as (module,):
        yield module.lora_add_


CASES = {  # name: (slot of each index row, tokens per index row, in, out, slot width r_max, adapter rank)
    "prefill_uniform_blocks": ([1] * 20 + [2] * 16 + [0] * 5, 1, 40, 70, 8, 8),
    "decode_mixed": ([2, 0, 1, 3, 3, 1, 0, 2, 1], 1, 24, 33, 16, 5),
    "dit_rows": ([1, 3, 0, 1, 3, 0], 5, 16, 20, 8, 3),
    "one_row": ([3], 1, 64, 128, 4, 4),
    "split_k_one_row": ([3], 1, 1100, 24, 8, 8),
    "split_k_decode_mixed": ([2, 0, 1, 3, 3, 1, 0, 2, 1], 1, 200, 33, 8, 5),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("how", [*VARIANTS, "fused=False", "fused=True"])
def test_kernel_matches_torch(lora_add_, case: str, dtype: torch.dtype, how: str) -> None:
    slots, per, fan_in, fan_out, width, rank = CASES[case]
    choice = {"fused": how == "fused=True"} if how.startswith("fused=") else {"variant": how}
    gen = torch.Generator().manual_seed(len(slots) * 31 + per)
    index = torch.tensor(slots)
    rows = len(slots) * per
    a = torch.zeros(4, width, fan_in)
    b = torch.zeros(4, fan_out, width)
    a[1:, :rank] = torch.randn(3, rank, fan_in, generator=gen) / fan_in ** 0.5
    b[1:, :, :rank] = torch.randn(3, fan_out, rank, generator=gen) / rank ** 0.5
    x = torch.randn(rows, fan_in, generator=gen)
    y = torch.randn(rows, fan_out, generator=gen)
    x, y, a, b = (t.to(dtype) for t in (x, y, a, b))
    ref = lora_delta_add(y.double().view(len(slots), per, fan_out), x.double().view(len(slots), per, fan_in),
                         a.double(), b.double(), index).view(rows, fan_out)
    out = y.clone()
    lora_add_(out, x, a, b, index, per, **choice)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert (out.double() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())
    base = torch.tensor([s == 0 for s in slots]).repeat_interleave(per)
    assert torch.equal(out[base], y[base])  # slot 0 rows are the linear's output, bit for bit
    assert (out[~base].double() - y[~base].double()).abs().max() > 1e-2  # and adapters do change the others


@pytest.fixture(scope="module")
def kernels(lora_add_):
    return sys.modules["engine.model.lora_triton"]


FUSED = {  # name: (slot of each row, in, outs of the linears sharing x, rank)
    "qkv_decode_mixed": ([1, 0, 2, 2, 1, 3], 24, (40, 24, 24), 4),
    "qkv_prefill_blocks": ([2] * 17 + [1] * 3, 32, (64, 16, 16), 8),
    "gate_up": ([3, 1, 0, 1], 16, (70, 70), 4),
}


@pytest.mark.parametrize("case", FUSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("variant", ["two", "one", "split", "split_n64"])
def test_fused_kernel_equals_each_linear_alone(lora_add_, case: str, dtype: torch.dtype, variant: str) -> None:
    """One shrink over stacked A's + one expand into the fused output == each linear's LoRA on its own columns."""
    slots, fan_in, outs, rank = FUSED[case]
    gen = torch.Generator().manual_seed(len(slots) + fan_in)
    index = torch.tensor(slots)
    a = torch.randn(4, rank * len(outs), fan_in, generator=gen) / fan_in ** 0.5
    b = torch.randn(4, sum(outs), rank, generator=gen) / rank ** 0.5
    a[0], b[0] = 0, 0
    x = torch.randn(len(slots), fan_in, generator=gen)
    y = torch.randn(len(slots), sum(outs), generator=gen)
    x, y, a, b = (t.to(dtype) for t in (x, y, a, b))
    parts, start = [], 0
    for j, n in enumerate(outs):
        alone = lora_delta_add(y[:, start:start + n].double(), x.double(), a[:, j * rank:(j + 1) * rank].double(),
                               b[:, start:start + n].double(), index)
        parts.append(alone)
        start += n
    ref = torch.cat(parts, dim=1)
    out = y.clone()
    lora_add_(out, x, a, b, index, 1, outs, variant=variant)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert (out.double() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())
    torch.testing.assert_close(lora_delta_add(y.double(), x.double(), a.double(), b.double(), index, outs), ref)


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_adapter_rows_leave_y_untouched(lora_add_, variant: str) -> None:
    x, y = torch.randn(37, 300), torch.randn(37, 40)  # K 300: the split variants split it
    a, b = torch.randn(3, 8, 300), torch.randn(3, 40, 8)
    out = y.clone()
    lora_add_(out, x, a, b, torch.zeros(37, dtype=torch.long), 1, variant=variant)
    assert torch.equal(out, y)


ONE_LAUNCH = {  # name: (slot of each index row, tokens per index row, in, outs, slot width r_max, adapter rank)
    # LocDiT-like: q spans two column tiles of the one-launch kernel, K ragged (136 = 128 + 8), rank 5 of 8
    "qkv_dit_rows": ([2, 0, 1, 2, 3, 0], 3, 136, (150, 24, 40), 8, 5),
    "o_one_row": ([3], 1, 300, (24,), 4, 4),  # K 300: two full K steps and a ragged one
    "gate_up_full_tile": ([1] * 18 + [0, 2], 1, 48, (70, 70), 16, 16),  # slot 1: a full tile and a partial one
}


@pytest.mark.parametrize("case", ONE_LAUNCH)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_launch_equals_two_launches_and_torch(lora_add_, case: str, dtype: torch.dtype) -> None:
    """Each column tile's part uses its own rank block of A (zero-padded past the adapter's rank); both paths give
    lora_delta_add's result, slot-0 rows stay bit for bit."""
    slots, per, fan_in, outs, width, rank = ONE_LAUNCH[case]
    gen = torch.Generator().manual_seed(fan_in + per)
    index = torch.tensor(slots)
    rows, fan_out = len(slots) * per, sum(outs)
    a = torch.zeros(4, width * len(outs), fan_in)
    b = torch.zeros(4, fan_out, width)
    for j in range(len(outs)):
        a[1:, j * width:j * width + rank] = torch.randn(3, rank, fan_in, generator=gen) / fan_in ** 0.5
    b[1:, :, :rank] = torch.randn(3, fan_out, rank, generator=gen) / rank ** 0.5
    x, y = torch.randn(rows, fan_in, generator=gen), torch.randn(rows, fan_out, generator=gen)
    x, y, a, b = (t.to(dtype) for t in (x, y, a, b))
    ref = lora_delta_add(y.double().view(len(slots), per, fan_out), x.double().view(len(slots), per, fan_in),
                         a.double(), b.double(), index, outs).view(rows, fan_out)
    one, two = y.clone(), y.clone()
    lora_add_(one, x, a, b, index, per, outs, fused=True)
    lora_add_(two, x, a, b, index, per, outs, fused=False)
    tol = (1e-5 if dtype == torch.float32 else 3e-3) * max(1.0, ref.abs().max().item())
    assert (one.double() - ref).abs().max().item() <= tol
    assert (two.double() - ref).abs().max().item() <= tol
    assert (one.double() - two.double()).abs().max().item() <= tol
    base = torch.tensor([s == 0 for s in slots]).repeat_interleave(per)
    assert torch.equal(one[base], y[base])
    assert (one[~base].double() - y[~base].double()).abs().max() > 1e-2


def test_segments_group_rows_by_slot(kernels) -> None:
    index = torch.tensor([2, 0, 1, 2, 2, 1, 0])
    seg = kernels.segment_rows(index, 3, 4)
    slots = index.repeat_interleave(3)
    assert seg.order.tolist() == sorted(range(21), key=lambda m: (slots[m].item(), m))
    counts = [int((slots == s).sum()) for s in range(4)]
    assert seg.starts.tolist() == [sum(counts[:s]) for s in range(5)]
    tiles = [0] + [-(-c // kernels.BLOCK_M) for c in counts[1:]]  # slot 0 rows get no tile
    assert seg.tiles.tolist() == [sum(tiles[:s]) for s in range(5)]
    assert seg.grid >= seg.tiles[-1].item()
    assert seg.counters.shape == (seg.grid * kernels.COUNTER_COLS,) and not seg.counters.any()


def test_tile_table_lists_each_tiles_slot_and_rows(kernels) -> None:
    """Tile i's entries, slot << SLOT_SHIFT | row + 1: the slot whose tiles cover i and its BLOCK_M rows from `order`
    (-1 past them); past the last tile, slot S (none) and no rows. 40 rows of slot 1 take three tiles, the last one
    partial."""
    index = torch.tensor([1] * 40 + [0, 3, 3, 0, 2])
    seg = kernels.segment_rows(index, 1, 5)
    expected_slots, expected_rows = [], []
    for slot in range(1, 5):
        rows = seg.order[seg.starts[slot]:seg.starts[slot + 1]].tolist()
        for first in range(0, len(rows), kernels.BLOCK_M):
            chunk = rows[first:first + kernels.BLOCK_M]
            expected_slots.append(slot)
            expected_rows.append(chunk + [-1] * (kernels.BLOCK_M - len(chunk)))
    spare = seg.grid - len(expected_slots)
    assert spare >= 0
    assert seg.table.dtype == torch.int32 and seg.table.shape == (seg.grid, kernels.BLOCK_M)
    shift = kernels.SLOT_SHIFT
    assert (seg.table >> shift).tolist() == [[slot] * kernels.BLOCK_M for slot in expected_slots + [5] * spare]
    assert ((seg.table & ((1 << shift) - 1)) - 1).tolist() == expected_rows + [[-1] * kernels.BLOCK_M] * spare


@pytest.mark.parametrize("variant", ["split", "split_n64", "split_4sm"])
def test_split_counters_reset_for_the_next_linear(kernels, variant: str) -> None:
    """The last arrival of each (tile, column tile) zeroes its counter: q|k|v then o sharing one segments, twice,
    each equal to the reference; the K really is split (else the counters are never touched)."""
    gen = torch.Generator().manual_seed(7)
    index, fan_in = torch.tensor([2, 0, 1, 2, 2, 1, 0]), 600
    seg = kernels.segment_rows(index, 3, 4)
    tiles = kernels.col_tiles((40, 8, 8), kernels.VARIANTS[variant].block_n)
    v = kernels.VARIANTS[variant]
    assert kernels.plan(fan_in, seg.grid * tiles, torch.device("cpu"), v.block_k, v.per_sm).splits > 1
    x = torch.randn(21, fan_in, generator=gen)
    a_qkv, b_qkv = torch.randn(4, 12, fan_in, generator=gen) / fan_in ** 0.5, torch.randn(4, 56, 4, generator=gen)
    a_o, b_o = torch.randn(4, 4, 40, generator=gen) / 40 ** 0.5, torch.randn(4, 24, 4, generator=gen)
    for w in (a_qkv, b_qkv, a_o, b_o):
        w[0] = 0  # slot 0: no adapter
    for _ in range(2):
        qkv, o = torch.zeros(21, 56), torch.zeros(21, 24)
        kernels.lora_add_(qkv, x, a_qkv, b_qkv, index, 3, (40, 8, 8), seg, variant=variant)
        kernels.lora_add_(o, qkv[:, :40], a_o, b_o, index, 3, None, seg, variant=variant)
        assert not seg.counters.any()
        ref_qkv = lora_delta_add(torch.zeros(7, 3, 56), x.view(7, 3, -1), a_qkv, b_qkv, index, (40, 8, 8))
        torch.testing.assert_close(qkv, ref_qkv.view(21, 56), atol=1e-4, rtol=1e-4)
        ref_o = lora_delta_add(torch.zeros(7, 3, 24), qkv[:, :40].reshape(7, 3, 40), a_o, b_o, index)
        torch.testing.assert_close(o, ref_o.view(21, 24), atol=1e-4, rtol=1e-4)


def test_k_splits_used_by_the_split_cases(kernels) -> None:
    """The split_k cases really split K (else they test nothing new)."""
    for case, splits in (("split_k_one_row", 9), ("split_k_decode_mixed", 4)):
        slots, per, fan_in = CASES[case][:3]
        seg = kernels.segment_rows(torch.tensor(slots), per, 4)
        assert kernels.plan(fan_in, seg.grid, torch.device("cpu")).splits == splits


@pytest.mark.parametrize("k", [16, 100, 1024, 2048, 4096])
@pytest.mark.parametrize("grid", [1, 4, 36, 120, 300])
def test_plan_covers_k_once_and_fills_the_gpu(kernels, k: int, grid: int) -> None:
    splits, per = kernels.plan(k, grid, torch.device("cpu"))
    assert per % kernels.BLOCK_K == 0 and 1 <= splits <= kernels.MAX_SPLITS
    assert (splits - 1) * per < k <= splits * per  # every split has columns, together all of K
    chunks = -(-k // kernels.BLOCK_K)
    if splits < min(chunks, kernels.MAX_SPLITS):  # not capped: enough programs for the SMs
        assert grid * splits >= kernels.PROGRAMS_PER_SM * kernels.CPU_SMS


def test_segment_grid_bounds_the_tiles(kernels) -> None:
    """The tile bound from host ints (rows, index entries, slots) is never below the tiles the device counts."""
    gen = torch.Generator().manual_seed(0)
    for entries, per, slots in ((2, 11, 33), (1, 1, 33), (64, 1, 33), (128, 11, 33), (300, 1, 5), (7, 3, 2)):
        for _ in range(5):
            index = torch.randint(0, slots, (entries,), generator=gen)
            seg = kernels.segment_rows(index, per, slots)
            assert seg.tiles[-1].item() <= seg.grid <= entries * per
            assert seg.grid == kernels.tile_grid(entries, per, slots)
    assert kernels.segment_rows(torch.tensor([5, 5]), 11, 33).grid == 4  # a LocDiT step of one sequence


def fuses(kernels, rows: int, per: int, k: int, outs: tuple[int, ...], rank: int = 32, slots: int = 33) -> bool:
    """`fuse` for rows spread over every adapter (the largest grid), bf16."""
    grid = kernels.tile_grid(rows // per, per, slots)
    return kernels.fuse(rows, k, rank, sum(-(-n // kernels.FUSED_BLOCK_N) for n in outs), grid, 2)


def test_fuse_takes_one_launch_at_decode_sizes_only(kernels) -> None:
    """VoxCPM2 at r 32 with 32 adapters: a few LocDiT sequences (22 rows each) and LM decode at low concurrency take
    one launch; a large batch and prefill chunks take two. A larger batch of one shape never goes back to one."""
    qkv, lm_o, dit_o = (2048, 256, 256), (2048,), (1024,)
    for rows in (22, 44, 88):
        assert fuses(kernels, rows, 11, 1024, qkv) and fuses(kernels, rows, 11, 2048, dit_o)
    assert not fuses(kernels, 22 * 64, 11, 1024, qkv) and not fuses(kernels, 22 * 64, 11, 2048, dit_o)
    for rows in (1, 8):
        assert fuses(kernels, rows, 1, 2048, qkv) and fuses(kernels, rows, 1, 2048, lm_o)
    assert not fuses(kernels, 64, 1, 2048, qkv) and not fuses(kernels, 64, 1, 2048, lm_o)
    assert not fuses(kernels, 512, 512, 2048, lm_o)  # a prefill chunk of one adapter
    assert not fuses(kernels, kernels.FUSED_MAX_ROWS + 1, 1, 16, (8,), rank=4)  # past the rows cap, however small
    for per, k, outs in ((11, 1024, qkv), (1, 2048, qkv), (1, 2048, lm_o)):
        picks = [fuses(kernels, rows, per, k, outs) for rows in range(per, 300, per)]
        assert picks == sorted(picks, reverse=True)


class Launches:
    """Stands in for a kernel launcher (kernel[grid](...)), recording the kernel's name."""

    def __init__(self, kernel, name: str, log: list[str]) -> None:
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


def test_lora_add_launches_what_choose_picks(kernels, monkeypatch) -> None:
    """Decode sizes: SMALL_VARIANT's kernels (a split variant: the split kernel where K splits, the one-launch kernel
    where it does not); past `fuse`: LARGE_VARIANT's."""
    def kernels_of(name: str, splits: bool) -> list[str]:
        path = kernels.VARIANTS[name].path
        if path == "two":
            return ["_shrink_kernel", "_expand_kernel"]
        return ["_split_kernel" if path == "split" and splits else "_fused_kernel"]

    log: list[str] = []
    for name in ("_fused_kernel", "_split_kernel", "_shrink_kernel", "_expand_kernel"):
        monkeypatch.setattr(kernels, name, Launches(getattr(kernels, name), name, log))
    for rows, k, launched in ((5, 16, kernels_of(kernels.SMALL_VARIANT, False)),
                              (5, 300, kernels_of(kernels.SMALL_VARIANT, True)),
                              (kernels.FUSED_MAX_ROWS + 1, 16, kernels_of(kernels.LARGE_VARIANT, False))):
        a, b = torch.randn(3, 4, k), torch.randn(3, 8, 4)
        log.clear()
        kernels.lora_add_(torch.zeros(rows, 8), torch.randn(rows, k), a, b, torch.ones(rows, dtype=torch.long), 1)
        assert log == launched
