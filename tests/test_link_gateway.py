"""The real gateway app (`create_app`) in two "fronts" over `RemoteEngine` + `HostStore` (`gateway.link`), driven by
real WebSocket and HTTP clients, beside the same app over the engine directly (one process)."""

from __future__ import annotations

import asyncio
import io
import time

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
import soundfile

from gateway.client import ServerError, VoxgateClient
from gateway.link import EngineHost, connect
from gateway.server import ServerConfig, create_app, start_server
from gateway.store import LocalStore

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

SEED = 1234
TEXT = "Hello there."


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(tiny_v2_dir, tmp_path_factory):
    """(engine, base URL of front 1, of front 2, of the one-process app)."""
    from engine import Engine

    eng = Engine(str(tiny_v2_dir), max_num_seqs=2, max_waiting=1, inference_timesteps=4)
    await eng.wait_for_ready()
    host = EngineHost(eng, LocalStore(), tmp_path_factory.mktemp("link") / "host.sock")
    await host.start()
    links = [await connect(host.path, n) for n in (1, 2)]
    config = ServerConfig(web_client_dir=None)
    apps = [create_app(link.engine, config, store=link.store, compat=True) for link in links]
    apps.append(create_app(eng, config, store=LocalStore(), compat=True))
    runners = [await start_server(app) for app in apps]
    yield eng, *(f"127.0.0.1:{port}" for _, port in runners)
    for runner, _ in runners:
        await runner.cleanup()
    for link in links:
        await link.close()
    await host.close()
    await eng.stop()


async def idle(eng, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while eng.stats().in_flight:
        assert time.monotonic() < deadline, eng.stats()
        await asyncio.sleep(0.02)


def wav() -> bytes:
    t = np.arange(16000) / 16000
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16000, format="WAV")
    return buf.getvalue()


async def test_a_turn_through_a_front_is_the_engines_audio_with_link_ms(served):
    eng, front1, _, _ = served
    reference = np.concatenate([c.audio async for c in eng.generate(TEXT, seed=SEED)])
    async with await VoxgateClient.connect(f"ws://{front1}/v1/stream") as c:
        await c.start(output={"format": "pcm_s16le", "sample_rate": 48000}, generation={"seed": SEED})
        utt = await c.speak(TEXT, "t")
    got = np.frombuffer(b"".join(utt.payloads), dtype="<i2").astype(np.float32) / 32767.0
    assert np.max(np.abs(got[:len(reference)] - np.clip(reference, -1, 1))) < 2 / 32767
    metrics = utt.done["metrics"]
    assert 0 <= metrics["link_ms"] <= metrics["engine_ttfb_ms"]
    assert 0 <= metrics["link_request_ms"] <= metrics["link_ms"]
    await idle(eng)


async def test_a_voice_uploaded_through_one_front_speaks_through_the_other(served):
    eng, front1, front2, _ = served
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://{front1}/v1/voices", data=wav()) as r:
            assert r.status == 201, await r.text()
            voice_id = (await r.json())["voice_id"]
        revision = eng.revision
        async with http.get(f"http://{front2}/v1/voices") as r:
            assert voice_id in {v["voice_id"] for v in (await r.json())["voices"]}
        async with await VoxgateClient.connect(f"ws://{front2}/v1/stream") as c:
            await c.start(voice=voice_id, output={"format": "pcm_s16le"}, generation={"seed": SEED})
            utt = await c.speak(TEXT, "t")
        assert utt.done["audio_ms"] > 0
        # front 2's catalog loaded the stored voice into the engine it shares: the same voice, so nothing changed
        assert [v.voice_id for v in eng.list_voices()] == [voice_id] and eng.revision == revision
        async with http.delete(f"http://{front2}/v1/voices/{voice_id}") as r:
            assert r.status == 204, await r.text()
    assert eng.list_voices() == []
    await idle(eng)


async def test_engine_overload_maps_to_the_same_errors_as_in_one_process(served):
    eng, front1, _, local = served
    held = [eng.generate("Holding the engine.", seed=i, min_length=400, max_length=500) for i in range(3)]
    try:
        codes = []
        for base in (front1, local):
            async with await VoxgateClient.connect(f"ws://{base}/v1/stream") as c:
                await c.start(output={"format": "pcm_s16le"})
                with pytest.raises(ServerError) as e:
                    await c.speak(TEXT, "t", timeout=20)
                codes.append(e.value.code)
        assert codes == ["overloaded", "overloaded"]
        answers = []
        async with aiohttp.ClientSession() as http:
            for base in (front1, local):
                body = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm"}
                async with http.post(f"http://{base}/v1/audio/speech", json=body) as r:
                    answers.append((r.status, (await r.json())["error"]["code"]))
        assert answers[0] == answers[1] and answers[0][0] == 503
    finally:
        for s in held:
            await s.aclose()
    await idle(eng)
