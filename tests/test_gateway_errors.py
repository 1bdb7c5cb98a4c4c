"""Bad input, limits, auth, idle and slow clients against a real server and the real tiny engine: each case gets
its documented error; non-fatal errors leave the session working; other sessions never notice."""

import asyncio
import json
import socket
import time

import pytest
import pytest_asyncio
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.auth import Auth
from gateway.client import VoxgateClient
from gateway.protocol import Limits
from gateway.server import ServerConfig, create_app, start_server
from gateway.session import SessionConfig

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

LIMITS = Limits(max_message_bytes=2000, max_text_chars=100, max_buffered_chars=300, max_contexts=2)
LONG_TEXT = ("A slow listener gets a long answer, with several clauses and sentences to speak. "
             "It keeps going for a while, so that the audio fills every buffer on the way. "
             "And then it goes on a little more.")


async def _serve(engine, config: ServerConfig, auth: Auth | None = None):
    runner, port = await start_server(create_app(engine, config, auth=auth))
    return runner, port


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def url(engine):
    runner, port = await _serve(engine, ServerConfig(session=SessionConfig(limits=LIMITS), web_client_dir=None))
    yield f"ws://127.0.0.1:{port}/v1/stream"
    await runner.cleanup()


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def secured(engine):
    clock = Clock()
    auth = Auth({"good-key"}, token_ttl_s=30, clock=clock)
    runner, port = await _serve(engine, ServerConfig(web_client_dir=None), auth)
    yield port, clock
    await runner.cleanup()


async def _started(url: str, **start) -> VoxgateClient:
    c = await VoxgateClient.connect(url)
    await c.start(**start)
    return c


async def _error_for(c: VoxgateClient, message: dict | str | bytes) -> dict:
    await c.ws.send(message if isinstance(message, str | bytes) else json.dumps(message))
    return await c.expect("error")


async def _alive(c: VoxgateClient) -> None:
    await c.ping("alive?")
    while (pong := await c.expect("pong"))["id"] != "alive?":  # earlier pongs may still be queued
        assert pong["type"] == "pong"


@pytest.mark.parametrize("message, code", [
    ("{this is not json", "bad_json"),
    ({"type": "text.append", "context_id": "c"}, "missing_field"),
    ({"type": "text.append", "context_id": "c", "text": "hi", "speed": 2}, "unknown_field"),
    ({"type": "text.append", "context_id": 5, "text": "hi"}, "invalid_value"),
    ({"type": "playback.position", "context_id": "c", "played_ms": "soon"}, "invalid_value"),
    ({"type": "text.append", "context_id": "c", "text": "x" * 101}, "text_too_long"),
    (json.dumps({"type": "ping", "id": "p" * 3000}), "message_too_large"),
    (b"\x56\x01binary", "unsupported_frame"),
    ({"type": "context.end", "context_id": "nobody"}, "unknown_context"),
    ({"type": "session.start"}, "already_started"),
    ({"type": "session.update", "output": {"format": "opus", "sample_rate": 44100}}, "invalid_value"),
    ({"type": "session.update", "output": {"format": "flac"}}, "invalid_value"),
    ({"type": "session.update", "voice": "no-such-voice"}, "unknown_voice"),
    ({"type": "session.update", "chunking": {"first_chars": -1}}, "invalid_value"),
])
async def test_bad_message_gets_its_error_and_the_session_goes_on(url, message, code):
    async with await _started(url) as c:
        error = await _error_for(c, message)
        assert error["code"] == code and error["fatal"] is False and error["message"]
        await _alive(c)
        utt = await c.speak("Still working.", "after")  # and it still speaks
        assert utt.done["audio_ms"] > 0


async def test_messages_before_session_start_are_refused(url):
    async with await VoxgateClient.connect(url) as c:
        error = await _error_for(c, {"type": "text.append", "context_id": "c", "text": "hi"})
        assert error["code"] == "not_started" and error["context_id"] == "c"
        await c.start()  # still possible afterwards
        await _alive(c)


async def test_unknown_voice_and_bad_format_at_session_start(url):
    async with await VoxgateClient.connect(url) as c:
        assert (await _error_for(c, {"type": "session.start", "voice": "ghost"}))["code"] == "unknown_voice"
        bad_rate = {"type": "session.start", "output": {"format": "mulaw", "sample_rate": 16000}}
        assert (await _error_for(c, bad_rate))["code"] == "invalid_value"
        assert (await c.start(output={"format": "mulaw"}))["output"]["sample_rate"] == 8000


async def test_sampling_settings_the_engine_does_not_serve_are_refused_at_session_start(url, engine):
    """Generation settings are checked against the engine's own ranges (one definition with its guard): timesteps
    above the served maximum get invalid_value naming what is served, before any audio, never a slow path; served
    settings (fewer steps, no guidance) then start and speak."""
    served = engine.sampling_ranges.max_timesteps
    async with await VoxgateClient.connect(url) as c:
        for generation, words in (({"timesteps": served + 1}, f"[1, {served}]"), ({"cfg_value": 11}, "[0, 10]"),
                                  ({"temperature": 2.5}, "[0, 2]"), ({"timesteps": 0}, f"[1, {served}]")):
            error = await _error_for(c, {"type": "session.start", "generation": generation})
            assert error["code"] == "invalid_value" and words in error["message"], error
        await c.start(generation={"timesteps": 1, "cfg_value": 1.0})
        error = await _error_for(c, {"type": "session.update", "generation": {"timesteps": served + 1}})
        assert error["code"] == "invalid_value" and error["fatal"] is False
        utt = await c.speak("Fewer steps, no guidance.", "t")
        assert utt.done["audio_ms"] > 0


async def test_too_many_contexts(url):
    async with await _started(url) as c:
        await c.append("One", "a")
        await c.append("Two", "b")
        error = await _error_for(c, {"type": "text.append", "context_id": "c", "text": "Three"})
        assert error["code"] == "too_many_contexts" and error["context_id"] == "c"
        await c.cancel("a")
        await c.expect("context.cancelled")
        await c.append("Three, now that there is room.", "c")  # room again
        await c.end("c")
        assert (await c.collect("c")).done is not None


async def test_buffered_text_per_turn_is_bounded(url):
    async with await _started(url) as c:
        for _ in range(3):
            await c.append("word " * 19, "t")  # 95 characters each, no boundary: it stays buffered
        error = await _error_for(c, {"type": "text.append", "context_id": "t", "text": "word " * 19})
        assert error["code"] == "buffer_full" and error["context_id"] == "t"
        await c.cancel("t")
        await c.expect("context.cancelled")


async def test_text_after_context_end_is_refused(url):
    async with await _started(url) as c:
        await c.append("The end.", "t")
        await c.end("t")
        error = await _error_for(c, {"type": "text.append", "context_id": "t", "text": "More?"})
        assert error["code"] == "context_closed"
        assert (await c.collect("t")).done is not None  # the turn itself is unharmed


async def test_missing_or_invalid_key_is_refused_at_the_handshake(secured):
    port, _ = secured
    url = f"ws://127.0.0.1:{port}/v1/stream"
    for key in (None, "wrong-key"):
        with pytest.raises(InvalidStatus) as e:
            await VoxgateClient.connect(url, api_key=key)
        assert e.value.response.status_code == 401
    async with await VoxgateClient.connect(url, api_key="good-key") as c:
        await c.start()
        await _alive(c)


async def test_browser_tokens_are_single_use_and_expire(secured):
    import aiohttp

    port, clock = secured
    base = f"http://127.0.0.1:{port}"
    url = f"ws://127.0.0.1:{port}/v1/stream"
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/tokens") as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "unauthorized"
        tokens = []
        for _ in range(2):
            async with http.post(f"{base}/v1/tokens", headers={"Authorization": "Bearer good-key"}) as r:
                assert r.status == 200
                tokens.append((await r.json())["token"])
    async with await VoxgateClient.connect(url, token=tokens[0]) as c:
        await c.start()
        await _alive(c)
    with pytest.raises(InvalidStatus) as e:  # used once already
        await VoxgateClient.connect(url, token=tokens[0])
    assert e.value.response.status_code == 401
    clock.now += 31  # past the token's lifetime
    with pytest.raises(InvalidStatus) as e:
        await VoxgateClient.connect(url, token=tokens[1])
    assert e.value.response.status_code == 401
    with pytest.raises(InvalidStatus):
        await VoxgateClient.connect(url, token="made-up")


async def test_idle_session_is_closed_but_ping_keeps_it_open(engine):
    limits = Limits(idle_timeout_s=1.0)
    runner, port = await _serve(engine, ServerConfig(session=SessionConfig(limits=limits), web_client_dir=None))
    url = f"ws://127.0.0.1:{port}/v1/stream"
    try:
        async with await _started(url) as keeper, await _started(url) as idler:
            for _ in range(8):  # 1.6 s: longer than the timeout
                await asyncio.sleep(0.2)
                await keeper.ping()
            error = await idler.expect("error", timeout=5)
            assert error["code"] == "idle_timeout" and error["fatal"] is True
            await asyncio.wait_for(idler.ws.wait_closed(), 5)
            await _alive(keeper)
    finally:
        await runner.cleanup()


async def test_slow_consumer_is_dropped_and_a_healthy_session_is_unaffected(engine):
    limits = Limits(slow_consumer_timeout_s=1.0)
    config = ServerConfig(session=SessionConfig(limits=limits), web_client_dir=None, socket_send_buffer=4096)
    runner, port = await _serve(engine, config)
    url = f"ws://127.0.0.1:{port}/v1/stream"
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        # a client that stops reading: a one-message queue, a small socket buffer, and no recv() calls
        slow = await VoxgateClient.connect(url, sock=sock, max_queue=1)
        await slow.start(output={"format": "pcm_s16le", "sample_rate": 48000})
        async with await _started(url, output={"format": "pcm_s16le"}) as healthy:
            await slow.append(LONG_TEXT, "t")
            await slow.end("t")
            utt = await healthy.speak("I am fine, thank you.", "h")
            assert utt.done["audio_ms"] > 0
            end = time.monotonic() + 10
            while 'voxgate_errors_total{code="slow_consumer"} 1.0' not in await _get(port, "/metrics"):
                assert time.monotonic() < end, "the stalled client was not dropped"
                await asyncio.sleep(0.1)
            assert "voxgate_sessions 1.0" in await _get(port, "/metrics")  # only the healthy one is left
            await _alive(healthy)
        with pytest.raises(ConnectionClosed):  # once it reads again, the stalled client finds its socket dropped
            while True:
                await slow.recv(5)
    finally:
        await runner.cleanup()
    end = time.monotonic() + 5
    while engine.stats().in_flight and time.monotonic() < end:
        await asyncio.sleep(0.05)
    assert engine.stats().in_flight == 0


async def test_session_limits_refuse_with_a_clear_error(engine):
    runner, port = await _serve(engine, ServerConfig(max_sessions=1, web_client_dir=None))
    url = f"ws://127.0.0.1:{port}/v1/stream"
    try:
        async with await _started(url) as first:
            second = await VoxgateClient.connect(url)
            error = await second.expect("error")
            assert error["code"] == "overloaded" and error["fatal"] is True
            await asyncio.wait_for(second.ws.wait_closed(), 5)
            await _alive(first)
    finally:
        await runner.cleanup()


async def _get(port: int, path: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}{path}") as r:
        assert r.status == 200
        return await r.text()


async def test_sessions_per_key_are_limited(engine):
    auth = Auth({"key-a", "key-b"})
    runner, port = await _serve(engine, ServerConfig(max_sessions_per_key=1, web_client_dir=None), auth)
    url = f"ws://127.0.0.1:{port}/v1/stream"
    try:
        async with await VoxgateClient.connect(url, api_key="key-a") as first:
            await first.start()
            second = await VoxgateClient.connect(url, api_key="key-a")
            error = await second.expect("error")
            assert error["code"] == "rate_limited" and error["fatal"] is True
            async with await VoxgateClient.connect(url, api_key="key-b") as other:  # other keys are not affected
                await other.start()
                await _alive(other)
            await _alive(first)
    finally:
        await runner.cleanup()
