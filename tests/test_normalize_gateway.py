"""generation.normalize end to end: a real aiohttp server, the real websockets client, the real tiny engine; and
ElevenLabs' apply_text_normalization on the compat endpoints."""

import base64
import json
import re

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from compat_support import compat_server
from websockets.asyncio.client import connect

from gateway.client import VoxgateClient
from gateway.text import normalize as spoken

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

SEED = 77
KEY = "xi-test-key"
TEXT = "It costs $5."


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def port(engine):
    async with compat_server(engine, KEY) as port:
        yield port


async def _speak(port: int, text: str, **generation) -> tuple[list[str], np.ndarray]:
    """(segment.started texts, PCM at the model's rate) of one turn."""
    async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key=KEY) as c:
        await c.start(output={"format": "pcm_s16le", "sample_rate": 48000}, generation={"seed": SEED, **generation})
        utt = await c.speak(text, "t")
    segments = [e["text"] for e in utt.events if e["type"] == "segment.started"]
    return segments, np.frombuffer(b"".join(utt.payloads), dtype="<i2").astype(np.float32) / 32767.0


async def _engine_pcm(engine, text: str) -> np.ndarray:
    return np.clip(np.concatenate([c.audio async for c in engine.generate(text, seed=SEED)]), -1, 1)


@pytest.mark.parametrize("mode", ["auto", "on", None])
async def test_the_engine_speaks_the_normalised_text_and_segment_started_shows_it(port, engine, mode):
    generation = {} if mode is None else {"normalize": mode}  # None: the default, auto
    segments, got = await _speak(port, TEXT, **generation)
    said = spoken.normalize(TEXT, mode or "auto")
    assert segments == [said] and said != TEXT and not re.search(r"\d", said)
    reference = await _engine_pcm(engine, said)
    assert len(got) >= len(reference) and np.max(np.abs(got[:len(reference)] - reference)) < 2 / 32767


async def test_off_speaks_the_text_as_written(port, engine):
    segments, got = await _speak(port, TEXT, normalize="off")
    assert segments == [TEXT]
    reference = await _engine_pcm(engine, TEXT)
    assert np.max(np.abs(got[:len(reference)] - reference)) < 2 / 32767


async def test_a_bad_mode_is_an_invalid_value_and_the_session_goes_on(port):
    async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key=KEY) as c:
        await c.start(generation={"seed": SEED})
        await c.update(generation={"normalize": "always"})
        error = await c.expect("error")
        assert error["code"] == "invalid_value" and "auto, on, off" in error["message"] and not error["fatal"]
        await c.update(generation={"normalize": "off"})
        updated = await c.expect("session.updated")
        assert updated["generation"]["normalize"] == "off"


async def _post(port: int, body: dict) -> tuple[int, dict]:
    url = f"http://127.0.0.1:{port}/v1/text-to-speech/voice/with-timestamps"
    async with aiohttp.ClientSession() as http, http.post(url, params={"output_format": "pcm_24000"}, json=body,
                                                          headers={"xi-api-key": KEY}) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("mode", ["auto", "on", "off", None])
async def test_elevenlabs_http_apply_text_normalization(port, mode):
    body = {"text": TEXT} | ({} if mode is None else {"apply_text_normalization": mode})
    status, reply = await _post(port, body)
    assert status == 200 and base64.b64decode(reply["audio_base64"])
    expected = TEXT if mode == "off" else spoken.normalize(TEXT, mode or "auto")
    assert "".join(reply["alignment"]["characters"]).strip() == expected


async def test_elevenlabs_http_bad_apply_text_normalization_is_a_422(port):
    status, reply = await _post(port, {"text": TEXT, "apply_text_normalization": "sometimes"})
    assert status == 422 and reply["detail"]["status"] == "invalid_request"


@pytest.mark.parametrize("mode", ["on", "off"])
async def test_elevenlabs_stream_input_apply_text_normalization(port, mode):
    url = (f"ws://127.0.0.1:{port}/v1/text-to-speech/voice/stream-input?output_format=pcm_24000"
           f"&apply_text_normalization={mode}")
    chars = []
    async with connect(url, additional_headers={"xi-api-key": KEY}) as ws:
        for message in ({"text": " "}, {"text": TEXT}, {"text": ""}):
            await ws.send(json.dumps(message))
        async for raw in ws:
            m = json.loads(raw)
            assert "error" not in m, m
            if m.get("alignment"):
                chars += m["alignment"]["chars"]
            if m.get("isFinal"):
                break
    assert "".join(chars).strip() == (TEXT if mode == "off" else spoken.normalize(TEXT, mode))


async def test_elevenlabs_stream_input_bad_apply_text_normalization_closes_1008(port):
    url = f"ws://127.0.0.1:{port}/v1/text-to-speech/voice/stream-input?apply_text_normalization=yes"
    async with connect(url, additional_headers={"xi-api-key": KEY}) as ws:
        m = json.loads(await ws.recv())
        assert m["error"] == "invalid_request" and "apply_text_normalization" in m["message"]
        await ws.wait_closed()
        assert ws.close_code == 1008


@pytest.mark.parametrize("mode, status", [("on", 200), ("sometimes", 400)])
async def test_openai_speech_takes_normalize_in_its_generation_extension(port, mode, status):
    body = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm",
            "generation": {"seed": SEED, "normalize": mode}}
    url = f"http://127.0.0.1:{port}/v1/audio/speech"
    async with aiohttp.ClientSession() as http, http.post(url, json=body,
                                                          headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status == status
        if status == 200:
            assert len(await r.read()) > 0
        else:
            error = (await r.json())["error"]
            assert error["param"] == "generation" and "auto, on, off" in error["message"]
