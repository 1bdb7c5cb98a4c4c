"""Data parallelism with two CPU workers (`devices=["cpu", "cpu"]`): headroom routing, stored voices on every
worker, and a killed worker whose turns fail while the other keeps serving, then comes back with the voices.

One engine serves the module (worker processes are expensive on CI's two cores)."""

import asyncio
import os
import signal
import time

import numpy as np
import pytest
import pytest_asyncio

from engine import Engine, InvalidParameter, WorkerCrashed
from engine.routing import device_groups, headroom

pytestmark = pytest.mark.timeout(120)
in_module_loop = pytest.mark.asyncio(loop_scope="module")
STEPS = 2
ATOL = 2e-4


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_v2_dir):
    eng = Engine(str(tiny_v2_dir), devices=["cpu", "cpu"], max_num_seqs=4, max_waiting=4, num_kv_blocks=64,
                 block_size=4, max_num_batched_tokens=64, inference_timesteps=STEPS)
    await eng.wait_for_ready()
    yield eng
    await eng.stop()


async def collect(gen) -> np.ndarray:
    return np.concatenate([c.audio async for c in gen])


async def wait_until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_headroom_prefers_free_kv_and_punctual_workers():
    idle = {"running": 0, "waiting": 0, "free_blocks": 100, "total_blocks": 100, "voice_blocks": 0}
    busy_kv = {"running": 2, "waiting": 0, "free_blocks": 10, "total_blocks": 100, "voice_blocks": 0}
    more_seqs = {"running": 3, "waiting": 0, "free_blocks": 80, "total_blocks": 100, "voice_blocks": 0}
    late = {**idle, "running": 1, "min_slack_ms": -50.0}
    # same in-flight count, far fewer free blocks: less room, even though fewer sequences run there
    assert headroom(busy_kv, 2, 8) < headroom(more_seqs, 3, 8)
    assert headroom(late, 1, 8) < headroom(busy_kv, 2, 8)  # a late worker is the last choice
    assert headroom({**late, "min_slack_ms": 2000.0}, 1, 8) > headroom(busy_kv, 2, 8)
    # turns routed since the last report count before the worker has taken blocks for them
    assert headroom(more_seqs, 6, 8) < headroom(more_seqs, 3, 8)
    assert headroom({}, 0, 8) == 1.0  # a worker that has not reported yet is empty


def test_device_lists_are_checked():
    assert device_groups(["cpu", "cpu"], 1) == [["cpu"], ["cpu"]]
    assert device_groups(["cpu", "cpu"], 2) == [["cpu", "cpu"]]
    for bad, tp in (([], 1), (["tpu"], 1), (["cpu"] * 3, 2), ([99], 1), (["nonsense"], 1)):
        with pytest.raises(InvalidParameter):
            device_groups(bad, tp)


@in_module_loop
async def test_new_turns_spread_over_both_workers_and_match_one_worker(engine, synth):
    texts = [f"Turn number {i} of the routing test." for i in range(4)]
    gens = [engine.generate(t, seed=i, max_length=3, min_length=3, timesteps=STEPS) for i, t in enumerate(texts)]
    assert [w["in_flight"] for w in engine.health()["workers"]] == [2, 2]
    audios = await asyncio.gather(*(collect(g) for g in gens))
    for i, (text, audio) in enumerate(zip(texts, audios, strict=True)):
        alone = np.concatenate(list(synth.stream(text, seed=i, max_len=3, min_len=3, timesteps=STEPS)))
        np.testing.assert_allclose(audio, alone, atol=ATOL)
    assert all(w["stats"]["steps"] > 0 for w in engine.health()["workers"])


@in_module_loop
async def test_killed_worker_fails_its_turns_others_keep_serving_voices_come_back(engine):
    ref = np.random.default_rng(7).standard_normal((9, 4, 64)).astype(np.float32)
    voice = await engine.add_voice(latents=ref, voice_id="everywhere")
    assert [w["stats"]["voice_blocks"] for w in engine.health()["workers"]] == [2, 2]  # 11 positions // 4

    text = "This turn keeps going on the surviving worker."
    gens = [engine.generate(text, seed=i, max_length=30, min_length=30, timesteps=STEPS, voice=voice)
            for i in range(2)]
    assert [w["in_flight"] for w in engine.health()["workers"]] == [1, 1]
    for g in gens:
        await g.__anext__()
    os.kill(engine.health()["workers"][1]["pid"], signal.SIGKILL)
    with pytest.raises(WorkerCrashed):
        async for _ in gens[1]:
            pass
    rest = await collect(gens[0])  # worker 0 never noticed

    await wait_until(lambda: engine.health()["status"] == "ok")
    await wait_until(lambda: engine.health()["workers"][1]["stats"].get("voice_blocks") == 2)
    assert engine.stats().worker_restarts == 1
    # the survivor's audio is what the same turn gives without the stored voice (its prefix recomputed)
    again = await collect(engine.generate(text, seed=0, max_length=30, min_length=30, timesteps=STEPS,
                                          reference_latents=ref))
    np.testing.assert_allclose(rest, again[-rest.shape[0]:], atol=ATOL)
    # the restarted worker serves the voice from its re-registered prefix
    gens = [engine.generate("Both workers serve the voice again.", seed=5, max_length=2, timesteps=STEPS, **kw)
            for kw in (dict(voice=voice), dict(reference_latents=ref))]
    assert [w["in_flight"] for w in engine.health()["workers"]] == [1, 1]
    shared, recomputed = await asyncio.gather(*(collect(g) for g in gens))
    np.testing.assert_allclose(shared, recomputed, atol=ATOL)
    await engine.remove_voice(voice)


def test_cli_places_workers():
    from gateway.cli import _engine_kwargs, _parser

    args = _parser().parse_args(["serve", "--devices", "cpu,cpu", "--tensor-parallel-size", "2"])
    assert _engine_kwargs(args) == {"devices": ["cpu", "cpu"], "tensor_parallel_size": 2}
    assert _engine_kwargs(_parser().parse_args(["serve", "--devices", "0,1"]))["devices"] == [0, 1]
