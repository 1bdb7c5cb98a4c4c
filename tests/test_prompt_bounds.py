"""Prompt and voice audio bounds: a documented maximum length checked from the header before decoding, and the
worker's encode (and LoRA load) done in slices between steps, so speaking streams keep their pace meanwhile."""

import asyncio
import io
import itertools
import struct
import time

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
import soundfile
import torch

from engine import AudioTooLong
from engine.chores import CHORE_SLICE_MS
from engine.guards import MAX_PROMPT_AUDIO_S
from engine.prompt import encode_in_slices, encode_prompt_audio, prompt_samples, read_audio
from gateway.client import VoxgateClient
from gateway.protocol import AudioFrame
from gateway.server import ServerConfig, create_app, start_server

pytestmark = pytest.mark.timeout(120)
in_module_loop = pytest.mark.asyncio(loop_scope="module")

PATCH_GAP_MS = 160.0  # one patch of the tiny VoxCPM2 (and of VoxCPM2)


def wav_header(frames: int, rate: int, bits: int) -> bytes:
    """A PCM WAV file of `frames` silent mono samples, built without any encoder (fast even for minutes)."""
    size = frames * bits // 8
    return (b"RIFF" + struct.pack("<I", 36 + size) + b"WAVEfmt " +
            struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * bits // 8, bits // 8, bits) +
            b"data" + struct.pack("<I", size)) + bytes(size)


def wav(seconds: float, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV",
                    subtype="PCM_16")
    return buf.getvalue()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def base(engine):
    from gateway.text import normalize

    runner, port = await start_server(create_app(engine, ServerConfig()))
    # the server loads its text-normalisation grammars in a thread at start (seconds of GIL on a busy machine):
    # done before the tests, whose chunk timings are this process's event loop's too
    await asyncio.to_thread(normalize.preload)
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def test_sliced_encode_equals_the_offline_encode(tiny_v2_dir):
    from engine.checkpoint import load_model

    loaded = load_model(tiny_v2_dir)
    audio = np.random.default_rng(0).standard_normal(16000 * 3).astype(np.float32) * 0.2
    p = loaded.config.patch_size
    for pad in ("left", "right"):
        offline = encode_prompt_audio(loaded.vae, audio, 16000, patch_size=p, pad=pad)
        chore = encode_in_slices(loaded.vae, prompt_samples(audio, 16000, loaded.vae.sample_rate), patch_size=p,
                                 pad=pad, slice_ms=1e-3)  # chunks of one patch: the most seams
        slices = 0
        try:
            while True:
                assert next(chore) is False  # on the CPU a chunk is done when its slice ends
                slices += 1
        except StopIteration as done:
            sliced = done.value
        assert slices == len(offline) and torch.allclose(sliced, offline, atol=1e-5)


def test_the_encoder_streams_through_the_fused_residual_units_too(tiny_v2_dir, monkeypatch):
    """CUDA's path (the Triton residual units with their history), here in Triton's interpreter."""
    from engine.checkpoint import load_model
    from engine.model import audio_vae

    vae = load_model(tiny_v2_dir).vae
    hop = vae.encoder_hop * 4
    audio = torch.randn(1, 1, hop * 4, generator=torch.Generator().manual_seed(0)) * 0.3
    offline = vae.encode(audio)
    monkeypatch.setattr(audio_vae, "FUSED_DECODER", True)
    state = vae.encode_state()
    streamed = torch.cat([vae.encode_stream(audio[..., i * hop:(i + 1) * hop], state) for i in range(4)], dim=-1)
    assert torch.allclose(streamed, offline, atol=1e-5)


def test_the_length_is_checked_from_the_header_and_raw_samples_before_conversion(monkeypatch):
    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded")

    monkeypatch.setattr(soundfile, "read", no_decoding)
    for data in (wav_header(10 * 60 * 16000, 16000, 16), wav_header(40 * 60 * 8000, 8000, 8)):
        assert len(data) < 20 << 20  # under the gateway's upload limit: only the length refuses them
        with pytest.raises(AudioTooLong, match="at most 60 s"):
            read_audio(data)
    with pytest.raises(AudioTooLong):
        prompt_samples(np.zeros(int(MAX_PROMPT_AUDIO_S * 16000) + 16000, np.float32), 16000, 16000)
    with pytest.raises(AudioTooLong):  # a minute, but of 8 channels at 192 kHz: too many samples to decode
        prompt_samples(np.zeros((8, 192000 * 59), np.float32), 192000, 16000)


@in_module_loop
async def test_a_10_minute_wav_upload_is_refused_before_decoding(base, monkeypatch):
    decoded = []
    real_read = soundfile.read
    monkeypatch.setattr(soundfile, "read", lambda *a, **k: decoded.append(1) or real_read(*a, **k))
    async with aiohttp.ClientSession() as http:
        t0 = time.perf_counter()
        async with http.post(f"{base}/v1/voices", data=wav_header(10 * 60 * 16000, 16000, 16)) as r:
            assert r.status == 413, await r.text()
            error = (await r.json())["error"]
        elapsed = time.perf_counter() - t0
        assert error["code"] == "message_too_large" and "60 s" in error["message"]
        assert not decoded and elapsed < 5.0
        async with http.post(f"{base}/v1/voices", data=wav(2.0)) as r:  # a legal one still goes through
            assert r.status == 201, await r.text()
    assert decoded


@in_module_loop
async def test_a_maximum_length_encode_keeps_a_speaking_stream_within_one_patch_and_the_slice(engine):
    """Tiny VoxCPM2 on the CPU: encoding a minute of audio at once stalls the worker ~0.5 s (seconds on a busy
    machine); in slices the stream's chunks keep coming."""
    arrivals: list[float] = []

    async def speak() -> None:
        async for _ in engine.generate("A long stream that keeps speaking while a voice is encoded.", seed=1,
                                       min_length=400, max_length=410):
            arrivals.append(time.perf_counter())

    audio = np.random.default_rng(1).standard_normal(int(MAX_PROMPT_AUDIO_S * 16000)).astype(np.float32) * 0.1
    stream = asyncio.create_task(speak())
    while len(arrivals) < 3:
        await asyncio.sleep(0.01)
    began = time.perf_counter()
    patches = await engine.encode_audio(audio, 16000)
    ended = time.perf_counter()
    while sum(t > ended for t in arrivals) < 3:  # the wait that spans the encode's end, and the next ones
        assert not stream.done()  # the stream speaks all through the encode
        await asyncio.sleep(0.01)
    stream.cancel()
    assert patches.shape[0] == MAX_PROMPT_AUDIO_S * 1000 / PATCH_GAP_MS
    # every wait for a chunk that overlapped the encode
    gaps = [1000.0 * (b - a) for a, b in itertools.pairwise(arrivals) if b >= began and a <= ended]
    assert max(gaps) < PATCH_GAP_MS + CHORE_SLICE_MS, gaps
    assert len(gaps) > 5  # many steps ran during the encode, not one stall


@in_module_loop
async def test_a_maximum_length_upload_during_a_turn_keeps_its_max_gap(base):
    """The gateway's view (context.done metrics). The tiny model speaks so much faster than real time that the
    gateway holds whole segments ahead, which would hide a stall of this size: the test above is the sharp one."""
    text = " ".join(f"Sentence number {i} of a turn that keeps on speaking." for i in range(8))
    async with await VoxgateClient.connect(base.replace("http", "ws") + "/v1/stream") as c:
        await c.start(output={"format": "pcm_s16le"})
        await c.append(text, "t")
        await c.end("t")
        while not isinstance(await c.recv(timeout=30), AudioFrame):
            pass  # until the turn speaks
        turn = asyncio.create_task(c.collect("t", timeout=60))
        async with aiohttp.ClientSession() as http, \
                http.post(f"{base}/v1/voices", data=wav(MAX_PROMPT_AUDIO_S)) as r:
            assert r.status == 201, await r.text()
        assert not turn.done()  # the upload was encoded while the turn spoke
        utt = await turn
    metrics = utt.done["metrics"]
    assert utt.done["audio_ms"] > 0 and utt.frames
    assert metrics["max_gap_ms"] < PATCH_GAP_MS + CHORE_SLICE_MS, metrics
