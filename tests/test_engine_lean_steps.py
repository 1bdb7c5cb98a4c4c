"""Lean steps in the real engine (spawned worker, tiny VoxCPM2): `VOXGATE_LEAN_STEPS` reaches the worker, and a
stream that sits out steps, a new turn that makes it sit out and a continuation that takes over its listener's queue
each speak exactly what they speak alone (the steps change, no request's audio does)."""

import asyncio

import numpy as np
import pytest
import pytest_asyncio

from engine import Engine

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
STEPS = 2
ATOL = 2e-4


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_v2_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VOXGATE_LEAN_STEPS", "500")
        eng = Engine(str(tiny_v2_dir), max_num_seqs=4, num_kv_blocks=64, block_size=4, max_num_batched_tokens=64,
                     inference_timesteps=STEPS)
    await eng.wait_for_ready()
    yield eng
    await eng.stop()


async def speak(engine: Engine, **kw) -> tuple[np.ndarray, np.ndarray]:
    """(audio, latents) of one request read to its end."""
    chunks = [c async for c in engine.generate(**kw)]
    return np.concatenate([c.audio for c in chunks]), np.stack([c.latents for c in chunks])


async def test_sitting_out_and_taking_over_a_listener_change_no_audio(engine):
    assert engine._worker_configs[0].lean_steps_ms == 500  # the environment reached the worker's config
    first = dict(text="The first segment of a long turn.", seed=1, min_length=8, max_length=8)
    new = dict(text="Another caller starts a turn.", seed=2, min_length=4, max_length=4)
    later = dict(text="And the turn goes on.", seed=3, min_length=4, max_length=4)

    spoke_twice = asyncio.Event()

    async def turn() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        gen = engine.generate(**first, request_id="turn:0")
        chunks = []
        async for chunk in gen:
            chunks.append(chunk)
            if len(chunks) == 2:
                engine.update_buffered("turn:0", 5000.0)  # its listener has plenty queued: it may sit out
                spoke_twice.set()
        audio, latents = np.concatenate([c.audio for c in chunks]), np.stack([c.latents for c in chunks])
        # the next segment continues from this one's audio, sent as soon as it ended (as the gateway does)
        return (audio, latents), await speak(engine, **later, prompt_latents=latents[-3:], prompt_text=first["text"])

    async def newcomer() -> tuple[np.ndarray, np.ndarray]:
        await spoke_twice.wait()
        return await speak(engine, **new)

    (a, c), b = await asyncio.gather(turn(), newcomer())
    alone = [await speak(engine, **first), await speak(engine, **new),
             await speak(engine, **later, prompt_latents=a[1][-3:], prompt_text=first["text"])]
    for (audio, _), (ref, _) in zip((a, b, c), alone, strict=True):
        assert audio.shape == ref.shape
        np.testing.assert_allclose(audio, ref, atol=ATOL)
