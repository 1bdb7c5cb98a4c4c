"""Readiness that follows capacity and the SIGTERM drain, on a real aiohttp server with the real tiny engine:
/readyz turns 503 at max_sessions, while the engine would refuse a request, and while draining; during the drain
the port stays open, new handshakes get a typed 503 and turns in progress finish before sessions close (1001)."""

import asyncio
import time

import aiohttp
import pytest
import pytest_asyncio
from websockets.exceptions import ConnectionClosed, InvalidStatus

from engine import Engine
from gateway.client import VoxgateClient
from gateway.http.readiness import drain
from gateway.protocol import AudioFrame
from gateway.server import ServerConfig, create_app, start_server

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

LONG_TEXT = ("A turn long enough to keep speaking while the server drains, several seconds of audio. "
             "It has to finish in full before the session is closed.")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_v2_dir):
    """One request at a time and no queue: a single speaking turn saturates this engine."""
    eng = Engine.from_pretrained(str(tiny_v2_dir), max_num_seqs=1, max_waiting=0)
    await eng.wait_for_ready()
    yield eng
    await eng.stop()


async def _serve(engine, **config):
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None, **config),
                                                 compat=True))
    return runner, port


async def _readyz(port: int) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/readyz") as r:
        return r.status, await r.json()


async def _until_status(port: int, want: int, timeout: float = 10.0) -> dict:
    """Poll /readyz until it answers `want` (assert it does within the timeout); its body."""
    end = time.monotonic() + timeout
    while True:
        status, body = await _readyz(port)
        if status == want or time.monotonic() > end:
            assert status == want, body
            return body
        await asyncio.sleep(0.05)


async def _first_audio(c: VoxgateClient) -> None:
    while not isinstance(event := await c.recv(20), AudioFrame):
        assert event["type"] != "error", event


async def test_readyz_reports_the_load_and_turns_503_at_max_sessions(engine):
    runner, port = await _serve(engine, max_sessions=1)
    try:
        status, idle = await _readyz(port)
        assert status == 200, idle
        assert idle["status"] == "ready" and idle["sessions"] == 0 and idle["free_slots"] == 1
        assert idle["engine_room"] == 1 and idle["queue"] == 0 and idle["draining"] is False
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as r:
            assert "\nvoxgate_engine_admission_room 1.0\n" in await r.text()  # the same number for Prometheus
        async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream") as c:
            await c.start()
            status, full = await _readyz(port)
            assert status == 503 and full["status"] == "full"
            assert full["sessions"] == 1 and full["free_slots"] == 0
        body = await _until_status(port, 200)  # the slot is free again once the session is gone
        assert body["sessions"] == 0
    finally:
        await runner.cleanup()


async def test_readyz_turns_503_while_the_engine_would_refuse_a_request(engine):
    runner, port = await _serve(engine)
    try:
        async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream") as c:
            await c.start(output={"format": "pcm_s16le"})
            await c.append(LONG_TEXT, "t")
            await c.end("t")
            body = await _until_status(port, 503)  # while the engine generates the turn, it has no room left
            assert body["status"] == "engine_saturated" and body["engine_room"] == 0, body
            assert body["free_slots"] > 0 and body["running"] + body["queue"] <= 1
            await c.collect("t")
        body = await _until_status(port, 200)
        assert body["engine_room"] == 1
    finally:
        await runner.cleanup()


async def test_drain_keeps_listening_refuses_new_sessions_and_lets_turns_finish(engine):
    runner, port = await _serve(engine, shutdown_timeout_s=30.0)
    url = f"ws://127.0.0.1:{port}/v1/stream"
    draining: asyncio.Task | None = None
    try:
        c = await VoxgateClient.connect(url)
        await c.start(output={"format": "pcm_s16le"})
        await c.append(LONG_TEXT, "t")
        await c.end("t")
        await _first_audio(c)
        draining = asyncio.create_task(drain(runner.app))
        await asyncio.sleep(0)

        status, body = await _readyz(port)  # the port is still open: balancers see the 503
        assert status == 503 and body["status"] == "draining" and body["draining"] is True
        with pytest.raises(InvalidStatus) as refused:
            await VoxgateClient.connect(url)
        assert refused.value.response.status_code == 503
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/v1/stream") as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "server_shutdown"
            with pytest.raises(aiohttp.WSServerHandshakeError) as compat_refused:  # the compat sockets too
                await http.ws_connect(f"ws://127.0.0.1:{port}/v1/twilio/media")
            assert compat_refused.value.status == 503
        await c.append("A new turn during the drain.", "late")

        frames, done, late_refusal = 0, None, None
        while done is None:
            event = await c.recv(30)
            if isinstance(event, AudioFrame):
                frames += 1
            elif event["type"] == "error" and event.get("context_id") == "late":
                late_refusal = event
            elif event["type"] == "context.done":
                done = event
            else:
                assert event["type"] != "error", event
        assert done["context_id"] == "t" and done["audio_ms"] > 0 and frames > 0  # the turn finished in full
        assert late_refusal is not None and late_refusal["code"] == "server_shutdown"
        assert late_refusal["fatal"] is False
        error = await c.expect("error", timeout=10)
        assert error["code"] == "server_shutdown" and error["fatal"] is True
        with pytest.raises(ConnectionClosed) as closed:
            await c.recv(10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
        await asyncio.wait_for(draining, 10)
        status, body = await _readyz(port)  # drained, still listening until the runner stops
        assert status == 503 and body["sessions"] == 0
    finally:
        if draining is not None and not draining.done():
            draining.cancel()
        await runner.cleanup()
