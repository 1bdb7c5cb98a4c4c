"""OpenAI speech API against a real aiohttp server and the real tiny engine, driven by the official `openai` SDK."""

import asyncio
import base64
import io
import json
import logging

import aiohttp
import av
import numpy as np
import openai
import pytest
import pytest_asyncio
import soundfile
import soxr
from compat_support import compat_server

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

KEY = "sk-voxgate-test"
SEED = 1234
TEXT = "Hello there."
SHORT = {"seed": SEED, "max_length": 4}  # 4 patches: enough to check a container, cheap on 2 cores


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def base_url(engine):
    async with compat_server(engine, KEY) as port:
        yield f"http://127.0.0.1:{port}/v1"


@pytest.fixture
def client(base_url):
    return openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0)


async def test_sdk_streaming_pcm_is_the_engines_audio_at_24khz(client, engine):
    reference = np.concatenate([c.audio async for c in engine.generate(TEXT, seed=SEED)])
    expected = soxr.resample(reference, 48000, 24000)
    chunks = []
    async with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=TEXT, response_format="pcm",
            extra_body={"generation": {"seed": SEED}}) as response:
        assert response.headers["transfer-encoding"] == "chunked"  # streamed as it is made, not buffered
        async for chunk in response.iter_bytes():
            chunks.append(chunk)
    got = np.frombuffer(b"".join(chunks), dtype="<i2").astype(np.float32) / 32767.0
    assert 0 <= len(got) - len(expected) < 480  # the last 20 ms frame is zero-padded
    got = got[:len(expected)]
    corr = float(np.dot(got, expected) / (np.linalg.norm(got) * np.linalg.norm(expected) + 1e-12))
    assert corr > 0.99, f"PCM body does not match the engine's audio (correlation {corr:.4f})"


# libsndfile has no AAC, and takes a streamed FLAC's "length unknown" (total_samples 0) for 2^63 frames and fails:
# both documented in docs/INTEGRATIONS.md; PyAV/ffmpeg and browsers read every format.
SOUNDFILE_READS = ("mp3", "opus", "wav")


@pytest.mark.parametrize("response_format, container, rate", [
    ("mp3", "mp3", 24000), ("opus", "ogg", 48000), ("aac", "aac", 24000), ("flac", "flac", 24000),
    ("wav", "wav", 24000),
])
async def test_sdk_containers_decode(client, response_format, container, rate):
    response = await client.audio.speech.create(model="gpt-4o-mini-tts", voice="nova", input=TEXT,
                                                response_format=response_format, extra_body={"generation": SHORT})
    data = response.read()
    with av.open(io.BytesIO(data)) as f:
        assert f.format.name.split(",")[0] in (container, "adts" if container == "aac" else container)
        stream = f.streams.audio[0]
        assert stream.rate == rate
        samples = sum(frame.samples for frame in f.decode(stream))
    # 4 patches of 160 ms, give or take codec padding
    assert abs(samples / rate - 0.64) < 0.1, f"{response_format}: {samples / rate:.3f} s of audio"
    if response_format in SOUNDFILE_READS:  # the streamed body, saved as it came, opens in soundfile too
        audio, sf_rate = soundfile.read(io.BytesIO(data), dtype="float32")
        assert sf_rate == rate and len(audio) == samples


async def test_sse_stream_carries_base64_deltas_and_usage(base_url):
    body = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm", "stream_format": "sse",
            "generation": SHORT}
    async with aiohttp.ClientSession() as http, http.post(
            f"{base_url}/audio/speech", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        text = await r.text()
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert deltas and events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["input_tokens"] == len(TEXT)
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert len(pcm) == 4 * 160 * 24 * 2  # 4 patches of 160 ms at 24 kHz, 2 bytes a sample: whole 20 ms frames


async def test_models_and_voices_listing(client, base_url):
    models = [m.id async for m in client.models.list()]
    assert "tts-1" in models and "voxcpm2" in models
    async with aiohttp.ClientSession() as http, http.get(
            f"{base_url}/audio/voices", headers={"Authorization": f"Bearer {KEY}"}) as r:
        voices = await r.json()
    assert {"alloy", "nova"} <= {v["id"] for v in voices["data"]}


async def test_wrong_key_is_an_openai_authentication_error_logged_without_the_key(base_url, caplog):
    caplog.set_level(logging.WARNING, logger="voxgate.refused")
    bad = openai.AsyncOpenAI(base_url=base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        await bad.audio.speech.create(model="tts-1", voice="alloy", input=TEXT)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert e.value.request_id.startswith("req_")  # errors carry x-request-id too
    [line] = [r.getMessage() for r in caplog.records if r.name == "voxgate.refused"]
    assert line.startswith("refused route=/v1/audio/speech method=POST status=401 reason=") and "API key" in line
    assert "sk-wrong" not in line


async def test_every_answer_has_a_request_id(client):
    async with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=TEXT, response_format="pcm",
            extra_body={"generation": SHORT}) as response:
        first = response.request_id
        assert await response.read()
    second = (await client.models.with_raw_response.list()).request_id
    assert first.startswith("req_") and second.startswith("req_") and first != second


async def test_refused_handshakes_are_logged_by_route_pattern_without_query_keys(base_url, caplog):
    caplog.set_level(logging.WARNING, logger="voxgate.refused")
    port = base_url.split(":")[2].split("/")[0]
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/tts/websocket?api_key=sk-leaked") as r:
            assert r.status == 401
        async with http.post(f"http://127.0.0.1:{port}/v1/text-to-speech/some-voice/stream",
                             headers={"xi-api-key": KEY}, json={"text": "Hi.", "seed": -1}) as r:
            assert r.status == 422
    lines = [r.getMessage() for r in caplog.records if r.name == "voxgate.refused"]
    assert lines[0].startswith("refused route=/tts/websocket method=GET status=401 reason=")
    assert lines[1].startswith("refused route=/v1/text-to-speech/{voice_id}/stream method=POST status=422 reason=")
    assert "seed" in lines[1] and not any("sk-leaked" in line or "some-voice" in line for line in lines)


@pytest.mark.parametrize("kwargs, param", [
    ({"voice": "no-such-voice"}, "voice"),
    ({"speed": 1.5}, "speed"),
    ({"speed": 9.0}, "speed"),
    ({"response_format": "ogg"}, "response_format"),
    ({"input": "   "}, "input"),
    ({"input": "x" * 4097}, "input"),
    ({"extra_body": {"sample_rate": 8000}}, "sample_rate"),
    ({"extra_body": {"generation": {"seed": "x"}}}, "generation"),
])
async def test_bad_requests_are_openai_400s_naming_the_parameter(client, kwargs, param):
    args = {"model": "tts-1", "voice": "alloy", "input": TEXT, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        await client.audio.speech.create(**args)
    assert e.value.status_code == 400
    assert e.value.param == param, e.value.body
    assert e.value.body["message"] and e.value.body["type"] == "invalid_request_error"


async def test_missing_field_and_bad_json_get_the_openai_error_shape(base_url):
    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base_url}/audio/speech", json={"model": "tts-1", "input": TEXT},
                             headers=headers) as r:
            assert r.status == 400
            error = (await r.json())["error"]
            assert error["param"] == "voice" and error["code"] == "missing_required_parameter"
        async with http.post(f"{base_url}/audio/speech", data=b"{not json", headers=headers) as r:
            assert r.status == 400
            assert set((await r.json())["error"]) == {"message", "type", "param", "code"}


async def test_client_hanging_up_mid_stream_ends_the_session(base_url, engine):
    story = " ".join(f"This is sentence number {i} of a long answer." for i in range(80))  # ~100 segments
    body = {"model": "tts-1", "voice": "alloy", "input": story, "response_format": "pcm",
            "generation": {"seed": SEED}}
    ready = base_url.removesuffix("/v1") + "/readyz"
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base_url}/audio/speech", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 200
            await r.content.readexactly(960)  # the first 20 ms, then hang up
            async with http.get(ready) as status:
                assert (await status.json())["sessions"] == 1
        for _ in range(40):
            async with http.get(ready) as status:
                sessions = (await status.json())["sessions"]
            if sessions == 0:
                break
            await asyncio.sleep(0.05)
    assert sessions == 0, "the session (and its engine requests) outlived the client"
    await asyncio.sleep(0.2)
    assert engine.stats().in_flight == 0
