"""The benchmark-only stand-in engine (bench/paced_engine.py) behind the real gateway: it must speak the engine API
the gateway uses, at real-time pace, or the capacity numbers measured with it mean nothing."""

import time

import numpy as np
import opuslib
import pytest

from bench.paced_engine import PATCH_MS, PacedEngine
from gateway.client import VoxgateClient
from gateway.protocol import AudioFrame
from gateway.server import ServerConfig, create_app, start_server

pytestmark = pytest.mark.timeout(60)


async def test_opus_turn_through_the_gateway_arrives_at_real_time_pace():
    engine = PacedEngine()
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None)))
    try:
        async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream") as c:
            await c.start(output={"format": "opus"}, generation={"max_length": 4})
            utt = await c.speak("A short turn of four patches.", "t")
            arrivals = []
            t0 = time.monotonic()
            await c.append("And a second one, timed.", "u")
            await c.end("u")
            while True:
                event = await c.recv(10)
                if isinstance(event, AudioFrame):
                    arrivals.append(time.monotonic() - t0)
                elif event["type"] == "context.done":
                    break
    finally:
        await runner.cleanup()
        await engine.stop()
    decoder = opuslib.Decoder(48000, 1)
    pcm = np.concatenate([np.frombuffer(decoder.decode(p, 960), dtype="<i2") for p in utt.payloads])
    assert len(pcm) >= 4 * PATCH_MS * 48  # four patches, plus the codec's padding
    assert np.abs(pcm).max() > 1000  # the waveform, not silence
    assert utt.done["audio_ms"] >= 4 * PATCH_MS
    # one patch per tick: four patches take three tick intervals after the first
    assert arrivals[-1] - arrivals[0] >= 3 * PATCH_MS / 1000 * 0.8
    assert engine.stats().in_flight == 0
