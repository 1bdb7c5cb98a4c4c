"""Tenants (API keys) in the engine and the gateway: each request carries its key, and one key's queued prompts are
limited without touching another's. The fair prefill order itself is tested on the scheduler alone
(tests/test_engine_scheduler.py)."""

import contextlib
import io

import aiohttp
import numpy as np
import pytest
import soundfile

from engine import EngineOverloaded, InvalidParameter, TenantOverloaded, TextTooLong
from gateway.auth import Auth, tenant_of
from gateway.client import ServerError, VoxgateClient
from gateway.server import ServerConfig, create_app, start_server

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


def wav_bytes(seconds: float = 0.5) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(int(16000 * seconds), np.float32), 16000, format="WAV")
    return buf.getvalue()


@contextlib.contextmanager
def queue_limit(engine, limit: int):
    previous, engine.queued_prompts.limit = engine.queued_prompts.limit, limit
    try:
        yield
    finally:
        engine.queued_prompts.limit = previous


def waiting(engine, tenant: str):
    """A request of `tenant` that waits (its prompt audio is encoded at its first read, which never comes)."""
    return engine.generate("Hello there.", prompt_audio=wav_bytes(), prompt_text="Hi.", tenant=tenant)


async def test_a_tenant_holds_at_most_its_queue_limit_and_others_are_not_affected(engine):
    with queue_limit(engine, 2):
        held = [waiting(engine, "a"), waiting(engine, "a")]
        with pytest.raises(TenantOverloaded) as refused:
            waiting(engine, "a")
        assert isinstance(refused.value, EngineOverloaded)  # callers that only know the base type still retry
        others = [waiting(engine, "b"), waiting(engine, None), waiting(engine, "")]  # "" is the shared tenant
        await held[0].aclose()  # a request that ends (here: cancelled) frees its place
        speaking = engine.generate("Now it speaks.", tenant="a", seed=1)
        first = await anext(speaking)
        assert first.audio.size and engine.queued_prompts.counts["a"] == 1  # with its first audio it no longer counts
        held.append(waiting(engine, "a"))
        await speaking.aclose()
        for gen in held + others:
            await gen.aclose()
        assert not engine.queued_prompts.counts
        with pytest.raises(InvalidParameter):
            engine.generate("Hello.", tenant=42)
        with pytest.raises(TextTooLong):  # a request refused for its own input holds no place
            engine.generate("word " * 20000, tenant="a")
        assert not engine.queued_prompts.counts


async def test_the_gateway_passes_the_key_as_tenant_and_maps_the_queue_limit_to_rate_limited(engine):
    seen: list = []
    real_generate = engine.generate

    def spy(text, **kwargs):
        seen.append(kwargs.get("tenant"))
        return real_generate(text, **kwargs)

    engine.generate = spy
    auth = Auth({"key-a", "key-b"})
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None), auth=auth, compat=True))
    url = f"ws://127.0.0.1:{port}/v1/stream"
    try:
        async with await VoxgateClient.connect(url, api_key="key-a") as c:
            await c.start(output={"format": "pcm_s16le"})
            assert (await c.speak("Hello from key a.", "1")).done["audio_ms"] > 0
        async with aiohttp.ClientSession() as http, http.post(
                f"http://127.0.0.1:{port}/v1/audio/speech", headers={"Authorization": "Bearer key-b"},
                json={"model": "tts-1", "input": "Hello from key b.", "voice": "alloy",
                      "response_format": "pcm"}) as r:
            assert r.status == 200 and await r.read()
        assert set(seen) == {tenant_of("key-a"), tenant_of("key-b")}  # the key's digest: the engine never sees it
        with queue_limit(engine, 1):
            held = waiting(engine, tenant_of("key-a"))
            async with await VoxgateClient.connect(url, api_key="key-a") as c:
                await c.start(output={"format": "pcm_s16le"})
                with pytest.raises(ServerError) as refused:
                    await c.speak("One prompt too many.", "2")
                assert refused.value.event["code"] == "rate_limited"
            async with await VoxgateClient.connect(url, api_key="key-b") as c:  # the other key still speaks
                await c.start(output={"format": "pcm_s16le"})
                assert (await c.speak("Key b is fine.", "3")).done["audio_ms"] > 0
            await held.aclose()
    finally:
        engine.generate = real_generate
        await runner.cleanup()
    seen.clear()
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None)))
    engine.generate = spy
    try:  # without API keys every request is the shared tenant's
        async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream") as c:
            await c.start(output={"format": "pcm_s16le"})
            await c.speak("Anyone.", "1")
    finally:
        engine.generate = real_generate
        await runner.cleanup()
    assert seen and set(seen) == {None}
