"""LoRA adapters: the official package with a LoRA loaded is the oracle for our batched slots; an adapter merged into
the weights equals the LoRA path; adapters mixed in one batch equal each run alone; bad adapters are typed errors;
the slot cache evicts least recently used, never what a request holds; the real engine serves, refuses and drains.

Everything runs the tiny models on CPU in fp32 (the CUDA kernel has its own test, tests/test_lora_kernel.py).
"""

from __future__ import annotations

import asyncio
import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from oracle import main_state_dict, official_inference, official_model
from safetensors.torch import save_file
from test_model_oracle import assert_close, caches, new_seq, noise_list, prompt, run_lms, sample
from torch import Tensor

from engine.config import ModelConfig
from engine.errors import InvalidLoRA, InvalidParameter, UnknownLoRA
from engine.lora import AdapterSlots, LoRAAdapter, load_adapter, lora_layout
from engine.model.lora import attach_lora
from engine.model.voxcpm import VoxCPMModel
from engine.model_configs import tiny

MAX_RANK = 8


def official_with_lora(arch: str, r: int, alpha: float, seed: int, *, lm: bool = True, dit: bool = True,
                       proj: bool = True) -> torch.nn.Module:
    """The official model (seed 1 base weights) with a LoRA injected by its own `_apply_lora`, random A and B."""
    from voxcpm.model.voxcpm2 import LoRAConfig

    official = official_model(tiny(arch), seed=1)
    official.lora_config = LoRAConfig(enable_lm=lm, enable_dit=dit, enable_proj=proj, r=r, alpha=alpha)
    official._apply_lora()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in official.named_parameters():
            if "lora_" in name:  # B too: the official init leaves it zero, which would test nothing
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 / p.shape[-1] ** 0.5)
    return official.eval()


def save_adapter(official: torch.nn.Module, directory: Path, r: int, alpha: float) -> Path:
    """The release layout of a fine-tune: lora_weights.safetensors + lora_config.json (official key names)."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in official.state_dict().items() if "lora_" in k},
              str(directory / "lora_weights.safetensors"))
    (directory / "lora_config.json").write_text(json.dumps(
        {"base_model": "tiny", "lora_config": {"enable_lm": True, "enable_dit": True, "enable_proj": True,
                                                "r": r, "alpha": alpha}}))
    return directory


@cache
def setup(arch: str) -> tuple[VoxCPMModel, AdapterSlots, dict[str, torch.nn.Module]]:
    """Our model (official base weights) with 3 slots holding adapters "a" (r=4), "b" (r=8), "c" (r=2), the
    official models they came from, and the slot cache."""
    import tempfile

    cfg = tiny(arch)
    config = ModelConfig.from_dict(cfg)
    ours = VoxCPMModel(config).eval()
    ours.load_state_dict({k: v for k, v in main_state_dict(official_model(cfg, seed=1)).items()}, strict=True)
    slots = AdapterSlots(attach_lora(ours, num_adapters=3, max_rank=MAX_RANK))
    layout = lora_layout(config)
    officials = {}
    root = Path(tempfile.mkdtemp(prefix="lora-"))
    for name, r, alpha, seed in (("a", 4, 8.0, 11), ("b", 8, 8.0, 12), ("c", 2, 4.0, 13)):
        officials[name] = official_with_lora(arch, r, alpha, seed)
        slots.add(load_adapter(name, save_adapter(officials[name], root / name, r, alpha), layout, MAX_RANK))
    return ours, slots, officials


def generate(model: VoxCPMModel, seqs: list, slots: list[int], noises: list[list[Tensor]], steps: int,
             cfgs: list[float]) -> None:
    """Prefill all `seqs` in one flat batch, then `steps` patches each, every forward with its rows' slots."""
    kv = caches(model)
    lens = [len(s.tokens) for s in seqs]
    model.set_lora_indices(tokens=torch.tensor(np.repeat(slots, lens)), seqs=torch.tensor(slots))
    lm_h, res_h = run_lms(model, kv, seqs, [(0, n) for n in lens])
    for i in range(steps):
        sample(model, seqs, lm_h, res_h, [n[i] for n in noises], 4, cfgs)
        model.set_lora_indices(tokens=torch.tensor(slots))
        lm_h, res_h = run_lms(model, kv, seqs, [(-1, -1)] * len(seqs))


def spread(seqs: list, first_block: int = 0) -> list:
    for i, s in enumerate(seqs):
        s.blocks = list(range(first_block + 16 * i, first_block + 16 * (i + 1)))
    return seqs


@pytest.mark.parametrize(("arch", "mode", "adapter"), [("voxcpm2", "reference", "a"), ("voxcpm2", "zero-shot", "b"),
                                                       ("voxcpm", "continuation", "c")])
def test_matches_official_with_lora_loaded(arch: str, mode: str, adapter: str) -> None:
    ours, slots, officials = setup(arch)
    slot = slots.acquire(adapter)
    try:
        tokens, feats, audio = prompt(arch, mode, 3)
        noises = noise_list(arch, 3)
        ref, ref_stops = official_inference(officials[adapter], tokens, feats, audio, [z[None] for z in noises],
                                            min_len=4, max_len=4, timesteps=4, cfg_value=2.0)
        seq = new_seq(tokens, feats, audio, 0)
        generate(ours, [seq], [slot], [noises], 4, [2.0])
    finally:
        slots.release(adapter)
    assert len(ref) == 4
    assert_close(torch.stack(seq.patches), ref, rtol=1e-4)
    assert seq.stops == [bool(s) for s in ref_stops[:4]]
    # and the adapter matters: slot 0 (the base model) gives something else
    base = new_seq(tokens, feats, audio, 0)
    generate(ours, [base], [0], [noises], 1, [2.0])
    assert (base.patches[0] - seq.patches[0]).abs().max() > 1e-3


def test_lora_equals_weights_merged() -> None:
    """W' = W + (alpha/r) B A in a plain model (no slots) gives what slot "b" gives."""
    ours, slots, _ = setup("voxcpm2")
    merged = VoxCPMModel(ours.config).eval()
    merged.load_state_dict(ours.state_dict(), strict=True)
    adapter = load_adapter("b", {k: v for k, v in setup("voxcpm2")[2]["b"].state_dict().items() if "lora_" in k},
                           lora_layout(ours.config), MAX_RANK, config={"r": 8, "alpha": 8.0})
    with torch.no_grad():
        for path, (a, b) in adapter.weights.items():
            merged.get_submodule(path).weight += adapter.scaling * b @ a
    tokens, feats, audio = prompt("voxcpm2", "continuation", 1)
    noises = noise_list("voxcpm2", 1)
    slot = slots.acquire("b")
    try:
        with_lora = new_seq(tokens, feats, audio, 0)
        generate(ours, [with_lora], [slot], [noises], 3, [2.0])
    finally:
        slots.release("b")
    plain = new_seq(tokens, feats, audio, 0)
    generate(merged, [plain], [0], [noises], 3, [2.0])
    assert_close(torch.stack(with_lora.patches), torch.stack(plain.patches), rtol=1e-4)


def test_merged_adapter_equals_the_lora_kernels_and_restores_the_base_weights_exactly() -> None:
    """`MergedAdapter`: slot "b" merged into the weights, run with LoRA bypassed, gives what the LoRA path gives;
    switching to "a" merges "a" (not "b" + "a"); slot 0 copies back the base weights bit for bit; a slot reloaded
    since its merge is merged again."""
    from engine.model.lora import merge_into_weights

    ours, slots, _ = setup("voxcpm2")
    base = {k: v.clone() for k, v in ours.state_dict().items()}
    merged = merge_into_weights(ours.lora, ours)
    held = {n: slots.acquire(n) for n in ("a", "b")}
    try:
        tokens, feats, audio = prompt("voxcpm2", "zero-shot", 2)
        noises = noise_list("voxcpm2", 2)
        for name in ("b", "a"):
            with_lora = new_seq(tokens, feats, audio, 0)
            generate(ours, [with_lora], [held[name]], [noises], 3, [2.0])
            merged.use(held[name])
            ours.lora.bypass = True
            try:
                in_weights = new_seq(tokens, feats, audio, 0)
                generate(ours, [in_weights], [held[name]], [noises], 3, [2.0])
            finally:
                ours.lora.bypass = False
                merged.use(0)
            assert_close(torch.stack(in_weights.patches), torch.stack(with_lora.patches), rtol=1e-4)
            assert all(torch.equal(v, base[k]) for k, v in ours.state_dict().items())
        merged.use(held["a"])
        weight = ours.get_submodule(next(iter(merged.linears))).weight
        before = weight.clone()
        ours.lora.load_slot(held["a"], {})  # the slot's contents change (here: emptied)
        merged.use(held["a"])  # merged again: now W + 0
        assert not torch.equal(weight, before)
        assert torch.equal(weight, base[next(iter(merged.linears)) + ".weight"])
    finally:
        merged.use(0)
        ours.lora.merged = None
        ours.lora.load_slot(held["a"], slots.host["a"])  # the shared setup's slot "a" as it was
        for name in held:
            slots.release(name)
    assert all(torch.equal(v, base[k]) for k, v in ours.state_dict().items())


@pytest.mark.parametrize("rows", [6, 96])  # a few rows per slot (each gathers its slot) and many (slot by slot)
def test_lora_delta_add_is_each_rows_own_adapter(rows: int) -> None:
    """The reference LoRA path, both ways it runs on CPU: row r gets y[r] + B[slot] (A[slot] x[r]) per part."""
    from engine.model.lora import lora_delta_add

    gen = torch.Generator().manual_seed(rows)
    outs, rank, fan_in, slots = (5, 3, 4), 2, 7, 4
    a = torch.randn(slots, 3 * rank, fan_in, generator=gen, dtype=torch.float64)
    b = torch.randn(slots, sum(outs), rank, generator=gen, dtype=torch.float64)
    a[0], b[0] = 0, 0
    index = torch.randint(0, slots, (rows,), generator=gen)
    x = torch.randn(rows, 3, fan_in, generator=gen, dtype=torch.float64)
    y = torch.randn(rows, 3, sum(outs), generator=gen, dtype=torch.float64)
    expected = y.clone()
    for r, slot in enumerate(index.tolist()):
        start = 0
        for j, n in enumerate(outs):
            t = x[r] @ a[slot, j * rank:(j + 1) * rank].T
            expected[r, :, start:start + n] += t @ b[slot, start:start + n].T
            start += n
    torch.testing.assert_close(lora_delta_add(y, x, a, b, index, outs), expected)


def test_three_adapters_and_base_in_one_batch_equal_each_alone() -> None:
    ours, slots, _ = setup("voxcpm2")
    names = ["a", None, "b", "c"]
    held = [slots.acquire(n) if n else 0 for n in names]
    try:
        specs = [("zero-shot", 0, 2.0), ("continuation", 1, 3.0), ("reference", 2, 1.5), ("zero-shot", 4, 2.0)]
        make = lambda: [new_seq(*prompt("voxcpm2", mode, seed), first_block=0) for mode, seed, _ in specs]
        noises = [noise_list("voxcpm2", seed) for _, seed, _ in specs]
        batch = spread(make())
        generate(ours, batch, held, noises, 3, [c for *_, c in specs])
        for i, seq in enumerate(make()):
            generate(ours, [seq], [held[i]], [noises[i]], 3, [specs[i][2]])
            assert_close(torch.stack(batch[i].patches), torch.stack(seq.patches))
    finally:
        for n in names:
            if n:
                slots.release(n)


def test_fused_qkv_keeps_one_gemm_with_lora_and_equals_unfused() -> None:
    from engine.model.layers import fused_weight

    ours, slots, _ = setup("voxcpm2")
    fused = VoxCPMModel(ours.config).eval()
    fused.load_state_dict(ours.state_dict())
    state = attach_lora(fused, num_adapters=3, max_rank=MAX_RANK)
    names = ["a", None, "b", "c"]
    held = [slots.acquire(n) if n else 0 for n in names]
    try:
        for name, slot in zip(names, held, strict=True):
            if name:
                state.load_slot(slot, slots.host[name])
        fused.fuse_projections()
        attn = fused.base_lm.layers[0].self_attn
        assert fused_weight(attn.qkv, (attn.q_proj, attn.k_proj, attn.v_proj)) is not None
        specs = [("zero-shot", 0, 2.0), ("continuation", 1, 3.0), ("reference", 2, 1.5), ("zero-shot", 4, 2.0)]
        make = lambda: spread([new_seq(*prompt("voxcpm2", mode, seed), first_block=0) for mode, seed, _ in specs])
        noises = [noise_list("voxcpm2", seed) for _, seed, _ in specs]
        outs = []
        for model in (ours, fused):
            batch = make()
            generate(model, batch, held, noises, 2, [c for *_, c in specs])
            outs.append(torch.stack([torch.stack(seq.patches) for seq in batch]))
        assert_close(outs[1], outs[0])
        state.bypass = True  # the adapter-free step: every row as slot 0, whatever the indices say
        bypassed = make()
        generate(fused, bypassed, held, noises, 2, [c for *_, c in specs])
        state.bypass = False
        base = make()
        generate(fused, base, [0] * len(specs), noises, 2, [c for *_, c in specs])
        assert_close(torch.stack([torch.stack(s.patches) for s in bypassed]),
                     torch.stack([torch.stack(s.patches) for s in base]))
        assert not torch.allclose(outs[1][0], torch.stack(base[0].patches))  # and adapter "a" did change its row
    finally:
        for n in names:
            if n:
                slots.release(n)


# ---- bad adapters ------------------------------------------------------------------------------------------------
@cache
def layout() -> dict[str, tuple[int, int]]:
    return lora_layout(ModelConfig.from_dict(tiny("voxcpm2")))


def good_tensors(r: int = 4) -> dict[str, Tensor]:
    path = "base_lm.layers.0.self_attn.q_proj"
    fan_in, fan_out = layout()[path]
    return {f"{path}.lora_A": torch.randn(r, fan_in), f"{path}.lora_B": torch.randn(fan_out, r)}


def test_good_tensors_load() -> None:
    adapter = load_adapter("ok", good_tensors(), layout(), MAX_RANK, config={"r": 4, "alpha": 8})
    assert (adapter.rank, adapter.scaling, list(adapter.weights)) == (4, 2.0, ["base_lm.layers.0.self_attn.q_proj"])


@pytest.mark.parametrize(("tensors", "config", "match"), [
    ({"base_lm.layers.0.self_attn.qq_proj.lora_A": torch.zeros(4, 4)}, {"r": 4, "alpha": 8},
     "'base_lm.layers.0.self_attn.qq_proj' is not a LoRA target"),
    ({"feat_encoder.encoder.layers.0.self_attn.q_proj.lora_A": torch.zeros(4, 4)}, {"r": 4, "alpha": 8},
     "feat_encoder.encoder.layers.0.self_attn.q_proj' is not a LoRA target"),
    ({"base_lm.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4)}, {"r": 4, "alpha": 8}, "not a LoRA tensor"),
    (good_tensors(16), {"r": 16, "alpha": 8}, "rank 16, above this engine's max_lora_rank 8"),
    (good_tensors(4), {"r": 2, "alpha": 8}, r"q_proj needs lora_A \[2, \d+\] and lora_B"),
    ({k: v for k, v in good_tensors().items() if k.endswith("A")}, {"r": 4, "alpha": 8}, "q_proj.lora_B is missing"),
    (good_tensors(), None, "needs its LoRA config"),
    (good_tensors(), {"alpha": 8}, "r must be a positive integer"),
    (good_tensors(), {"r": 4, "alpha": "x"}, "alpha must be a finite number"),
    ({k: v * float("nan") for k, v in good_tensors().items()}, {"r": 4, "alpha": 8}, "NaN"),
])
def test_bad_adapters_are_typed_errors(tensors, config, match) -> None:
    with pytest.raises(InvalidLoRA, match=match):
        load_adapter("bad", tensors, layout(), MAX_RANK, config=config)


def test_bad_adapter_files(tmp_path: Path) -> None:
    with pytest.raises(InvalidLoRA, match="no lora_weights.safetensors"):
        load_adapter("x", tmp_path, layout(), MAX_RANK)
    save_file(good_tensors(), str(tmp_path / "lora_weights.safetensors"))
    with pytest.raises(InvalidLoRA, match="missing lora_config.json"):
        load_adapter("x", tmp_path, layout(), MAX_RANK)
    (tmp_path / "lora_config.json").write_text("{not json")
    with pytest.raises(InvalidLoRA, match="not valid JSON"):
        load_adapter("x", tmp_path, layout(), MAX_RANK)
    (tmp_path / "lora_config.json").write_text(json.dumps({"r": 4, "alpha": 4}))
    assert load_adapter("x", tmp_path, layout(), MAX_RANK).rank == 4
    (tmp_path / "lora_weights.safetensors").write_bytes(b"garbage")
    with pytest.raises(InvalidLoRA, match="not a readable safetensors"):
        load_adapter("x", tmp_path, layout(), MAX_RANK)


# ---- slot cache --------------------------------------------------------------------------------------------------
def three_adapters_two_slots() -> tuple[AdapterSlots, object]:
    """Adapters x, y, z (their A filled with 1, 2, 3) added to two slots; and the LoRA layer they target."""
    model = VoxCPMModel(ModelConfig.from_dict(tiny("voxcpm2"))).eval()
    slots = AdapterSlots(attach_lora(model, num_adapters=2, max_rank=MAX_RANK))
    path = "base_lm.layers.0.self_attn.q_proj"
    fan_in, fan_out = layout()[path]
    for i, name in enumerate("xyz"):
        slots.add(LoRAAdapter(name, 4, 4.0, {path: (torch.full((4, fan_in), i + 1.0), torch.ones(fan_out, 4))}))
    return slots, model.base_lm.layers[0].self_attn.q_proj.lora


def test_an_adapter_is_added_in_slices_and_its_requests_wait_for_it() -> None:
    """A worker adds an adapter as a chore (`AdapterSlots.adding`): one weight pair per slice, then all at once."""
    model = VoxCPMModel(ModelConfig.from_dict(tiny("voxcpm2"))).eval()
    slots = AdapterSlots(attach_lora(model, num_adapters=1, max_rank=MAX_RANK))
    paths = list(layout())[:3]
    weights = {p: (torch.ones(4, layout()[p][0]), torch.ones(layout()[p][1], 4)) for p in paths}
    chore = slots.adding(LoRAAdapter("w", 4, 4.0, weights))
    slices = 0
    for _ in chore:
        slices += 1
        assert slots.knows("w") and "w" not in slots.host
        assert slots.acquire("w") is None  # its requests wait; nothing half-copied is ever used
    assert slices == len(paths)
    assert not slots.pending and slots.acquire("w") == 1


def test_slots_evict_least_recently_used_never_held() -> None:
    slots, q = three_adapters_two_slots()
    sx = slots.acquire("x")
    sy = slots.acquire("y")
    assert {sx, sy} == {1, 2} and q.lora_A[sx, :4].eq(1).all() and q.lora_A[sx, 4:].eq(0).all()
    assert slots.acquire("z") is None  # both slots held by running requests
    slots.release("x")
    slots.release("y")
    slots.acquire("y")  # y is now the most recently used
    slots.release("y")
    sz = slots.acquire("z")
    assert sz == sx and "x" not in slots.slot_of and q.lora_A[sz, :4].eq(3).all()  # x evicted, not y
    assert q.lora_B[sz, :, :4].eq(1.0).all()  # alpha / r = 1 folded in
    slots.remove("z")  # held: freed only at the last release
    assert "z" in slots.host
    slots.release("z")
    assert "z" not in slots.host and "z" not in slots.slot_of
    with pytest.raises(KeyError):
        slots.acquire("z")
    assert slots.acquire("x") in (1, 2)  # reloaded from host memory


def test_adapters_are_loaded_into_free_slots_when_registered() -> None:
    """While slots are free an adapter is resident from its registration: a burst of requests for many adapters
    then waits for no slot loads (each is ~400 copies)."""
    slots, q = three_adapters_two_slots()
    assert set(slots.slot_of) == {"x", "y"} and "z" in slots.host  # z waits in host memory for a slot
    assert q.lora_A[slots.slot_of["y"], :4].eq(2).all() and not slots.refs
    loads = []
    original = slots.state.load_slot
    slots.state.load_slot = lambda slot, weights: loads.append(slot) or original(slot, weights)
    assert slots.acquire("y") == slots.slot_of["y"] and loads == []


# ---- the engine ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
async def test_engine_serves_mixed_adapters_refuses_unknown_and_drains(tiny_v2_dir, tmp_path) -> None:
    from engine import Engine

    config = ModelConfig.from_file(tiny_v2_dir / "config.json")
    official = official_with_lora("voxcpm2", 4, 8.0, seed=21)
    # the engine's checkpoint has its own random weights; only the adapter's tensors matter here
    eng = Engine(str(tiny_v2_dir), max_num_seqs=4, num_kv_blocks=64, block_size=4, max_num_batched_tokens=64,
                 inference_timesteps=4, max_loras=2, max_lora_rank=MAX_RANK)
    try:
        await eng.wait_for_ready()
        await eng.register_lora("a", save_adapter(official, tmp_path / "a", 4, 8.0))
        await eng.register_lora("b", {k: v * 2 for k, v in official.state_dict().items() if "lora_" in k},
                                config={"r": 4, "alpha": 8.0})
        await eng.register_lora("c", {k: -v for k, v in official.state_dict().items() if "lora_" in k},
                                config={"r": 4, "alpha": 8.0})
        assert [i.name for i in eng.list_loras()] == ["a", "b", "c"]
        assert config.is_v2
        with pytest.raises(UnknownLoRA, match="'nope'"):
            eng.generate("Hello there.", lora="nope")
        with pytest.raises(InvalidLoRA, match="already registered"):
            await eng.register_lora("a", tmp_path / "a")

        async def run(lora: str | None, seed: int) -> np.ndarray:
            chunks = [c.audio async for c in eng.generate("Hello there, how are you?", lora=lora, seed=seed,
                                                          max_length=4, min_length=4)]
            return np.concatenate(chunks)

        cases = [("a", 1), (None, 2), ("b", 3), ("c", 4)]  # 3 adapters on 2 slots: one waits for a free slot
        together = await asyncio.gather(*(run(n, s) for n, s in cases))
        for (name, seed), audio in zip(cases, together, strict=True):
            np.testing.assert_allclose(audio, await run(name, seed), atol=2e-4)
        assert np.abs(together[0] - await run(None, 1)).max() > 1e-4  # the adapter changes the audio
        # each run alone had its adapter merged into the weights (`MergedAdapter`), the batch the LoRA kernels
        assert sum(w["stats"]["lora_merged_steps"] for w in eng.health()["workers"]) >= 3 * 4

        # a request is in flight from generate() on (before it even reaches the worker): unregister waits for it
        gen = eng.generate("Hello there, how are you?", lora="a", seed=1, max_length=4, min_length=4)
        unregister = asyncio.create_task(eng.unregister_lora("a"))
        await asyncio.sleep(0)  # its request is on its way to the worker, unread
        assert not unregister.done() and [i.in_flight for i in eng.list_loras()] == [0, 0]
        with pytest.raises(UnknownLoRA):  # but refuses new requests at once
            eng.generate("Hi.", lora="a")
        drained = np.concatenate([c.audio async for c in gen])
        np.testing.assert_allclose(drained, together[0], atol=2e-4)  # served with its adapter to the end
        await asyncio.wait_for(unregister, 30)

        # a stored voice names its adapter: its requests (session.start {voice} in the gateway) use it
        voice = await eng.add_voice(lora="b")
        np.testing.assert_allclose(np.concatenate([c.audio async for c in eng.generate(
            "Hello there, how are you?", voice=voice, seed=3, max_length=4, min_length=4)]), together[2], atol=2e-4)
        with pytest.raises(InvalidParameter, match="used by stored voice"):
            await eng.unregister_lora("b")
        await eng.remove_voice(voice)
        await gateway_lora_routes(eng, official)
        assert [i.name for i in eng.list_loras()] == ["b", "c"]
        with pytest.raises(UnknownLoRA):
            await eng.unregister_lora("a")
    finally:
        await eng.stop()


async def gateway_lora_routes(eng, official: torch.nn.Module) -> None:
    """POST/GET/DELETE /v1/loras on a real server (with an API key), and a voice made of an uploaded adapter."""
    import aiohttp
    from safetensors.torch import save

    from gateway.auth import Auth
    from gateway.server import create_app, start_server

    runner, port = await start_server(create_app(eng, auth=Auth(api_keys={"k"})))
    base, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer k"}
    weights = save({k: v.contiguous() for k, v in official.state_dict().items() if "lora_" in k})

    def form(name: str, config: dict, data: bytes = weights) -> aiohttp.FormData:
        f = aiohttp.FormData()
        f.add_field("name", name)
        f.add_field("config", json.dumps(config))
        f.add_field("weights", data, filename="lora_weights.safetensors")
        return f

    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/v1/loras") as r:
                assert r.status == 401
            async with http.post(f"{base}/v1/loras", data=form("up", {"lora_config": {"r": 4, "alpha": 8}}),
                                 headers=auth) as r:
                assert r.status == 201 and (await r.json())["lora"]["rank"] == 4
            async with http.post(f"{base}/v1/loras", data=form("bad", {"r": 2, "alpha": 8}), headers=auth) as r:
                body = await r.json()
                assert r.status == 400 and "needs lora_A [2, " in body["error"]["message"]
            async with http.post(f"{base}/v1/loras", data=form("junk", {"r": 4, "alpha": 8}, b"xx"),
                                 headers=auth) as r:
                assert r.status == 400 and "safetensors" in (await r.json())["error"]["message"]
            async with http.get(f"{base}/v1/loras", headers=auth) as r:
                assert [x["name"] for x in (await r.json())["loras"]] == ["b", "c", "up"]
            async with http.post(f"{base}/v1/voices", params={"lora": "up"}, headers=auth) as r:
                assert r.status == 201
                voice = (await r.json())["voice_id"]
            async with http.get(f"{base}/v1/voices", headers=auth) as r:
                assert [v["lora"] for v in (await r.json())["voices"]] == ["up"]
            assert [v.lora for v in eng.list_voices()][0].startswith("up@")  # the key's own namespace
            async with http.delete(f"{base}/v1/loras/up", headers=auth) as r:
                assert r.status == 409
            async with http.delete(f"{base}/v1/voices/{voice}", headers=auth) as r:
                assert r.status == 204
            async with http.delete(f"{base}/v1/loras/up", headers=auth) as r:
                assert r.status == 204
            async with http.delete(f"{base}/v1/loras/up", headers=auth) as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_lora"
    finally:
        await runner.cleanup()


def test_slots_stay_out_of_the_state_dict() -> None:
    ours, _, _ = setup("voxcpm2")
    assert ours.lora is not None and len(ours.lora.layers) > 0
    assert set(ours.state_dict()) == set(VoxCPMModel(ours.config).state_dict())
