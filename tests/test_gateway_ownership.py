"""Voices and LoRA adapters belong to the key that made them (issue 27): another key gets the same answer as for an
id that does not exist, on every route and protocol; an operator key shares them; strict mode (per key, per server)
turns the compat protocols' default-voice fallback into their own not-found errors. A real server with every
protocol on, real clients, the real tiny engine."""

import io
import json
import logging

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
import soundfile
import torch
from safetensors.torch import save

from gateway.auth import Auth
from gateway.client import ServerError, VoxgateClient
from gateway.server import ServerConfig, create_app, start_server

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

A, B, STRICT_B, OP = "key-a", "key-b", "key-b-strict", "key-op"


def _wav(seconds: float = 0.5, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_v2_dir):
    """The tiny engine with LoRA slots (this module's own: the shared one has none)."""
    from engine import Engine

    eng = Engine.from_pretrained(str(tiny_v2_dir), max_num_seqs=8, max_loras=2, max_lora_rank=4)
    await eng.wait_for_ready()
    yield eng
    await eng.stop()


@pytest.fixture(scope="module")
def weights(tiny_v2_dir) -> bytes:
    """Adapter weights that fit the tiny model (one target; zero B: the adapter changes nothing)."""
    from engine.config import ModelConfig
    from engine.lora import lora_layout

    path, (fan_in, fan_out) = next(iter(lora_layout(ModelConfig.from_file(tiny_v2_dir / "config.json")).items()))
    return save({f"{path}.lora_A": torch.randn(2, fan_in), f"{path}.lora_B": torch.zeros(fan_out, 2)})


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(engine):
    auth = Auth({A: [], B: [], STRICT_B: ["strict"], OP: ["operator"]})
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None), auth=auth, compat=True))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{port}/v1/voices", data=_wav(), headers=_bearer(A)) as r:
            assert r.status == 201, await r.text()
            voice = (await r.json())["voice_id"]
        yield port, http, voice
    await runner.cleanup()


async def _ids(http: aiohttp.ClientSession, port: int, key: str) -> set[str]:
    async with http.get(f"http://127.0.0.1:{port}/v1/voices", headers=_bearer(key)) as r:
        assert r.status == 200
        return {v["voice_id"] for v in (await r.json())["voices"]}


async def test_another_keys_voice_is_404_on_the_voice_routes(server):
    port, http, voice = server
    base = f"http://127.0.0.1:{port}"
    assert voice in await _ids(http, port, A) and voice not in await _ids(http, port, B)
    async with http.delete(f"{base}/v1/voices/{voice}", headers=_bearer(B)) as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_voice"
    async with http.patch(f"{base}/v1/voices/{voice}", json={"public": True}, headers=_bearer(B)) as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_voice"
    async with http.patch(f"{base}/v1/voices/{voice}", json={"public": True}, headers=_bearer(A)) as r:
        assert r.status == 403 and (await r.json())["error"]["code"] == "forbidden"  # owners cannot share
    async with http.get(f"{base}/v1/audio/voices", headers=_bearer(B)) as r:  # OpenAI's listing
        assert voice not in {v["id"] for v in (await r.json())["data"]}
    assert voice in await _ids(http, port, A)  # still there for its owner


async def test_another_keys_voice_is_unknown_on_the_native_and_twilio_sockets(server):
    port, _, voice = server
    for path in ("/v1/stream", "/v1/twilio/control"):
        async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}{path}", api_key=B) as c:
            with pytest.raises(ServerError) as refused:
                await c.start(voice=voice)
            assert refused.value.code == "unknown_voice"
    async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key=B) as c:
        with pytest.raises(ServerError) as missing:  # the same answer as for an id that exists nowhere
            await c.start(voice="0123456789ab")
    assert missing.value.code == refused.value.code
    async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key=A) as c:
        assert (await c.start(voice=voice, output={"format": "pcm_s16le"}))["voice"] == voice
        assert (await c.speak("Mine.", "m")).done["audio_ms"] > 0


async def test_another_keys_voice_is_each_compat_protocols_not_found(server):
    port, http, voice = server
    base = f"http://127.0.0.1:{port}"
    async with http.post(f"{base}/v1/audio/speech", headers=_bearer(B), json={
            "model": "tts-1", "input": "Hello.", "voice": voice, "response_format": "pcm"}) as r:
        body = await r.json()
        assert r.status == 400 and body["error"]["param"] == "voice"
    # strict key: every foreign protocol's own not-found answer
    async with http.post(f"{base}/v1/text-to-speech/{voice}", params={"output_format": "pcm_24000"},
                         json={"text": "Hello."}, headers={"xi-api-key": STRICT_B}) as r:
        assert r.status == 404 and (await r.json())["detail"]["status"] == "voice_not_found"
    cartesia = {"model_id": "sonic-3", "transcript": "Hello.", "voice": {"mode": "id", "id": voice},
                "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}}
    async with http.post(f"{base}/tts/bytes", json=cartesia, headers={"X-API-Key": STRICT_B}) as r:
        assert r.status == 404 and (await r.json())["error"] == "not_found"
    async with http.post(f"{base}/v1/speak", params={"model": voice}, json={"text": "Hello."},
                         headers={"Authorization": f"Token {STRICT_B}"}) as r:
        assert r.status == 400 and (await r.json())["err_code"] == "INVALID_QUERY_PARAMETER"
    async with http.ws_connect(f"ws://127.0.0.1:{port}/v1/text-to-speech/{voice}/stream-input",
                               headers={"xi-api-key": STRICT_B}) as ws:
        await ws.send_str(json.dumps({"text": " "}))
        message = await ws.receive_json(timeout=10)
        assert message["error"] == "voice_not_found", message
    async with http.ws_connect(f"ws://127.0.0.1:{port}/tts/websocket", headers={"X-API-Key": STRICT_B}) as ws:
        await ws.send_str(json.dumps({**cartesia, "context_id": "c1"}))
        message = await ws.receive_json(timeout=10)
        assert message["type"] == "error" and message["status_code"] == 404, message
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await http.ws_connect(f"ws://127.0.0.1:{port}/v1/speak?model={voice}",
                              headers={"Authorization": f"Token {STRICT_B}"})
    assert refused.value.status == 400
    # the owner, strict or not, speaks with it
    async with http.post(f"{base}/v1/text-to-speech/{voice}", params={"output_format": "pcm_24000"},
                         json={"text": "Hello."}, headers={"xi-api-key": A}) as r:
        assert r.status == 200 and len(await r.read()) > 0


async def test_unknown_ids_fall_back_to_the_default_voice_and_are_logged(server, caplog):
    port, http, voice = server
    caplog.set_level(logging.WARNING, logger="voxgate.voices")
    async with http.post(f"http://127.0.0.1:{port}/v1/text-to-speech/{voice}", params={"output_format": "pcm_24000"},
                         json={"text": "Hello."}, headers={"xi-api-key": B}) as r:
        assert r.status == 200 and len(await r.read()) > 0  # B speaks, with the default voice
    assert any(voice in rec.getMessage() and "default voice" in rec.getMessage() for rec in caplog.records)


async def test_strict_server_refuses_foreign_ids_for_every_key(engine):
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None, strict_voices=True),
                                                 compat=True))
    try:
        async with aiohttp.ClientSession() as http, http.post(
                f"http://127.0.0.1:{port}/v1/text-to-speech/21m00Tcm4TlvDq8ikWAM", json={"text": "Hi."},
                params={"output_format": "pcm_24000"}) as r:
            assert r.status == 404
    finally:
        await runner.cleanup()


async def test_an_operator_shares_a_voice_that_others_use_but_cannot_delete(engine):
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None),
                                                 auth=Auth({A: [], B: [], OP: ["operator"]})))
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{base}/v1/voices", data=_wav(), headers=_bearer(A)) as r:
                voice = (await r.json())["voice_id"]
            assert voice in await _ids(http, port, OP)  # an operator sees every voice
            async with http.patch(f"{base}/v1/voices/{voice}", json={"public": True}, headers=_bearer(OP)) as r:
                assert r.status == 200 and (await r.json())["public"] is True
            assert voice in await _ids(http, port, B)
            async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key=B) as c:
                assert (await c.start(voice=voice, output={"format": "pcm_s16le"}))["voice"] == voice
            async with http.delete(f"{base}/v1/voices/{voice}", headers=_bearer(B)) as r:
                assert r.status == 403
            async with http.delete(f"{base}/v1/voices/{voice}", headers=_bearer(OP)) as r:
                assert r.status == 204
            assert voice not in await _ids(http, port, A)
    finally:
        await runner.cleanup()


def _adapter_form(name: str, weights: bytes) -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("name", name)
    form.add_field("config", json.dumps({"r": 2, "alpha": 4, "enable_lm": True}))
    form.add_field("weights", weights, filename="lora_weights.safetensors")
    return form


async def test_adapters_are_per_key(engine, weights):
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None), auth=Auth({A, B})))
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{base}/v1/loras", data=_adapter_form("mine", weights), headers=_bearer(A)) as r:
                assert r.status == 201, await r.text()
            async with http.get(f"{base}/v1/loras", headers=_bearer(B)) as r:
                assert "mine" not in {x["name"] for x in (await r.json())["loras"]}
            async with http.delete(f"{base}/v1/loras/mine", headers=_bearer(B)) as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_lora"
            async with http.post(f"{base}/v1/voices", params={"lora": "mine"}, headers=_bearer(B)) as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_lora"
            # names are per key: B may have its own "mine"
            async with http.post(f"{base}/v1/loras", data=_adapter_form("mine", weights), headers=_bearer(B)) as r:
                assert r.status == 201, await r.text()
            async with http.post(f"{base}/v1/voices", params={"lora": "mine"}, headers=_bearer(A)) as r:
                assert r.status == 201
                voice = (await r.json())["voice_id"]
            async with http.delete(f"{base}/v1/loras/mine", headers=_bearer(A)) as r:
                assert r.status == 409  # its voice uses it
            for key in (A, B):
                async with http.get(f"{base}/v1/loras", headers=_bearer(key)) as r:
                    assert [x["name"] for x in (await r.json())["loras"]] == ["mine"]
            async with http.delete(f"{base}/v1/voices/{voice}", headers=_bearer(A)) as r:
                assert r.status == 204
            for key in (A, B):
                async with http.delete(f"{base}/v1/loras/mine", headers=_bearer(key)) as r:
                    assert r.status == 204
    finally:
        await runner.cleanup()
