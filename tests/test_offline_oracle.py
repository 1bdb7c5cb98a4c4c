"""End-to-end parity with the official package: both load the SAME tiny checkpoint directory written by our writer,
get the same noise, and must produce the same waveform (offline and streaming), in every prompt mode."""

import contextlib
import io

import numpy as np
import pytest
import soundfile as sf
import torch
from oracle import injected_noise

from engine.checkpoint import load_model
from engine.offline import Synthesizer

TEXTS = {"en": "Hello world, this is a test.", "zh": "你好，世界！我们可以说中文。"}
PROMPT_TEXT = {"en": "Please call me back.", "zh": "语音合成技术。"}
TIMESTEPS, MAX_LEN, CFG = 4, 7, 2.0
# FSQ rounds tanh(x) * 9 to a grid; with random weights a value can land within float noise (~1e-6) of a rounding
# boundary, where the two implementations may legitimately round apart and diverge from that step on. Seed 1 does
# this for the Chinese continuation case (margin 1.9e-6 at step 7), so these seeds avoid such ties.
SEEDS = [0, 2]


def _official(model_dir):
    from voxcpm.model.voxcpm import VoxCPMModel
    from voxcpm.model.voxcpm2 import VoxCPM2Model

    cls = VoxCPM2Model if "v2" in model_dir.name else VoxCPMModel
    with contextlib.redirect_stderr(io.StringIO()):
        return cls.from_local(str(model_dir), optimize=False, device="cpu")


@pytest.fixture(scope="module")
def v2(tiny_v2_dir):
    return _official(tiny_v2_dir), Synthesizer(load_model(tiny_v2_dir))


@pytest.fixture(scope="module")
def v1(tiny_v1_dir):
    return _official(tiny_v1_dir), Synthesizer(load_model(tiny_v1_dir))


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    """16 kHz float WAVs (the tiny VAEs' input rate, so nobody resamples) of lengths that need padding."""
    d = tmp_path_factory.mktemp("wavs")
    t = np.arange(9000) / 16000
    prompt = (0.3 * np.sin(2 * np.pi * 220 * t * (1 + t))).astype(np.float32)
    reference = (0.2 * np.sign(np.sin(2 * np.pi * 150 * t[:6000]))).astype(np.float32)
    sf.write(d / "prompt.wav", prompt, 16000, subtype="FLOAT")
    sf.write(d / "reference.wav", reference, 16000, subtype="FLOAT")
    return d / "prompt.wav", d / "reference.wav"


@pytest.fixture(autouse=True)
def _torchaudio_from_soundfile(monkeypatch):
    """The official v1 reads prompt audio with torchaudio (stubbed here): serve it from soundfile instead."""
    import voxcpm.model.voxcpm as v1_module

    def load(path):
        data, sr = sf.read(str(path), dtype="float32", always_2d=True)
        return torch.from_numpy(data.T.copy()), sr

    monkeypatch.setattr(v1_module.torchaudio, "load", load, raising=False)


def _noise(seed, patch_size, n=MAX_LEN):
    gen = torch.Generator().manual_seed(seed)  # Synthesizer's documented rule: step i takes the i-th draw
    return [torch.randn(1, 64, patch_size, generator=gen) for _ in range(n)]


def _close(ours, theirs, what):
    theirs = np.asarray(theirs, dtype=np.float32).reshape(-1)
    assert ours.shape == theirs.shape, f"{what}: {ours.shape} vs {theirs.shape} samples"
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    assert rel < 2e-4, f"{what}: relative error {rel:.2e}"


def _run(official, ours, lang, mode, seed, wavs):
    prompt_wav, reference_wav = wavs
    continuation = "cont" in mode
    kw_official = dict(target_text=TEXTS[lang], inference_timesteps=TIMESTEPS, cfg_value=CFG, max_len=MAX_LEN)
    kw_ours = dict(timesteps=TIMESTEPS, cfg_value=CFG, max_len=MAX_LEN, seed=seed)
    if continuation:
        kw_official |= dict(prompt_text=PROMPT_TEXT[lang], prompt_wav_path=str(prompt_wav))
        kw_ours |= dict(prompt_text=PROMPT_TEXT[lang], prompt_audio=prompt_wav)
    if "ref" in mode:
        kw_official |= dict(reference_wav_path=str(reference_wav))
        kw_ours |= dict(reference_audio=reference_wav)
    patch = ours.config.patch_size
    with injected_noise(official, _noise(seed, patch)), contextlib.redirect_stderr(io.StringIO()):
        off_offline = official.generate(**kw_official, retry_badcase=False)[0].numpy()
    with injected_noise(official, _noise(seed, patch)), contextlib.redirect_stderr(io.StringIO()):
        off_stream = [c.numpy() for c in official.generate_streaming(**kw_official)]

    chunks = list(ours.stream(TEXTS[lang], **kw_ours))
    offline = ours.generate(TEXTS[lang], **kw_ours)
    assert all(c.shape == (ours.config.samples_per_patch,) for c in chunks)
    streamed = np.concatenate(chunks)
    assert np.isfinite(offline).all() and np.abs(offline).max() > 1e-3
    _close(streamed, offline, "ours streaming vs ours offline")
    if continuation and not ours.config.is_v2:
        # The official v1 offline output also holds the audio of the 2 prompt patches it decodes as context.
        off_offline = off_offline[-len(offline):] if len(off_offline) > len(offline) else off_offline
    _close(offline, off_offline, "ours vs official generate")
    return streamed, off_stream


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("mode", ["zero-shot", "cont", "ref", "ref+cont"])
def test_voxcpm2_matches_official(v2, wavs, mode, lang, seed):
    official, ours = v2
    streamed, off_stream = _run(official, ours, lang, mode, seed, wavs)
    if "cont" not in mode:
        _close(streamed, np.concatenate(off_stream, axis=-1), "ours vs official generate_streaming")
    else:
        # The official streaming decoder starts from silence instead of the prompt's last patches, so only its
        # chunk count matches here; our streaming equals the official offline decode (checked in _run).
        assert len(off_stream) * ours.config.samples_per_patch == len(streamed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("mode", ["zero-shot", "cont"])
def test_voxcpm1_matches_official(v1, wavs, mode, lang, seed):
    official, ours = v1
    streamed, off_stream = _run(official, ours, lang, mode, seed, wavs)
    # The official v1 streaming re-decodes the last 3 patches (an approximation); ours is exact, so compare counts.
    assert len(off_stream) * ours.config.samples_per_patch == len(streamed)


def test_bad_input_fails_at_the_call(v1, v2):
    from engine.errors import EmptyText, InvalidAudio, InvalidParameter, InvalidRequest

    ours = v2[1]
    wav = (np.zeros(8000, dtype=np.float32), 16000)
    for kwargs, error in [
        (dict(text=" \n\t"), EmptyText), (dict(text="hi", cfg_value=float("nan")), InvalidParameter),
        (dict(text="hi", timesteps=0), InvalidParameter), (dict(text="hi", temperature=-1.0), InvalidParameter),
        (dict(text="hi", max_len=0), InvalidParameter), (dict(text="hi", prompt_audio=wav), InvalidRequest),
        (dict(text="hi", prompt_text="x", prompt_audio=b"not audio"), InvalidAudio),
        (dict(text="hi", reference_audio=(np.zeros(0, np.float32), 16000)), InvalidAudio),
        (dict(text="hi", reference_audio=(np.full(800, np.nan, np.float32), 16000)), InvalidAudio),
        (dict(text="hi", reference_audio=(np.zeros(800, np.float32), 0)), InvalidAudio),
    ]:
        with pytest.raises(error):
            ours.stream(**kwargs)  # raised by the call itself, before any audio is generated
    with pytest.raises(InvalidRequest, match="VoxCPM2"):
        v1[1].stream("hi", reference_audio=wav)


def test_prompt_audio_is_mixed_and_resampled(v2):
    import soxr

    ours = v2[1]
    t = np.arange(12000) / 16000
    mono = (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)
    base = ours.encode_audio((mono, 16000), "left")
    assert base.shape == (5, ours.config.patch_size, 64)  # 12000 samples left-padded to 5 patches of 4 x 640
    stereo = np.stack([mono * 0.5, mono * 1.5], axis=1)  # soundfile layout [N, C]: mixes to `mono`
    assert torch.allclose(ours.encode_audio((stereo, 16000), "left"), base, atol=1e-6)
    at_48k = soxr.resample(mono, 16000, 48000)
    resampled = ours.encode_audio((at_48k, 48000), "left")
    assert resampled.shape == base.shape
    assert torch.allclose(resampled, base, atol=0.05 * base.abs().max().item())
    right = ours.encode_audio((mono, 16000), "right")
    assert right.shape == base.shape and not torch.allclose(right, base)
