"""VOXGATE_ENCODE_PROCS=2 end to end: a real aiohttp server over the real tiny engine, the real WebSocket client.
Opus turns are encoded in encoder processes and decode to the engine's audio; a turn whose process is killed ends with
a typed error while another session's turn goes on; closed turns leave no encoder behind; the server's shutdown
leaves no process."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import opuslib
import pytest

from gateway.app_keys import GATEWAY
from gateway.client import ServerError, VoxgateClient
from gateway.encode_procs import ProcEncoder, shared_procs
from gateway.server import ServerConfig, create_app, start_server
from tests.test_gateway_encode_procs import gone

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

SEED = 1234
TEXT = "Hello there."
LONG = ("This turn is long enough to still be encoding when its process goes away. It has a second sentence, then "
        "a third one, and a fourth that goes on for a while longer than the others do.")


def decode(payloads: list[bytes]) -> np.ndarray:
    decoder = opuslib.Decoder(48000, 1)
    pcm = np.concatenate([np.frombuffer(decoder.decode(p, 960), dtype="<i2") for p in payloads])
    return pcm.astype(np.float32) / 32767.0


async def started(url: str) -> VoxgateClient:
    client = await VoxgateClient.connect(url)
    await client.start(output={"format": "opus", "bitrate": 128000}, generation={"seed": SEED})
    return client


async def test_opus_through_encoder_processes(engine, monkeypatch):
    monkeypatch.setenv("VOXGATE_ENCODE_PROCS", "2")
    reference = np.concatenate([c.audio async for c in engine.generate(TEXT, seed=SEED)])
    app = create_app(engine, ServerConfig(web_client_dir=None))
    runner, port = await start_server(app)
    url = f"ws://127.0.0.1:{port}/v1/stream"
    try:
        async with await started(url) as c:
            utt = await c.speak(TEXT, "t")
        host = shared_procs(2)
        pids = host.pids
        assert len(pids) == 2  # the turn was encoded there, not in the thread pool
        got = decode(utt.payloads)[312:312 + len(reference)]  # past Opus's encoder delay at 48 kHz
        assert len(got) == len(reference)
        corr = float(np.dot(got, reference) / (np.linalg.norm(got) * np.linalg.norm(reference) + 1e-12))
        assert corr > 0.9, f"decoded Opus does not match the engine's audio (correlation {corr:.3f})"
        metrics = utt.done["metrics"]  # the first frame's encode call is part of what the server adds to first audio
        assert 0 < metrics["first_encode_ms"] <= metrics["ttfb_ms"] - metrics["engine_ttfb_ms"], metrics

        # a turn whose encoder process dies ends with a typed error; another session's turn goes on
        async with await started(url) as a, await started(url) as b:
            for client, ctx in ((a, "a"), (b, "b")):
                await client.append(LONG, ctx)
                await client.end(ctx)
            turn = None
            while turn is None or not turn.playout.sent_ms:  # the turn's first audio went out
                await asyncio.sleep(0.01)
                turn = next((s.turns["a"] for s in app[GATEWAY].sessions if "a" in s.turns), None)
            encoder = turn.encoder
            assert isinstance(encoder, ProcEncoder)
            victim = encoder._process.pid
            os.kill(victim, signal.SIGKILL)
            with pytest.raises(ServerError) as failed:
                await a.collect("a", timeout=30)
            assert failed.value.event["code"] == "engine_error" and failed.value.event["context_id"] == "a"
            assert "encoder process" in failed.value.event["message"]
            done = await b.collect("b", timeout=60)
            assert done.done is not None and done.frames
            again = await a.speak(TEXT, "a2")  # the session goes on, on the replacement process
            assert decode(again.payloads).size
        assert gone(victim) and len(host.pids) == 2
        assert await host.open_counts() == [0, 0]  # every turn's encoder freed: ended, failed and closed ones
        pids = host.pids
    finally:
        await runner.cleanup()
    assert all(gone(pid) for pid in pids)  # the server's shutdown stopped them
