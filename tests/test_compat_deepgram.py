"""Deepgram `/v1/speak` (the WebSocket and the REST POST) against a real aiohttp server and the real tiny engine:
Pipecat's own DeepgramTTSService fed like an LLM and its DeepgramHttpTTSService, and raw peers speaking Deepgram's
documented message schema."""

import asyncio
import io
import json

import aiohttp
import av
import pytest
import pytest_asyncio
from compat_support import compat_server, deepgram_message, llm_turn, released, run_tts, spoken_audio
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedOK, InvalidStatus

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

KEY = "dg-test-key"
STORY = " ".join(f"This is part {i} of a long reply that the listener interrupts." for i in range(12))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def port(engine):
    async with compat_server(engine, KEY) as port:
        yield port


def _connect(port: int, query: str = "model=aura-2-helena-en&encoding=linear16&sample_rate=24000", **kwargs):
    kwargs.setdefault("additional_headers", {"Authorization": f"Token {KEY}"})
    return connect(f"ws://127.0.0.1:{port}/v1/speak?{query}", **kwargs)


async def _speak(ws, *texts: str) -> None:
    for text in texts:
        await ws.send(json.dumps({"type": "Speak", "text": text}))


async def _until(ws, kind: str) -> tuple[list[bytes], list[dict]]:
    """(audio messages, JSON messages) up to and including the first JSON message of this type, each JSON message
    checked against the `deepgram-sdk` speak v1 models; fails on a Warning that was not asked for."""
    audio, messages = [], []
    while True:
        m = await asyncio.wait_for(ws.recv(), 20)
        if isinstance(m, bytes):
            audio.append(m)
            continue
        m = json.loads(m)
        deepgram_message(m)
        messages.append(m)
        if m["type"] == kind:
            return audio, messages
        assert m["type"] != "Warning", m


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pipecat's own
async def test_pipecat_deepgram_service_speaks_an_llm_turn(port):
    from pipecat.services.deepgram.tts import DeepgramTTSService

    tts = DeepgramTTSService(api_key=KEY, base_url=f"ws://127.0.0.1:{port}", sample_rate=16000)
    frames = await run_tts(tts, llm_turn("Hello", " there", ".", " How", " are", " you", "?"), 16000)

    audio = spoken_audio(frames, 16000)
    assert sum(len(f.audio) for f in audio) % 640 == 0  # whole 20 ms frames of 16-bit PCM at 16 kHz


async def test_utterances_play_one_after_another_each_answered_by_flushed(port):
    async with _connect(port) as ws:
        metadata = json.loads(await ws.recv())
        deepgram_message(metadata)
        assert metadata["type"] == "Metadata" and metadata["model_name"] == "aura-2-helena-en"
        assert metadata["request_id"] and metadata["model_uuid"]
        await _speak(ws, "Hello there. ", "How are you?")
        await ws.send(json.dumps({"type": "Flush"}))
        await _speak(ws, "The second reply, queued while the first one speaks.")
        await ws.send(json.dumps({"type": "Flush"}))
        await ws.send(json.dumps({"type": "Flush"}))  # nothing said since the last one: answered in its turn
        first, m1 = await _until(ws, "Flushed")
        second, m2 = await _until(ws, "Flushed")
        third, m3 = await _until(ws, "Flushed")
    assert [m1[-1]["sequence_id"], m2[-1]["sequence_id"], m3[-1]["sequence_id"]] == [0, 1, 2]
    assert first and second and third == []  # the second reply's audio only after the first one's Flushed
    assert all(len(a) == 960 for a in first + second)  # 20 ms of 16-bit PCM at 24 kHz each


async def test_clear_stops_the_audio_and_the_next_utterance_speaks(port):
    async with _connect(port, "encoding=mulaw&sample_rate=8000") as ws:
        await _until(ws, "Metadata")
        await _speak(ws, STORY)
        await ws.send(json.dumps({"type": "Flush"}))
        assert len(await asyncio.wait_for(ws.recv(), 20)) == 160  # audio: 20 ms of 8 kHz mu-law
        await _speak(ws, "Queued behind the story: dropped by the Clear.")
        await ws.send(json.dumps({"type": "Clear"}))
        before, messages = await _until(ws, "Cleared")
        assert [m["type"] for m in messages] == ["Cleared"] and messages[0]["sequence_id"] == 0
        assert len(before) * 0.02 < 3.0  # cut short: the story is ~20 s, sent at most 0.5 s ahead of playback
        with pytest.raises(TimeoutError):  # nothing more of the story, nor of the dropped reply
            m = await asyncio.wait_for(ws.recv(), 1.0)
            pytest.fail(f"a message after Cleared: {m!r}")
        await _speak(ws, "A new reply.")
        await ws.send(json.dumps({"type": "Flush"}))
        after, messages = await _until(ws, "Flushed")
    assert after and all(len(a) == 160 for a in after) and messages[-1]["sequence_id"] == 1


async def test_close_speaks_the_rest_then_closes(port):
    async with _connect(port) as ws:
        await _until(ws, "Metadata")
        await _speak(ws, "Goodbye for now.")
        await ws.send(json.dumps({"type": "Close"}))
        audio, _ = await _until(ws, "Flushed")
        with pytest.raises(ConnectionClosedOK):
            await asyncio.wait_for(ws.recv(), 10)
    assert audio and ws.close_code == 1000


@pytest.mark.parametrize("message, code", [("{not json", "INVALID_MESSAGE"),
                                           (json.dumps({"type": "Dance"}), "INVALID_MESSAGE"),
                                           (json.dumps({"type": "Speak"}), "INVALID_MESSAGE"),
                                           (json.dumps({"type": "Speak", "text": "word " * 500}), "TEXT_TOO_LONG")])
async def test_a_bad_message_gets_a_warning_and_the_socket_serves_on(port, message, code):
    async with _connect(port) as ws:
        await _until(ws, "Metadata")
        await ws.send(message)
        warning = json.loads(await asyncio.wait_for(ws.recv(), 10))
        deepgram_message(warning)
        assert warning["type"] == "Warning" and warning["code"] == code and warning["description"]
        await _speak(ws, "Still fine.")
        await ws.send(json.dumps({"type": "Flush"}))
        audio, _ = await _until(ws, "Flushed")
    assert audio


@pytest.mark.parametrize("query, headers, status, reason", [
    ("encoding=mp3", {"Authorization": f"Token {KEY}"}, 400, "encoding"),
    ("sample_rate=44100", {"Authorization": f"Token {KEY}"}, 400, "sample_rate"),
    ("encoding=mulaw&sample_rate=16000", {"Authorization": f"Token {KEY}"}, 400, "sample_rate"),
    ("container=wav", {"Authorization": f"Token {KEY}"}, 400, "container"),
    ("", {"Authorization": "Token wrong"}, 401, "invalid API key"),
    ("", {}, 401, "API key"),
])
async def test_a_bad_handshake_is_refused_with_the_reason_in_dg_error(port, query, headers, status, reason):
    with pytest.raises(InvalidStatus) as refused:
        async with _connect(port, query, additional_headers=headers):
            pass
    response = refused.value.response
    assert response.status_code == status
    assert reason in response.headers["dg-error"] and reason in json.loads(response.body)["err_msg"]


async def test_a_browser_authenticates_with_the_token_subprotocol(port):
    async with _connect(port, additional_headers={}, subprotocols=["token", KEY]) as ws:
        assert ws.subprotocol == "token"
        await _until(ws, "Metadata")
        await _speak(ws, "Hi.")
        await ws.send(json.dumps({"type": "Flush"}))
        audio, _ = await _until(ws, "Flushed")
    assert audio


async def test_every_clear_is_answered_even_two_in_a_row_or_with_nothing_speaking(port):
    async with _connect(port) as ws:
        await _until(ws, "Metadata")
        await ws.send(json.dumps({"type": "Clear"}))  # nothing speaking: answered at once
        _, messages = await _until(ws, "Cleared")
        await _speak(ws, STORY)
        await ws.send(json.dumps({"type": "Flush"}))
        await asyncio.wait_for(ws.recv(), 20)  # its first audio
        await ws.send(json.dumps({"type": "Clear"}))
        await ws.send(json.dumps({"type": "Clear"}))  # before the first one's answer: one cancel serves both
        _, second = await _until(ws, "Cleared")
        _, third = await _until(ws, "Cleared")
    assert [m[-1]["sequence_id"] for m in (messages, second, third)] == [0, 1, 2]


async def test_a_client_gone_mid_speech_leaves_no_session_and_no_engine_request(port, engine):
    async with _connect(port) as ws:
        await _until(ws, "Metadata")
        await _speak(ws, STORY)
        await ws.send(json.dumps({"type": "Flush"}))
        await _speak(ws, "A reply waiting behind the story.")
        assert isinstance(await asyncio.wait_for(ws.recv(), 20), bytes)
        assert engine.stats().in_flight >= 1
    await released(port, engine)


async def test_text_waiting_behind_the_utterance_speaking_is_bounded(port):
    async with _connect(port) as ws:
        await _until(ws, "Metadata")
        await _speak(ws, STORY)
        await ws.send(json.dumps({"type": "Flush"}))
        for _ in range(5):  # 5 x 1,900 characters queue behind the story: more than the 8,000 a turn may buffer
            await _speak(ws, "word " * 380)
        warning = None
        while warning is None:
            m = await asyncio.wait_for(ws.recv(), 20)
            if isinstance(m, str) and json.loads(m)["type"] == "Warning":
                warning = json.loads(m)
        assert warning["code"] == "BUFFER_FULL" and "8000 characters" in warning["description"]
        await ws.send(json.dumps({"type": "Clear"}))
        await _until(ws, "Cleared")
        await _speak(ws, "Room again after the Clear.")
        await ws.send(json.dumps({"type": "Flush"}))
        audio, _ = await _until(ws, "Flushed")
    assert audio


# ---------------------------------------------------------------------------------------------------- POST /v1/speak


async def _post(port: int, query: str, body: dict | bytes, headers: dict | None = None):
    """(status, headers, body) of POST /v1/speak."""
    async with aiohttp.ClientSession() as http:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with http.post(f"http://127.0.0.1:{port}/v1/speak?{query}", data=data, headers={
                "Authorization": f"Token {KEY}", "Content-Type": "application/json", **(headers or {})}) as r:
            return r.status, r.headers, await r.read()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pipecat's own
async def test_pipecat_deepgram_http_service_gets_raw_pcm(port):
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.services.deepgram.tts import DeepgramHttpTTSService

    async with aiohttp.ClientSession() as http:
        tts = DeepgramHttpTTSService(api_key=KEY, aiohttp_session=http, base_url=f"http://127.0.0.1:{port}",
                                     sample_rate=16000)
        frames = await run_tts(tts, [TTSSpeakFrame("Hello there.")], 16000)
    assert not [f for f in frames if isinstance(f, ErrorFrame)]
    audio = b"".join(f.audio for f in frames if isinstance(f, TTSAudioRawFrame))
    assert audio and len(audio) % 640 == 0  # whole 20 ms frames of 16-bit PCM at 16 kHz


@pytest.mark.parametrize("query, content_type, container, rate", [
    ("model=aura-2-thalia-en", "audio/mpeg", "mp3", 22050),  # Deepgram's default: mp3
    ("encoding=linear16", "audio/wav", "wav", 24000),  # linear16's default container: wav
    ("encoding=opus", "audio/ogg", "ogg", 48000),
])
async def test_rest_speak_defaults_and_containers(port, query, content_type, container, rate):
    status, headers, data = await _post(port, query, {"text": "Hello from the REST endpoint."})
    assert status == 200 and headers["Content-Type"] == content_type
    assert headers["dg-request-id"] and headers["dg-char-count"] == str(len("Hello from the REST endpoint."))
    with av.open(io.BytesIO(data)) as f:
        assert f.format.name.split(",")[0] == container and f.streams.audio[0].rate == rate
        assert sum(frame.samples for frame in f.decode(audio=0)) > 0


async def test_rest_speak_raw_mulaw(port):
    status, headers, data = await _post(port, "encoding=mulaw&container=none", {"text": "Hi."})
    assert status == 200 and headers["Content-Type"] == "audio/basic"
    assert data and len(data) % 160 == 0  # whole 20 ms frames of 8 kHz mu-law


@pytest.mark.parametrize("query, body, headers, status, reason", [
    ("encoding=flac", {"text": "Hi."}, {}, 400, "encoding"),
    ("encoding=mulaw&container=wav", {"text": "Hi."}, {}, 400, "container"),
    ("encoding=mp3&bit_rate=fast", {"text": "Hi."}, {}, 400, "bit_rate"),
    ("", b"{not json", {}, 400, "invalid JSON"),
    ("", {"words": "Hi."}, {}, 400, "text"),
    ("", {"text": "Hi."}, {"Authorization": "Token wrong"}, 401, "invalid API key"),
])
async def test_rest_speak_refuses_bad_requests_the_deepgram_way(port, query, body, headers, status, reason):
    got, response_headers, data = await _post(port, query, body, headers)
    error = json.loads(data)
    assert got == status and reason in error["err_msg"] and reason in response_headers["dg-error"]
    assert error["err_code"] and error["request_id"]
