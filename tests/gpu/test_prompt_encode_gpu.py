"""Prompt audio on the GPU: the sliced encode (a worker chore) equals the one-go encode, its chunks are timed by CUDA
events without the host waiting on them, and a minute of audio encoded during speaking streams keeps their chunks
within one patch and the slice bound."""

import asyncio
import itertools
import time

import numpy as np
import pytest
import torch

from engine.chores import CHORE_SLICE_MS
from engine.guards import MAX_PROMPT_AUDIO_S
from engine.prompt import encode_in_slices, encode_prompt_audio, prompt_samples

pytestmark = pytest.mark.timeout(300)


def test_sliced_encode_equals_the_one_go_encode_on_cuda(voxcpm2_dir, cuda, monkeypatch):
    from engine.checkpoint import load_model

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # chunks may pick other algorithms: full fp32

    loaded = load_model(voxcpm2_dir, cuda)
    vae, p = loaded.vae, loaded.config.patch_size
    audio = np.random.default_rng(0).standard_normal(16000 * 20).astype(np.float32) * 0.2
    offline = encode_prompt_audio(vae, audio, 16000, patch_size=p, pad="right")
    chore = encode_in_slices(vae, prompt_samples(audio, 16000, vae.sample_rate), patch_size=p, pad="right",
                             slice_ms=CHORE_SLICE_MS)
    slices = 0
    try:
        while True:
            assert next(chore) is True  # on CUDA each chunk's slice ends with the chunk on the device
            slices += 1
    except StopIteration as done:
        sliced = done.value
    assert slices > 1
    err = ((sliced - offline).norm() / offline.norm()).item()
    assert err < 1e-4, err


@pytest.mark.asyncio
async def test_a_minute_of_prompt_audio_keeps_64_speaking_streams_within_a_patch_and_the_slice(voxcpm2_dir):
    from engine import Engine

    async with Engine(str(voxcpm2_dir), max_num_seqs=64) as engine:
        await engine.wait_for_ready()
        arrivals: dict[int, list[float]] = {i: [] for i in range(64)}

        async def speak(i: int) -> None:
            async for _ in engine.generate("A stream that keeps speaking while a voice is encoded.", seed=i,
                                           min_length=200, max_length=200):
                arrivals[i].append(time.perf_counter())

        streams = [asyncio.create_task(speak(i)) for i in range(64)]
        while min(len(a) for a in arrivals.values()) < 5:
            await asyncio.sleep(0.01)
        audio = np.random.default_rng(1).standard_normal(int(MAX_PROMPT_AUDIO_S * 16000)).astype(np.float32) * 0.1
        began = time.perf_counter()
        await engine.encode_audio(audio, 16000)
        ended = time.perf_counter()
        await asyncio.sleep(0.5)
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    patch_ms = engine.model_info().patch_ms
    gaps = [1000.0 * (b - a) for times in arrivals.values() for a, b in itertools.pairwise(times)
            if b >= began and a <= ended]
    assert gaps and max(gaps) < patch_ms + CHORE_SLICE_MS, (max(gaps), ended - began)
