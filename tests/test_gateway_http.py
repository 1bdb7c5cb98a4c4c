"""HTTP side of the gateway (voices, health, readiness, metrics, the static web client) and graceful shutdown, on a
real server with the real tiny engine."""

import asyncio
import io
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
import soundfile

from gateway.client import VoxgateClient
from gateway.server import ServerConfig, create_app, start_server

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def base(engine, tmp_path_factory):
    web = tmp_path_factory.mktemp("web")
    (web / "index.html").write_text("<!doctype html><title>voxgate demo</title>")
    (web / "voxgate.js").write_text("export const hello = 1;")
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=web)))
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


@pytest_asyncio.fixture(loop_scope="module")
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


def _wav(seconds: float = 1.0, rate: int = 16000, fmt: str = "WAV") -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format=fmt)
    return buf.getvalue()


async def test_voice_lifecycle_raw_body_and_multipart(base, http):
    async with http.post(f"{base}/v1/voices", data=_wav(), params={"text": "A test voice."}) as r:
        assert r.status == 201, await r.text()
        raw_id = (await r.json())["voice_id"]
    form = aiohttp.FormData()
    form.add_field("audio", _wav(fmt="FLAC"), filename="voice.flac", content_type="audio/flac")
    async with http.post(f"{base}/v1/voices", data=form) as r:
        assert r.status == 201, await r.text()
        form_id = (await r.json())["voice_id"]
    async with http.get(f"{base}/v1/voices") as r:
        ids = {v["voice_id"] for v in (await r.json())["voices"]}
    assert {raw_id, form_id} <= ids
    async with http.delete(f"{base}/v1/voices/{form_id}") as r:
        assert r.status == 204
    async with http.delete(f"{base}/v1/voices/{form_id}") as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_voice"


async def test_a_stored_voice_speaks_over_the_websocket(base, http):
    async with http.post(f"{base}/v1/voices", data=_wav()) as r:
        voice = (await r.json())["voice_id"]
    async with await VoxgateClient.connect(base.replace("http", "ws") + "/v1/stream") as c:
        started = await c.start(voice=voice, output={"format": "pcm_s16le"})
        assert started["voice"] == voice
        utt = await c.speak("With my own voice.", "v")
    assert utt.done["audio_ms"] > 0


@pytest.mark.parametrize("body", [b"", b"definitely not audio"])
async def test_bad_voice_audio_is_a_400_with_a_code(base, http, body):
    async with http.post(f"{base}/v1/voices", data=body) as r:
        assert r.status == 400
        error = (await r.json())["error"]
        assert error["code"] in ("missing_field", "invalid_value") and error["message"]


async def test_health_readiness_and_metrics(base, http):
    async with http.get(f"{base}/healthz") as r:
        assert r.status == 200
    async with http.get(f"{base}/readyz") as r:
        assert r.status == 200 and (await r.json())["status"] == "ready"
    async with await VoxgateClient.connect(base.replace("http", "ws") + "/v1/stream") as c:
        await c.start(output={"format": "pcm_s16le"})
        await c.speak("Count me.", "m")
    async with http.get(f"{base}/metrics") as r:
        text = await r.text()
    for name in ("voxgate_sessions", "voxgate_turns_total", "voxgate_ttfb_seconds_bucket",
                 "voxgate_engine_ttfb_seconds_count", "voxgate_turn_rtf_count", "voxgate_engine_in_flight",
                 "voxgate_engine_free_blocks"):
        assert name in text, name
    assert 'voxgate_turns_finished_total{outcome="done"}' in text


async def test_static_web_client_is_served(base, http):
    async with http.get(f"{base}/") as r:
        assert r.status == 200 and "voxgate demo" in await r.text()
    async with http.get(f"{base}/voxgate.js") as r:
        assert r.status == 200 and "hello" in await r.text()


async def test_graceful_shutdown_tells_clients_and_stops_their_turns(engine):
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None, shutdown_timeout_s=0.3)))
    c = await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream")
    await c.start(output={"format": "pcm_s16le"})
    await c.append("A turn that is still open when the server goes down, because it never ends", "t")
    cleanup = asyncio.create_task(runner.cleanup())
    error = await c.expect("error", timeout=10)
    assert error["code"] == "server_shutdown" and error["fatal"] is True
    await asyncio.wait_for(c.ws.wait_closed(), 5)
    await asyncio.wait_for(cleanup, 10)
    end = asyncio.get_running_loop().time() + 5
    while engine.stats().in_flight and asyncio.get_running_loop().time() < end:
        await asyncio.sleep(0.05)
    assert engine.stats().in_flight == 0


async def test_the_demo_page_ships_inside_the_gateway_package():
    """The wheel carries the page as the gateway's package data: no bare web_client/ at the top of site-packages."""
    import tomllib

    import gateway
    from gateway.server import WEB_CLIENT_DIR

    package = Path(gateway.__file__).resolve().parent
    assert WEB_CLIENT_DIR.parent == package and (WEB_CLIENT_DIR / "index.html").is_file()
    patterns = tomllib.loads((package.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert all(".." not in p for ps in patterns.values() for p in ps)  # nothing reaches outside its package
    shipped = {p.name for pattern in patterns["gateway"] for p in package.glob(pattern)}
    assert {"index.html", "demo.js", "voxgate.js", "player-worklet.js", "demo.css"} <= shipped
