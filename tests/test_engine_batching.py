"""The real engine (spawned worker, IPC, shared-memory audio) on the tiny VoxCPM2 checkpoint.

One engine serves the whole module (a worker costs ~2 s to start). Reference outputs come from
`engine.offline.Synthesizer`, the single-request path, on the same weights and seeds.
"""

import asyncio
import os
import random
import signal
import time

import numpy as np
import pytest
import pytest_asyncio

from engine import Engine, EngineOverloaded, EngineStopped, InvalidParameter, WorkerCrashed

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
STEPS = 4  # CFM timesteps: enough to exercise CFG-Zero*, cheap on CPU
ATOL = 2e-4


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_v2_dir):
    eng = Engine(str(tiny_v2_dir), max_num_seqs=8, max_waiting=8, num_kv_blocks=48, block_size=4,
                 max_num_batched_tokens=48, inference_timesteps=STEPS)
    await eng.wait_for_ready()
    yield eng
    await eng.stop()


def noise_audio(seconds: float, seed: int) -> tuple[np.ndarray, int]:
    return (np.random.default_rng(seed).standard_normal(int(16000 * seconds)).astype(np.float32) * 0.1, 16000)


async def collect(gen, on_chunk=None) -> tuple[np.ndarray, list]:
    chunks = []
    async for chunk in gen:
        chunks.append(chunk)
        if on_chunk:
            await on_chunk(chunk)
    return np.concatenate([c.audio for c in chunks]), chunks


async def test_batched_requests_match_each_run_alone(engine, synth):
    prompt, ref = noise_audio(0.7, 1), noise_audio(0.5, 2)
    cases = [
        dict(text="Hello world, this is the first stream.", seed=11, max_length=7),
        dict(text="A second voice joins a little later.", seed=12, max_length=6, cfg_value=1.5, temperature=0.7,
             prompt_audio=prompt[0], prompt_sample_rate=16000, prompt_text="Please call me back."),
        dict(text="Reference audio sets the voice here.", seed=13, max_length=5, reference_audio=ref[0],
             prompt_sample_rate=16000),
        dict(text="Short one.", seed=14, max_length=4, min_length=0),
    ]
    first_chunk = [asyncio.Event() for _ in cases]

    async def run(i: int, case: dict):
        if i:  # arrive while the previous request is already speaking
            await first_chunk[i - 1].wait()

        async def seen(_chunk):
            first_chunk[i].set()

        return await collect(engine.generate(**case, timesteps=STEPS), seen)

    results = await asyncio.gather(*(run(i, c) for i, c in enumerate(cases)))
    for case, (audio, chunks) in zip(cases, results, strict=True):
        kw = dict(case)
        prompt_audio = kw.pop("prompt_audio", None)
        reference = kw.pop("reference_audio", None)
        kw.pop("prompt_sample_rate", None)
        alone = np.concatenate(list(synth.stream(
            kw.pop("text"), prompt_audio=None if prompt_audio is None else (prompt_audio, 16000),
            reference_audio=None if reference is None else (reference, 16000), timesteps=STEPS,
            min_len=kw.pop("min_length", 2), max_len=kw.pop("max_length"), **kw)))
        assert audio.shape == alone.shape
        np.testing.assert_allclose(audio, alone, atol=ATOL)
        assert [c.index for c in chunks] == list(range(len(chunks)))
        assert chunks[-1].is_last and chunks[-1].stop_reason in ("stop", "length")
        assert all(c.audio.dtype == np.float32 and c.latents.shape == (4, 64) for c in chunks)


async def test_admitting_a_long_prompt_never_skips_a_step_of_running_streams(engine, synth):
    steps_at_chunk: list[int] = []
    admitted = asyncio.Event()

    async def on_a(chunk):
        steps_at_chunk.append(chunk.step)  # the worker's own count (engine.stats() may already be a step ahead)
        if chunk.index == 1:
            admitted.set()

    async def b():
        await admitted.wait()
        # ~90 prompt positions: split over two steps by max_num_batched_tokens=48
        return await collect(engine.generate("The quick brown fox jumps over the lazy dog. " * 6, seed=2,
                                             max_length=3, timesteps=STEPS))

    text_a = "Streaming speech should start quickly and never stop."
    (audio_a, _), _ = await asyncio.gather(
        collect(engine.generate(text_a, seed=1, max_length=9, min_length=9, timesteps=STEPS), on_a), b())
    assert np.diff(steps_at_chunk).tolist() == [1] * (len(steps_at_chunk) - 1)  # one patch every step
    alone = np.concatenate(list(synth.stream(text_a, seed=1, max_len=9, min_len=9, timesteps=STEPS)))
    np.testing.assert_allclose(audio_a, alone, atol=ATOL)


def ahead_steps(engine) -> int:
    return sum(w["stats"].get("ahead_steps", 0) for w in engine.health()["workers"])


async def test_steps_launched_ahead_keep_every_stream_exact_even_when_it_stops(engine, synth):
    """Steady decoding launches step N+1 before step N is collected, feeding N's patches on the device: a stream
    that stops at N ran one row too many in N+1, which must never reach its listener."""
    before = ahead_steps(engine)
    text = "Hello there, how are you doing today?"
    cases = [dict(seed=1, max_length=12, min_length=12)] + [dict(seed=s, max_length=20, min_length=0)
                                                            for s in range(2, 7)]
    results = await asyncio.gather(*(collect(engine.generate(text, timesteps=STEPS, **c)) for c in cases))
    assert ahead_steps(engine) - before >= 6
    reasons = []
    for case, (audio, chunks) in zip(cases, results, strict=True):
        alone = np.concatenate(list(synth.stream(text, seed=case["seed"], max_len=case["max_length"],
                                                 min_len=case["min_length"], timesteps=STEPS)))
        assert audio.shape == alone.shape
        np.testing.assert_allclose(audio, alone, atol=ATOL)
        assert [c.index for c in chunks] == list(range(len(chunks))) and chunks[-1].is_last
        assert sum(c.is_last for c in chunks) == 1
        reasons.append(chunks[-1].stop_reason)
    assert reasons[0] == "length" and "stop" in reasons[1:]  # the stop head ended some mid-stream


async def test_rows_at_their_own_timesteps_and_cfg_share_steps_and_each_equals_its_run_alone(engine, synth):
    """A request's settings are its own: rows at every served timesteps value (those with fewer diffusion steps ride
    along in the same step with dt = 0) and at cfg 1, 0 and 3.5 run in the same steps, and each row's audio equals
    its single-request run at its own settings."""
    text = "Every stream keeps its own settings."
    cases = [dict(seed=31, timesteps=STEPS, cfg_value=2.0), dict(seed=32, timesteps=1, cfg_value=1.0),
             dict(seed=33, timesteps=2, cfg_value=0.0), dict(seed=34, timesteps=3, cfg_value=3.5),
             dict(seed=35, timesteps=STEPS, cfg_value=1.0), dict(seed=36, timesteps=2, cfg_value=2.0)]
    results = await asyncio.gather(*(collect(engine.generate(text, max_length=6, min_length=6, **c))
                                     for c in cases))
    steps = [{c.step for c in chunks} for _, chunks in results]
    assert set.intersection(*steps)  # some steps sampled all six rows at their six settings together
    for case, (audio, _) in zip(cases, results, strict=True):
        alone = np.concatenate(list(synth.stream(text, max_len=6, min_len=6, **case)))
        assert audio.shape == alone.shape
        np.testing.assert_allclose(audio, alone, atol=ATOL)
    outputs = [audio for audio, _ in results]
    assert not np.allclose(outputs[0], outputs[4], atol=ATOL)  # cfg 1 is its own setting, not the batch's


async def test_rows_past_the_default_timesteps_finish_in_the_tail_and_equal_their_run_alone(tiny_v2_dir, synth):
    """Served above the default (max_timesteps 4, default 2): such rows run the step's evaluations with everyone and
    finish theirs in the gathered tail; every row, below, at and above the default, equals its run alone."""
    engine = Engine(str(tiny_v2_dir), max_num_seqs=8, num_kv_blocks=48, block_size=4, max_num_batched_tokens=48,
                    inference_timesteps=2, max_timesteps=4)
    await engine.wait_for_ready()
    try:
        text = "Some streams take more steps."
        cases = [dict(seed=51, timesteps=4, cfg_value=2.0), dict(seed=52, timesteps=2, cfg_value=1.0),
                 dict(seed=53, timesteps=3, cfg_value=0.0), dict(seed=54, timesteps=1, cfg_value=2.0),
                 dict(seed=55, timesteps=4, cfg_value=3.0)]
        results = await asyncio.gather(*(collect(engine.generate(text, max_length=5, min_length=5, **c))
                                         for c in cases))
        assert set.intersection(*({c.step for c in chunks} for _, chunks in results))
        for case, (audio, _) in zip(cases, results, strict=True):
            alone = np.concatenate(list(synth.stream(text, max_len=5, min_len=5, **case)))
            np.testing.assert_allclose(audio, alone, atol=ATOL)
        with pytest.raises(InvalidParameter, match=r"\[1, 4\]"):
            engine.generate(text, timesteps=5)
    finally:
        await engine.stop()


async def test_preempted_requests_resume_with_identical_audio(engine, synth):
    text = "Please call me back tomorrow at three o'clock; the meeting was moved to the second floor."
    before = engine.stats().preemptions
    runs = [collect(engine.generate(text, seed=20 + i, max_length=24, min_length=24, timesteps=1))
            for i in range(3)]  # 3 x ~27 blocks wanted, 48 in the pool: someone is preempted and recomputed
    results = await asyncio.gather(*runs)
    assert engine.stats().preemptions > before
    for i, (audio, _) in enumerate(results):
        alone = np.concatenate(list(synth.stream(text, seed=20 + i, max_len=24, min_len=24, timesteps=1)))
        np.testing.assert_allclose(audio, alone, atol=ATOL)


async def test_stored_voice_shares_prefix_kv_and_matches_recompute(engine):
    ref = np.random.default_rng(5).standard_normal((9, 4, 64)).astype(np.float32)
    voice = await engine.add_voice(latents=ref, voice_id="v1")
    assert [v.voice_id for v in engine.list_voices()] == ["v1"] and engine.stats().voice_blocks == 2  # 11 // 4

    used = {}

    async def run(name, **kw):
        async def note(chunk):
            if chunk.index == 0:
                used[name] = engine.stats().total_blocks - engine.stats().free_blocks
        return (await collect(engine.generate("The voice is shared by every request.", seed=3, max_length=4,
                                              timesteps=STEPS, **kw), note))[0]

    shared = await run("shared", voice=voice)
    recomputed = await run("recomputed", reference_latents=ref)
    np.testing.assert_allclose(shared, recomputed, atol=ATOL)
    assert used["shared"] < used["recomputed"]  # the two full prefix blocks are not allocated again
    await engine.remove_voice("v1")
    assert engine.list_voices() == []


async def test_stress_random_cancels_closes_and_preemptions_return_everything(engine):
    assert await stress(engine, 500) > 0  # the small KV pool forced recomputes


# Split steps make this churn ~4x slower on CPU than the plain one, hence fewer requests in the default run. They
# force a recompute in most runs, not all (a few per hundred requests): the full run (CI) asserts one.
@pytest.mark.parametrize(("requests", "must_preempt"), [(120, False), pytest.param(500, True, marks=pytest.mark.heavy)])
async def test_stress_with_split_decodes_and_prompts_admitted_ahead_returns_everything(tiny_v2_dir, requests,
                                                                                      must_preempt):
    """The same churn while the decodes take turns by half (above 2 speaking streams) and steps launched ahead
    admit prompts: every request ends, and every block, slot and queue entry comes back."""
    engine = await start_mixed_ahead_engine(tiny_v2_dir, split_decodes_above=2, num_kv_blocks=48)
    try:
        preempted = await stress(engine, requests)
        assert sum(w["stats"]["split_steps"] for w in engine.health()["workers"]) > 0
        assert preempted > 0 or not must_preempt
    finally:
        await engine.stop()


async def stress(engine, requests: int) -> int:
    """`requests` random requests, at most 12 at once, cancelled, closed early or run to the end, on a KV pool small
    enough to force preemptions; then nothing may be left held. The preemptions it caused."""
    rng = random.Random(0)
    words = ["hello", "world", "voice", "gateway", "speaking", "quickly", "the", "meeting", "was", "moved",
             "to", "the", "second", "floor"]
    outcomes = {"done": 0, "cancelled": 0, "closed": 0, "overloaded": 0}
    sem = asyncio.Semaphore(12)
    preempted_before = engine.stats().preemptions

    async def one(i: int):
        async with sem:
            text = " ".join(rng.choice(words) for _ in range(rng.randint(4, 20)))
            action = rng.random()
            try:
                gen = engine.generate(text, seed=i, max_length=rng.randint(1, 12), min_length=rng.randint(0, 8),
                                      timesteps=1, priority=rng.randint(0, 1))
            except EngineOverloaded:
                outcomes["overloaded"] += 1
                return
            if action < 0.15:
                await engine.cancel(gen.request_id)
                outcomes["cancelled"] += [c async for c in gen] == []
            elif action < 0.3:
                async for _ in gen:
                    break
                await gen.aclose()
                outcomes["closed"] += 1
            else:
                chunks = [c async for c in gen]
                assert chunks and chunks[-1].is_last
                outcomes["done"] += 1

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(requests))), 90)
    assert sum(outcomes.values()) == requests and outcomes["done"] > 0.6 * requests
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        s = engine.stats()
        if (s.running, s.waiting, s.in_flight, s.free_blocks) == (0, 0, 0, s.total_blocks - s.voice_blocks):
            break
        await asyncio.sleep(0.05)
    s = engine.stats()
    assert (s.running, s.waiting, s.in_flight) == (0, 0, 0)
    assert s.free_blocks == s.total_blocks and s.voice_blocks == 0
    return s.preemptions - preempted_before


async def test_killed_worker_fails_in_flight_requests_fast_and_is_restarted(engine):
    gens = [engine.generate("This stream is cut off by a crash.", seed=i, max_length=400, min_length=400,
                            timesteps=STEPS) for i in range(3)]
    for g in gens:
        await g.__anext__()
    os.kill(engine.health()["workers"][0]["pid"], signal.SIGKILL)
    start = time.monotonic()
    for g in gens:
        with pytest.raises(WorkerCrashed):
            async for _ in g:
                pass
    assert time.monotonic() - start < 1.0
    audio, chunks = await asyncio.wait_for(collect(engine.generate("Back again.", seed=1, max_length=3)), 30)
    assert len(chunks) == 3 and engine.stats().worker_restarts == 1


async def start_mixed_ahead_engine(tiny_v2_dir, **options) -> Engine:
    """The engine of this module with `async_mixed`: steps launched ahead also admit waiting prompts."""
    os.environ["VOXGATE_ASYNC_MIXED"] = "1"  # read when the pool builds its WorkerConfig
    try:
        eng = Engine(str(tiny_v2_dir), **(dict(max_num_seqs=8, max_waiting=8, num_kv_blocks=64, block_size=4,
                                               max_num_batched_tokens=48, inference_timesteps=STEPS) | options))
    finally:
        del os.environ["VOXGATE_ASYNC_MIXED"]
    await eng.wait_for_ready()
    return eng


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mixed_ahead_engine(tiny_v2_dir):
    eng = await start_mixed_ahead_engine(tiny_v2_dir)
    yield eng
    await eng.stop()


def admitting_ahead(engine) -> int:
    return sum(w["stats"].get("ahead_admitting", 0) for w in engine.health()["workers"])


async def test_prompts_admitted_by_steps_launched_ahead_keep_every_stream_exact(mixed_ahead_engine, synth):
    """With `async_mixed`, a step launched while the one before still runs also admits the prompts that arrived:
    the running streams' inputs come from the device, the new prompts' from the host, some prompts are cut into
    chunks, some streams stop mid-way. Every stream must still equal its run alone."""
    engine = mixed_ahead_engine
    before = admitting_ahead(engine)
    joined = [asyncio.Event() for _ in range(4)]
    texts = ["Streaming speech should start quickly and never stop.", "Hi there.",
             "The quick brown fox jumps over the lazy dog. " * 4, "Good morning!"]  # the third is cut in chunks
    cases = [dict(seed=1, max_length=14, min_length=14)] + [dict(seed=s, max_length=8, min_length=0)
                                                            for s in (2, 3, 4)]

    async def run(i: int):
        if i:
            await joined[i - 1].wait()  # joins once the stream before it is speaking

        async def on_chunk(chunk):
            if chunk.index == 1:
                joined[i].set()

        return await collect(engine.generate(texts[i], timesteps=STEPS, **cases[i]), on_chunk)

    results = await asyncio.gather(*(run(i) for i in range(4)))
    assert admitting_ahead(engine) - before >= 2  # joins went out while the step before them ran
    for text, case, (audio, chunks) in zip(texts, cases, results, strict=True):
        alone = np.concatenate(list(synth.stream(text, seed=case["seed"], max_len=case["max_length"],
                                                 min_len=case["min_length"], timesteps=STEPS)))
        assert audio.shape == alone.shape
        np.testing.assert_allclose(audio, alone, atol=ATOL)
        assert [c.index for c in chunks] == list(range(len(chunks))) and sum(c.is_last for c in chunks) == 1
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0


async def test_split_decodes_taking_turns_keep_every_stream_exact(tiny_v2_dir, synth):
    """Above `split_decodes_above` speaking streams the decodes take turns by half: steps launched ahead decode
    the other half from collected patches (a new stream that joined it from the device) while admitting prompts,
    some streams stop and the split ends again. Every stream must still equal its run alone."""
    engine = await start_mixed_ahead_engine(tiny_v2_dir, split_decodes_above=2)
    try:
        texts = ["One stream speaks for a while.", "Two.", "A third voice joins in here.", "Four, a late one.",
                 "Five arrives last of all."]
        cases = [dict(seed=20 + i, max_length=n, min_length=n) for i, n in enumerate((12, 6, 10, 9, 5))]
        speaking = asyncio.Event()

        async def run(i: int):
            if i >= 3:  # arrive while the first three speak, split
                await speaking.wait()
                await asyncio.sleep(0.05 * (i - 3))

            async def on_chunk(chunk):
                if i == 2 and chunk.index == 2:
                    speaking.set()

            return await collect(engine.generate(texts[i], timesteps=STEPS, **cases[i]), on_chunk)

        results = await asyncio.gather(*(run(i) for i in range(len(texts))))
        split = sum(w["stats"]["split_steps"] for w in engine.health()["workers"])
        assert split >= 4
        for text, case, (audio, chunks) in zip(texts, cases, results, strict=True):
            alone = np.concatenate(list(synth.stream(text, seed=case["seed"], max_len=case["max_length"],
                                                     min_len=case["min_length"], timesteps=STEPS)))
            assert audio.shape == alone.shape
            np.testing.assert_allclose(audio, alone, atol=ATOL)
            assert [c.index for c in chunks] == list(range(len(chunks)))
        stats = engine.stats()
        assert stats.running == 0 and stats.waiting == 0
    finally:
        await engine.stop()


async def test_stop_while_steps_launched_ahead_admit_ends_every_stream_and_the_worker(tiny_v2_dir):
    """A stop that arrives while the worker takes in commands before launching a step ahead (`async_mixed`): the
    worker ends (no step launched after the stop), every stream, speaking or just sent, ends with EngineStopped."""
    eng = await start_mixed_ahead_engine(tiny_v2_dir)
    speaking = [eng.generate(f"Stream {i} keeps talking.", seed=i, max_length=40, min_length=40) for i in range(3)]
    for g in speaking:
        await asyncio.wait_for(anext(g), 30)
    just_sent = eng.generate("A late arrival.", seed=9, max_length=40, min_length=40)
    start = time.monotonic()
    await asyncio.wait_for(eng.stop(), 30)
    assert time.monotonic() - start < 10
    for g in [*speaking, just_sent]:
        with pytest.raises(EngineStopped):
            async for _ in g:
                pass
    assert [w.process.exitcode for w in eng._workers] == [0]  # it ended by itself, not killed after close()'s wait
