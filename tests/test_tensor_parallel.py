"""Tensor parallelism on CPU: two gloo ranks behind one engine worker give the single-process audio (fp32, tight
tolerance) through prefill, batching, a stored voice's shared prefix and preemption; a dead rank takes its group
down cleanly and the group is restarted.

One TP=2 engine serves the module; the single-request path (`Synthesizer`) is the TP=1 reference."""

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

from engine import Engine, InvalidParameter, WorkerCrashed
from engine.checkpoint import load_model
from engine.model.parallel import check_tensor_parallel, shard_model

pytestmark = pytest.mark.timeout(120)
in_module_loop = pytest.mark.asyncio(loop_scope="module")
STEPS = 2
ATOL = 2e-4


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_v2_dir):
    eng = Engine(str(tiny_v2_dir), tensor_parallel_size=2, max_num_seqs=4, max_waiting=4, num_kv_blocks=40,
                 block_size=4, max_num_batched_tokens=48, inference_timesteps=STEPS)
    await eng.wait_for_ready()
    yield eng
    await eng.stop()


async def collect(gen) -> np.ndarray:
    return np.concatenate([c.audio async for c in gen])


def test_sharding_is_checked(tiny_v2_dir):
    config = load_model(tiny_v2_dir).config
    check_tensor_parallel(config, 2)
    for world in (0, 3):  # 4 heads, 2 KV heads
        with pytest.raises(ValueError):
            check_tensor_parallel(config, world)
    with pytest.raises(InvalidParameter):
        asyncio.run(_engine_with_tp(tiny_v2_dir, 3))
    loaded = load_model(tiny_v2_dir)
    with pytest.raises(ValueError, match="does not divide"):
        shard_model(loaded.model, 0, 4, None)  # 2 KV heads cannot split 4 ways


async def _engine_with_tp(path: Path, tp: int) -> None:
    Engine(str(path), tensor_parallel_size=tp, devices=["cpu"] * tp)


@in_module_loop
async def test_tp2_matches_one_process_through_batching_voices_and_preemption(engine, synth):
    info = engine.health()["workers"]
    assert len(info) == 1 and info[0]["devices"] == ["cpu", "cpu"]
    ref = np.random.default_rng(3).standard_normal((9, 4, 64)).astype(np.float32)
    voice = await engine.add_voice(latents=ref)
    text = "Please call me back tomorrow at three o'clock; the meeting was moved."
    cases = [dict(text=text, seed=20 + i, max_length=16, min_length=16) for i in range(3)]  # 3 x ~22 of 40 blocks
    cases.append(dict(text="The stored voice speaks here.", seed=4, max_length=5, voice=voice))
    before = engine.stats().preemptions
    audios = await asyncio.gather(*(collect(engine.generate(**c, timesteps=STEPS)) for c in cases))
    assert engine.stats().preemptions > before
    for case, audio in zip(cases[:3], audios[:3], strict=True):
        alone = np.concatenate(list(synth.stream(case["text"], seed=case["seed"], max_len=16, min_len=16,
                                                 timesteps=STEPS)))
        np.testing.assert_allclose(audio, alone, atol=ATOL)
    recomputed = await collect(engine.generate("The stored voice speaks here.", seed=4, max_length=5,
                                               timesteps=STEPS, reference_latents=ref))
    np.testing.assert_allclose(audios[3], recomputed, atol=ATOL)
    await engine.remove_voice(voice)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@in_module_loop
async def test_dead_follower_rank_fails_the_group_cleanly_and_it_restarts(engine):
    leader = engine.health()["workers"][0]["pid"]
    followers = [p for p in _children(leader) if "follower_main" in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(followers) == 1
    gen = engine.generate("This turn loses a rank midway.", seed=1, max_length=200, min_length=200,
                          timesteps=STEPS)
    await gen.__anext__()
    os.kill(followers[0], 9)
    with pytest.raises(WorkerCrashed):
        async for _ in gen:
            pass
    deadline = time.monotonic() + 30
    while engine.health()["status"] != "ok":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert engine.health()["workers"][0]["pid"] != leader and engine.stats().worker_restarts == 1
    audio = await collect(engine.generate("Back with both ranks.", seed=2, max_length=3, timesteps=STEPS))
    assert audio.shape[0] == 3 * engine.model_info().samples_per_patch and np.isfinite(audio).all()
