"""Every input guard raises its exact type in the caller; the blocking `SyncEngine` on the tiny VoxCPM (v1) model.

One SyncEngine (one spawned worker) serves the module; guards never reach the worker.
"""

import math
import threading

import numpy as np
import pytest

from engine import (
    EmptyText,
    Engine,
    EngineOverloaded,
    EngineStopped,
    InvalidAudio,
    InvalidParameter,
    SyncEngine,
    TextTooLong,
    UnknownVoice,
)
from engine.checkpoint import load_model
from engine.engine_config import EngineConfig
from engine.offline import Synthesizer

pytestmark = pytest.mark.timeout(120)
STEPS = 3


@pytest.fixture(scope="module")
def engine(tiny_v1_dir):
    config = EngineConfig(max_num_seqs=2, max_waiting=1, num_kv_blocks=32, block_size=8, inference_timesteps=STEPS)
    eng = Engine.from_pretrained(str(tiny_v1_dir), config=config)  # the config object; other tests use keywords
    assert isinstance(eng, SyncEngine)  # no running event loop here
    eng.wait_for_ready()
    yield eng
    eng.stop()


@pytest.mark.parametrize("kwargs, error", [
    (dict(text=""), EmptyText),
    (dict(text="  \n\t "), EmptyText),
    (dict(text="word " * 2000), TextTooLong),
    (dict(cfg_value=math.nan), InvalidParameter),
    (dict(cfg_value=-1.0), InvalidParameter),
    (dict(cfg_value=1e6), InvalidParameter),
    (dict(temperature=-0.5), InvalidParameter),
    (dict(temperature=math.inf), InvalidParameter),
    (dict(timesteps=0), InvalidParameter),
    (dict(timesteps=2.5), InvalidParameter),
    (dict(timesteps=STEPS + 1), InvalidParameter),  # more than the server serves (max_timesteps: the default)
    (dict(temperature=2.5), InvalidParameter),
    (dict(max_length=0), InvalidParameter),
    (dict(min_length=-1), InvalidParameter),
    (dict(seed=-3), InvalidParameter),
    (dict(priority=True), InvalidParameter),
    (dict(text=123), InvalidParameter),
    (dict(voice="nobody"), UnknownVoice),
    (dict(prompt_latents=np.zeros((3, 2, 64), np.float32)), InvalidParameter),  # no prompt_text
    (dict(prompt_text="hi"), InvalidParameter),  # no prompt audio
    (dict(prompt_latents=np.zeros((3, 5, 64), np.float32), prompt_text="hi"), InvalidAudio),
    (dict(prompt_latents=np.full((3, 2, 64), np.nan, np.float32), prompt_text="hi"), InvalidAudio),
    (dict(reference_latents=np.zeros((3, 2, 64), np.float32)), InvalidParameter),  # v1 has no reference mode
])
def test_generate_guards(engine, kwargs, error):
    kwargs = {"text": "Hello world.", **kwargs}
    with pytest.raises(error):
        engine.generate(**kwargs)
    assert engine.stats().in_flight == 0


def test_all_finite_sees_every_value_of_small_and_large_arrays():
    """The finite check of caller-given latents (in GIL-keeping blocks when small) misses no position."""
    from engine.guards import NUMPY_GIL_HELD_ELEMENTS, all_finite

    for size in (1, NUMPY_GIL_HELD_ELEMENTS - 1, NUMPY_GIL_HELD_ELEMENTS + 1, 768, 8 * NUMPY_GIL_HELD_ELEMENTS + 3):
        a = np.ones(size, np.float32)
        assert all_finite(a) and all_finite(a.reshape(1, 1, -1))
        for pos in sorted({0, size // 2, NUMPY_GIL_HELD_ELEMENTS % size, size - 1}):
            for bad in (np.nan, np.inf, -np.inf):
                b = a.copy()
                b[pos] = bad
                assert not all_finite(b), (size, pos, bad)


def test_held_copy_is_a_read_only_float32_copy_of_any_numeric_array():
    from engine.guards import held_copy

    base = np.arange(2 * 3 * 64, dtype=np.float32).reshape(2, 3, 64)
    for a in (base, base.astype(np.float64), base.astype(np.int16), base[:, ::-1], np.asfortranarray(base)):
        c = held_copy(a)
        assert c.dtype == np.float32 and c.shape == a.shape and np.array_equal(c, a.astype(np.float32))
        assert not np.shares_memory(c, a) and not c.flags.writeable


def test_settings_errors_name_what_the_server_serves(engine, tiny_v1_dir):
    """Timesteps past the served maximum are refused up front, never sampled on a slow path, and the message says
    what is served; an engine started with a larger `max_timesteps` takes them."""
    with pytest.raises(InvalidParameter, match=rf"timesteps must be an integer in \[1, {STEPS}\] .*got {STEPS + 1}"):
        engine.generate("Hello world.", timesteps=STEPS + 1)
    with pytest.raises(InvalidParameter, match=r"cfg_value must be a finite number in \[0, 10\]"):
        engine.generate("Hello world.", cfg_value=10.5)
    assert engine.stats().in_flight == 0
    with pytest.raises(InvalidParameter, match="max_timesteps"):  # below the default: it would refuse the default
        Engine.from_pretrained(str(tiny_v1_dir), inference_timesteps=STEPS, max_timesteps=STEPS - 1)


def test_audio_and_voice_guards(engine):
    with pytest.raises(InvalidAudio):
        engine.encode_audio(b"not a wav file")
    with pytest.raises(InvalidAudio):
        engine.encode_audio(np.array([np.nan, 0.0], np.float32), 16000)
    with pytest.raises(InvalidParameter):
        engine.encode_audio(np.zeros(1600, np.float32))  # raw samples need their rate
    with pytest.raises(InvalidParameter):
        engine.add_voice(latents=np.zeros((3, 2, 64), np.float32))  # a v1 voice needs its transcript
    with pytest.raises(UnknownVoice):
        engine.remove_voice("nobody")


def test_sync_engine_matches_offline_and_v1_voice_is_a_prompt(engine, tiny_v1_dir):
    synth = Synthesizer(load_model(tiny_v1_dir))
    rng = np.random.default_rng(0)
    prompt = (rng.standard_normal(8000) * 0.1).astype(np.float32)
    voice = engine.add_voice(audio=prompt, sample_rate=16000, text="Call me back.")
    assert engine.list_voices()[0].mode == "prompt"
    results: dict[str, np.ndarray] = {}

    def run(name, **kw):
        results[name] = np.concatenate([c.audio for c in engine.generate("Two streams at once.", seed=4,
                                                                        max_length=5, timesteps=STEPS, **kw)])

    threads = [threading.Thread(target=run, args=("plain",)), threading.Thread(target=run, args=("voice",),
                                                                                kwargs=dict(voice=voice))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    plain = np.concatenate(list(synth.stream("Two streams at once.", seed=4, max_len=5, timesteps=STEPS)))
    voiced = np.concatenate(list(synth.stream("Two streams at once.", seed=4, max_len=5, timesteps=STEPS,
                                              prompt_audio=(prompt, 16000), prompt_text="Call me back.")))
    np.testing.assert_allclose(results["plain"], plain, atol=2e-4)
    np.testing.assert_allclose(results["voice"], voiced, atol=2e-4)
    info = engine.model_info()
    assert (info.architecture, info.sample_rate, info.is_demo) == ("voxcpm", 16000, False)


def test_bfloat16_vae_decoder_is_close_to_float32_and_other_dtypes_are_refused(engine, tiny_v1_dir):
    """`vae_dtype="bfloat16"` decodes in bf16 (the audio differs from float32, by bf16 rounding only); a dtype
    outside VAE_DTYPES is refused before any worker starts."""
    with pytest.raises(InvalidParameter, match="vae_dtype"):
        Engine.from_pretrained(str(tiny_v1_dir), vae_dtype="float16")
    bf16 = Engine.from_pretrained(str(tiny_v1_dir), max_num_seqs=2, num_kv_blocks=32, block_size=8,
                                  inference_timesteps=STEPS, vae_dtype="bfloat16")
    try:
        bf16.wait_for_ready()
        ours, ref = (np.concatenate([c.audio for c in e.generate("Lower precision.", seed=2, max_length=4)])
                     for e in (bf16, engine))
    finally:
        bf16.stop()
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    err = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    assert 0 < err < 0.05, err


def test_overload_is_refused_not_queued_forever(engine):
    gens = [engine.generate("Hello there.", seed=i, max_length=2) for i in range(3)]  # 2 running + 1 waiting
    with pytest.raises(EngineOverloaded):
        engine.generate("One too many.")
    for g in gens:
        assert len(list(g)) == 2
    assert engine.stats().in_flight == 0


def test_stopped_engine_refuses_work(tiny_v1_dir, engine):
    engine.stop()
    with pytest.raises(EngineStopped):
        engine.generate("Anyone there?")
