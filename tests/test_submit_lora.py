"""How a LoRA adapter gets to the workers: packed in the model's dtype with alpha/r folded in (the slots get the same
bits as packing the float32 adapter in the worker), pickled as one byte buffer (no per-tensor shared-memory handles),
sent as a shared-memory segment its owner removes once the workers have read it; concurrent registrations; the
benchmark's cheap random adapters."""

from __future__ import annotations

import asyncio
import importlib.util
import pickle
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

from engine import ipc
from engine.config import ModelConfig
from engine.errors import InvalidLoRA
from engine.lora import AdapterSlots, LoRAAdapter, SharedAdapter, _all_finite, load_adapter, lora_layout
from engine.model.lora import attach_lora
from engine.model.voxcpm import VoxCPMModel
from engine.model_configs import tiny

RANK, MAX_RANK = 4, 8
SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return ModelConfig.from_dict(tiny("voxcpm2"))


@pytest.fixture(scope="module")
def layout(config) -> dict[str, tuple[int, int]]:
    return lora_layout(config)


def random_adapter(layout: dict[str, tuple[int, int]], name: str = "x", seed: int = 0, alpha: float = 6.0
                   ) -> LoRAAdapter:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, (fan_in, fan_out) in layout.items():
        tensors[f"{path}.lora_A"] = torch.randn(RANK, fan_in, generator=gen)
        tensors[f"{path}.lora_B"] = torch.randn(fan_out, RANK, generator=gen) / 3
    return load_adapter(name, tensors, layout, MAX_RANK, {"r": RANK, "alpha": alpha})


def slots_for(config: ModelConfig, dtype: torch.dtype) -> AdapterSlots:
    model = VoxCPMModel(config).to(dtype).eval()
    return AdapterSlots(attach_lora(model, num_adapters=2, max_rank=MAX_RANK))


def host_equal(x: dict, y: dict) -> bool:
    return x.keys() == y.keys() and all(torch.equal(x[k][0], y[k][0]) and torch.equal(x[k][1], y[k][1]) for k in x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_gives_the_slots_the_same_bits(config, layout, dtype):
    adapter = random_adapter(layout)
    packed = adapter.packed(dtype)
    assert packed.folded and packed.flat is not None and packed.flat.dtype == dtype
    assert packed.flat.numel() == adapter.num_parameters == packed.num_parameters
    for path, (a, b) in packed.weights.items():  # views of the one buffer, in order
        assert a.untyped_storage().data_ptr() == packed.flat.untyped_storage().data_ptr()
        a32, b32 = adapter.weights[path]
        assert torch.equal(a, a32.to(dtype)) and torch.equal(b, (b32 * adapter.scaling).to(dtype))
    assert packed.packed(dtype) is packed
    reference, ours = slots_for(config, dtype), slots_for(config, dtype)
    reference.add(adapter)  # the float32 adapter, scaled and cast in the worker as before
    ours.add(packed)
    assert host_equal(reference.host["x"], ours.host["x"])
    assert ours.host["x"][next(iter(layout))][0].dtype == dtype


def test_pickle_is_one_buffer_by_value(layout):
    for adapter in (random_adapter(layout), random_adapter(layout).packed(torch.bfloat16)):
        data = bytes(ForkingPickler.dumps(adapter))  # what a worker's pipe carries
        assert b"rebuild_storage" not in data and b"torch.multiprocessing" not in data  # no shared-memory handles
        assert len(data) < adapter.num_parameters * adapter.weights[next(iter(layout))][0].element_size() + 20_000
        back = pickle.loads(data)
        assert (back.name, back.rank, back.alpha, back.folded) == (adapter.name, adapter.rank, adapter.alpha,
                                                                   adapter.folded)
        assert back.weights.keys() == adapter.weights.keys()
        for path, (a, b) in adapter.weights.items():
            assert torch.equal(back.weights[path][0], a) and torch.equal(back.weights[path][1], b)
    mixed = LoRAAdapter("m", 1, 1.0, {"p": (torch.ones(1, 3, dtype=torch.float16), torch.full((2, 1), 0.5))})
    back = pickle.loads(pickle.dumps(mixed))  # promoted to a common dtype without loss
    assert back.weights["p"][0].dtype == torch.float32 and torch.equal(back.weights["p"][0], torch.ones(1, 3))


def test_shared_adapter_round_trip_and_unlink(config, layout, caplog):
    packed = random_adapter(layout).packed(torch.float32)
    shared = SharedAdapter.create(packed)
    assert shared is not None
    try:
        assert (SHM / shared.segment).exists()
        sent = pickle.loads(ForkingPickler.dumps(shared))
        assert len(ForkingPickler.dumps(shared)) < 50_000  # the name and the shapes, not the weights
        with sent.open() as opened:
            assert opened is not None
            for path, (a, b) in packed.weights.items():
                assert torch.equal(opened.weights[path][0], a) and torch.equal(opened.weights[path][1], b)
            del opened
        direct, from_shm = slots_for(config, torch.float32), slots_for(config, torch.float32)
        direct.add(packed)
        from_shm.add(sent)
        assert host_equal(direct.host["x"], from_shm.host["x"])
        assert shared.segment not in Path("/proc/self/maps").read_text()  # the worker's mapping is closed again
    finally:
        shared.unlink()
    assert not (SHM / shared.segment).exists()
    shared.unlink()  # twice is harmless
    late = slots_for(config, torch.float32)
    late.add(sent)  # the owner gave up waiting: logged, not added, no crash
    assert "x" not in late.host and "segment is gone" in caplog.text
    with pytest.raises(ValueError, match="packed"):
        SharedAdapter.create(random_adapter(layout))


def test_all_finite_finds_one_bad_value_anywhere():
    t = torch.randn(64, 3000)
    assert _all_finite(t)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for index in (0, 77_777, t.numel() - 1):
            u = t.clone().view(-1)
            u[index] = bad
            assert not _all_finite(u.view(64, 3000)), (bad, index)


@pytest.mark.timeout(120)
async def test_engine_registers_concurrently_and_leaves_no_segments(tiny_v2_dir, layout, monkeypatch) -> None:
    from engine import Engine

    segments: list[str] = []
    create = SharedAdapter.create.__func__

    def recording_create(cls, adapter):
        shared = create(cls, adapter)
        segments.append(shared.segment)
        return shared

    monkeypatch.setattr(SharedAdapter, "create", classmethod(recording_create))
    eng = Engine(str(tiny_v2_dir), max_num_seqs=2, num_kv_blocks=32, block_size=4, max_num_batched_tokens=32,
                 inference_timesteps=2, max_loras=2, max_lora_rank=MAX_RANK)
    try:
        await eng.wait_for_ready()
        tensors = {f"{p}.lora_{k}": t for p, (a, b) in random_adapter(layout).weights.items()
                   for k, t in (("A", a), ("B", b))}
        cfg = {"r": RANK, "alpha": 6.0}
        infos = await asyncio.gather(*(eng.register_lora(f"a{i}", tensors, cfg) for i in range(6)))
        assert [i.name for i in infos] == [f"a{i}" for i in range(6)]
        assert sorted(i.name for i in eng.list_loras()) == sorted(f"a{i}" for i in range(6))
        # two registrations of one name at once: exactly one wins
        results = await asyncio.gather(eng.register_lora("same", tensors, cfg), eng.register_lora("same", tensors, cfg),
                                       return_exceptions=True)
        assert sum(isinstance(r, InvalidLoRA) for r in results) == 1
        # a registration cancelled while the worker stores it: the segment still goes once the worker replied
        worker = eng._workers[0]
        call = worker.call

        def call_then_cancel(command, *args):  # the adapter is on its way to the worker when the caller gives up
            fut = call(command, *args)
            if command is ipc.AddLoRA:
                asyncio.get_running_loop().call_soon(task.cancel)
            return fut

        worker.call = call_then_cancel
        try:
            task = asyncio.create_task(eng.register_lora("cancelled", tensors, cfg))
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            worker.call = call
        assert "cancelled" not in [i.name for i in eng.list_loras()]
        chunks = [c async for c in eng.generate("Hello there.", lora="a3", seed=1, max_length=2, min_length=2)]
        assert chunks[-1].is_last
        assert len(segments) >= 8  # every registration went through shared memory
        for _ in range(200):
            if not any((SHM / name).exists() for name in segments):
                break
            await asyncio.sleep(0.02)
        assert not any((SHM / name).exists() for name in segments)
    finally:
        await eng.stop()


def test_bench_random_adapters_are_distinct_and_shaped(layout):
    spec = importlib.util.spec_from_file_location("engine_bench", Path(__file__).parent.parent / "bench" /
                                                  "engine_bench.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("engine_bench", bench)
    spec.loader.exec_module(bench)

    class FakeEngine:
        config = ModelConfig.from_dict(tiny("voxcpm2"))
        got: dict[str, dict[str, torch.Tensor]] = {}

        async def register_lora(self, name, tensors, config):
            assert config == {"r": 16, "alpha": 16}
            self.got[name] = tensors

    fake = FakeEngine()
    bench.LORAS.clear()
    asyncio.run(bench.register_random_loras(fake, 5, 16, concurrency=2))
    assert [f"bench-{i}" for i in range(5)] == bench.LORAS and list(fake.got) == bench.LORAS
    for tensors in fake.got.values():
        for path, (fan_in, fan_out) in layout.items():
            assert tensors[f"{path}.lora_A"].shape == (16, fan_in) and tensors[f"{path}.lora_B"].shape == (fan_out, 16)
        load_adapter("ok", tensors, layout, 16, {"r": 16, "alpha": 16})  # a valid adapter
    first = next(iter(layout))
    keys = [f"{first}.lora_A", f"{first}.lora_B"]
    values = [torch.cat([fake.got[n][k].reshape(-1) for k in keys]) for n in bench.LORAS]
    assert all(not torch.equal(values[i], values[j]) for i in range(5) for j in range(i))
    bench.LORAS.clear()
