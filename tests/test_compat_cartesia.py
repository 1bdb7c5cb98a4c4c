"""Cartesia `/tts/websocket` and `POST /tts/bytes` against a real aiohttp server and the real tiny engine: Pipecat's
own CartesiaTTSService fed like an LLM and its CartesiaHttpTTSService, and raw peers speaking Cartesia's documented
message schema."""

import asyncio
import base64
import io
import json

import aiohttp
import av
import numpy as np
import pytest
import pytest_asyncio
from compat_support import (
    cartesia_message,
    compat_server,
    conforms,
    llm_turn,
    released,
    run_tts,
    spoken_audio,
    words_spoken,
)
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

KEY = "sk_car_test"
VOICE = {"mode": "id", "id": "f786b574-daa5-4673-aa0c-cbe3e8534c02"}  # a Cartesia voice: not stored here
PCM_24K = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def port(engine):
    async with compat_server(engine, KEY) as port:
        yield port


def _connect(port: int, **kwargs):
    return connect(f"ws://127.0.0.1:{port}/tts/websocket", additional_headers={"X-API-Key": KEY,
                                                                              "Cartesia-Version": "2025-04-16"},
                   **kwargs)


def _request(context_id: str, transcript: str, *, more: bool = True, fmt: dict = PCM_24K, **fields) -> str:
    return json.dumps({"model_id": "sonic-3", "voice": VOICE, "output_format": fmt, "language": "en",
                       "context_id": context_id, "transcript": transcript, "continue": more, **fields})


async def _until_done(ws, context_id: str) -> tuple[list[dict], list[dict]]:
    """(chunk messages, other messages) of one context up to its `done`, every message checked against the
    `cartesia` SDK's models; fails on an error."""
    chunks, others = [], []
    while True:
        m = json.loads(await asyncio.wait_for(ws.recv(), 20))
        cartesia_message(m)
        if m.get("context_id") != context_id:
            continue
        assert m["type"] != "error", m
        if m["type"] == "done":
            assert m["done"] is True and m["status_code"] == 200
            return chunks, others
        if m["type"] == "chunk":
            assert m["done"] is False and m["status_code"] == 206 and m["step_time"] >= 0
            chunks.append(m)
        else:
            others.append(m)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pipecat's own
async def test_pipecat_cartesia_service_speaks_an_llm_turn_with_word_timestamps(port):
    from pipecat.services.cartesia.tts import CartesiaTTSService

    words = ["Hello", "there,", "how", "are", "you", "today?"]
    tts = CartesiaTTSService(api_key=KEY, url=f"ws://127.0.0.1:{port}/tts/websocket", sample_rate=24000,
                             settings=CartesiaTTSService.Settings(voice=VOICE["id"]))
    # the words are pushed as the audio plays out, in step with the timestamps: wait for them
    frames = await run_tts(tts, llm_turn("Hello", " there", ",", " how", " are", " you", " today", "?"), 24000,
                           until=lambda frames: len(words_spoken(frames)) >= len(words))

    audio = spoken_audio(frames, 24000)
    assert all(len(f.audio) == 960 for f in audio)  # 20 ms of 16-bit PCM at 24 kHz per chunk
    assert words_spoken(frames) == words  # Pipecat's transcript of what was spoken, from our word timestamps


async def test_continuations_flushes_and_timestamps_in_f32(port):
    fmt = {"container": "raw", "encoding": "pcm_f32le", "sample_rate": 16000}
    async with _connect(port) as ws:
        await ws.send(_request("a", "Hello there, ", fmt=fmt, add_timestamps=True))
        await ws.send(_request("a", "how are you?", fmt=fmt, flush=True, add_timestamps=True))
        await ws.send(_request("a", " Fine, thanks.", fmt=fmt, add_timestamps=True))
        await ws.send(_request("a", "", more=False, fmt=fmt))  # no more input
        chunks, others = await _until_done(ws, "a")
    audio = [np.frombuffer(base64.b64decode(c["data"]), dtype="<f4") for c in chunks]
    assert all(len(a) == 320 for a in audio)  # 20 ms at 16 kHz, 4 bytes a sample
    samples = np.concatenate(audio)
    assert np.abs(samples).max() <= 1.0 and np.sqrt(np.mean(samples ** 2)) > 1e-4
    flush_done = [m for m in others if m["type"] == "flush_done"]
    assert [(m["flush_id"], m["flush_done"]) for m in flush_done] == [(1, True)]
    # audio up to the flush is flush 1's, what follows belongs to no flush (none was asked for after it)
    flushed_at = sum(1 for m in chunks if m.get("flush_id") == 1)
    assert [c.get("flush_id") for c in chunks] == [1] * flushed_at + [None] * (len(chunks) - flushed_at)
    words = [w for m in others if m["type"] == "timestamps" for w in m["word_timestamps"]["words"]]
    assert words == ["Hello", "there,", "how", "are", "you?", "Fine,", "thanks."]
    starts = [t for m in others if m["type"] == "timestamps" for t in m["word_timestamps"]["start"]]
    ends = [t for m in others if m["type"] == "timestamps" for t in m["word_timestamps"]["end"]]
    assert starts == sorted(starts) and all(s < e for s, e in zip(starts, ends, strict=True))
    assert ends[-1] == pytest.approx(len(samples) / 16000, abs=0.021)  # the last word ends with the audio
    # flush_done follows the flush's last audio: "you?" ends in the last chunk tagged with flush 1
    assert flushed_at * 0.02 - 0.02 < ends[words.index("you?")] <= flushed_at * 0.02 + 0.001


@pytest.mark.parametrize("voice", [VOICE["id"], {"id": VOICE["id"]}, VOICE,
                                   {"mode": "embedding", "embedding": [0.1] * 192}],
                         ids=["id-string", "id-object", "mode-id", "embedding"])
async def test_every_documented_voice_form_speaks(port, voice):
    async with _connect(port) as ws:
        await ws.send(_request("v", "Hi there.", more=False, voice=voice))
        chunks, _ = await _until_done(ws, "v")
    assert chunks
    body = {"model_id": "sonic-3", "transcript": "Hi there.", "voice": voice, "output_format": PCM_24K}
    async with aiohttp.ClientSession() as http, http.post(f"http://127.0.0.1:{port}/tts/bytes", json=body,
                                                          headers={"X-API-Key": KEY}) as r:
        assert r.status == 200 and len(await r.read()) % 960 == 0


async def test_cartesia_sdk_speaks_with_a_plain_voice_id_over_http_and_the_socket(port):
    from cartesia import AsyncCartesia

    async with AsyncCartesia(api_key=KEY, base_url=f"http://127.0.0.1:{port}",
                             websocket_base_url=f"ws://127.0.0.1:{port}") as client:
        response = await client.tts.generate(model_id="sonic-3", transcript="Hello from the SDK.",
                                             voice=VOICE["id"], output_format=PCM_24K)
        audio = await response.read()
        assert audio and len(audio) % 960 == 0  # whole 20 ms frames of 24 kHz s16le

        async with client.tts.websocket_connect() as connection:
            ctx = connection.context(model_id="sonic-3", voice=VOICE["id"], output_format=PCM_24K,
                                     add_timestamps=True)
            await ctx.push("Hello there, how are you?", flush=True)
            await ctx.push(" Fine, thanks.")
            await ctx.no_more_inputs()
            events = [event async for event in ctx.receive()]
    kinds = [e.type for e in events]
    assert kinds[-1] == "done" and kinds.count("flush_done") == 1
    chunks = [e for e in events if e.type == "chunk"]
    flushed_at = kinds.index("flush_done")
    # flush 1's audio, its flush_done, then the rest, which belongs to no flush
    assert {e.flush_id for e in events[:flushed_at] if e.type == "chunk"} == {1}
    assert {e.flush_id for e in events[flushed_at:] if e.type == "chunk"} == {None}
    assert sum(len(c.audio) for c in chunks) % 960 == 0
    words = [w for e in events if e.type == "timestamps" for w in e.word_timestamps.words]
    assert words == ["Hello", "there,", "how", "are", "you?", "Fine,", "thanks."]


async def test_contexts_speak_at_once_each_in_its_own_format_and_cancel_stops_one(port):
    story = " ".join(f"This is part {i} of a long reply that the caller interrupts." for i in range(12))
    mulaw = {"container": "raw", "encoding": "pcm_mulaw", "sample_rate": 8000}
    async with _connect(port) as ws:
        await ws.send(_request("long", story))
        await ws.send(_request("phone", "A short line for the phone.", more=False, fmt=mulaw))
        sizes: dict[str, set[int]] = {"long": set(), "phone": set()}
        done = False
        while not done or not sizes["long"]:
            m = json.loads(await asyncio.wait_for(ws.recv(), 20))
            assert m["type"] != "error", m
            if m["type"] == "chunk":
                sizes[m["context_id"]].add(len(base64.b64decode(m["data"])))
            done |= m["type"] == "done" and m["context_id"] == "phone"
        assert sizes == {"long": {960}, "phone": {160}}  # 20 ms of s16 at 24 kHz / of mu-law at 8 kHz
        await ws.send(json.dumps({"context_id": "long", "cancel": True}))
        with pytest.raises(TimeoutError):  # silence for the cancelled context from here on (frames in flight aside)
            while True:
                m = json.loads(await asyncio.wait_for(ws.recv(), 1.0))
                assert m["type"] == "chunk" and m["context_id"] == "long", m
        await ws.send(_request("next", "Still here.", more=False))
        chunks, _ = await _until_done(ws, "next")
        assert chunks


@pytest.mark.parametrize("message, field", [
    ("{not json", "invalid JSON"),
    (json.dumps(["a list"]), "JSON object"),
    (json.dumps({"transcript": "Hi."}), "context_id"),
    (_request("x", "Hi.", fmt={"container": "mp3", "sample_rate": 44100}), "output_format"),
    (_request("x", "Hi.", fmt={"container": "raw", "encoding": "pcm_mulaw", "sample_rate": 16000}), "sample_rate"),
    (_request("x", "Hi.", voice={"mode": "id"}), "voice"),
    (_request("x", "Hi.", voice=["not", "a", "voice"]), "voice"),
    (_request("x", "Hi.", max_buffer_delay_ms=9000), "max_buffer_delay_ms"),
    (json.dumps({"context_id": "x", "transcript": 7}), "transcript"),
    (_request("x" * 129, "Hi."), "context_id"),
])
async def test_bad_requests_get_a_typed_error_and_the_socket_serves_on(port, message, field):
    async with _connect(port) as ws:
        await ws.send(message)
        error = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert error["type"] == "error" and error["status_code"] == 400 and error["done"] is True
        assert field in error["message"] and error["error_code"] == "invalid_request"
        named = json.loads(message).get("context_id") if message.startswith("{\"") else None
        assert error["context_id"] == named  # the context the request named, if it named one
        await ws.send(_request("ok", "Still fine.", more=False))
        chunks, _ = await _until_done(ws, "ok")
        assert chunks


async def test_input_after_the_last_is_refused_and_the_context_still_finishes(port):
    async with _connect(port) as ws:
        await ws.send(_request("a", "One sentence to say.", more=False))
        await ws.send(_request("a", "Too late."))
        error = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert error["type"] == "error" and error["context_id"] == "a" and error["done"] is False
        assert "continue: false" in error["message"]
        chunks, _ = await _until_done(ws, "a")
        assert chunks


async def test_too_much_text_in_one_input_is_refused_with_the_native_limit(port):
    async with _connect(port) as ws:
        await ws.send(_request("a", "word " * 500, more=False))  # 2,500 characters: over the 2,000 per message
        error = json.loads(await asyncio.wait_for(ws.recv(), 10))
    assert error["type"] == "error" and error["error_code"] == "text_too_long" and error["status_code"] == 400


@pytest.mark.parametrize("headers, query, status", [({}, "", 401), ({"X-API-Key": "wrong"}, "", 401),
                                                   ({}, "?api_key=wrong", 401)])
async def test_a_bad_key_is_refused_before_the_upgrade(port, headers, query, status):
    with pytest.raises(InvalidStatus) as refused:
        async with connect(f"ws://127.0.0.1:{port}/tts/websocket{query}", additional_headers=headers):
            pass
    assert refused.value.response.status_code == status
    assert json.loads(refused.value.response.body)["error"] == "unauthorized"


async def test_the_api_key_may_come_in_the_query_or_as_bearer(port):
    for url, headers in ((f"ws://127.0.0.1:{port}/tts/websocket?api_key={KEY}", {}),
                         (f"ws://127.0.0.1:{port}/tts/websocket", {"Authorization": f"Bearer {KEY}"})):
        async with connect(url, additional_headers=headers) as ws:
            await ws.send(_request("a", "Hi.", more=False))
            chunks, _ = await _until_done(ws, "a")
            assert chunks


async def test_a_client_gone_mid_speech_leaves_no_session_and_no_engine_request(port, engine):
    story = " ".join(f"This is part {i} of a long reply nobody stays for." for i in range(12))
    async with _connect(port) as ws:
        await ws.send(_request("a", story, more=False))
        assert json.loads(await asyncio.wait_for(ws.recv(), 20))["type"] == "chunk"
        assert engine.stats().in_flight >= 1
    await released(port, engine)


# ---------------------------------------------------------------------------------------------------- /tts/bytes


async def _post_bytes(port: int, body: dict | bytes, headers: dict | None = None) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as http:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with http.post(f"http://127.0.0.1:{port}/tts/bytes", data=data,
                             headers={"X-API-Key": KEY, **(headers or {})}) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.read()


def _bytes_request(fmt: dict, transcript: str = "Hello from the bytes endpoint.") -> dict:
    return {"model_id": "sonic-3", "transcript": transcript, "voice": VOICE, "output_format": fmt}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pipecat's own
async def test_pipecat_cartesia_http_service_gets_raw_pcm(port):
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.services.cartesia.tts import CartesiaHttpTTSService

    async with aiohttp.ClientSession() as http:
        tts = CartesiaHttpTTSService(api_key=KEY, base_url=f"http://127.0.0.1:{port}", aiohttp_session=http,
                                     sample_rate=24000, settings=CartesiaHttpTTSService.Settings(voice=VOICE["id"]))
        frames = await run_tts(tts, [TTSSpeakFrame("Hello there.")], 24000)
    assert not [f for f in frames if isinstance(f, ErrorFrame)]
    audio = b"".join(f.audio for f in frames if isinstance(f, TTSAudioRawFrame))
    assert audio and len(audio) % 960 == 0  # whole 20 ms frames of 16-bit PCM at 24 kHz


@pytest.mark.parametrize("fmt, content_type", [
    ({"container": "wav", "encoding": "pcm_s16le", "sample_rate": 16000}, "audio/wav"),
    ({"container": "mp3", "sample_rate": 44100, "bit_rate": 64000}, "audio/mpeg"),
])
async def test_bytes_in_a_container_decode_at_the_asked_rate(port, fmt, content_type):
    status, ctype, data = await _post_bytes(port, _bytes_request(fmt))
    assert status == 200 and ctype == content_type
    with av.open(io.BytesIO(data)) as f:
        assert f.streams.audio[0].rate == fmt["sample_rate"]
        assert sum(frame.samples for frame in f.decode(audio=0)) > 0


async def test_bytes_raw_f32_and_mulaw(port):
    status, ctype, f32 = await _post_bytes(port, _bytes_request(
        {"container": "raw", "encoding": "pcm_f32le", "sample_rate": 22050}))
    assert status == 200 and ctype == "application/octet-stream"
    samples = np.frombuffer(f32, dtype="<f4")
    assert len(f32) % 4 == 0 and np.abs(samples).max() <= 1.0 and np.sqrt(np.mean(samples ** 2)) > 1e-4
    status, _, mulaw = await _post_bytes(port, _bytes_request(
        {"container": "raw", "encoding": "pcm_mulaw", "sample_rate": 8000}))
    assert status == 200 and mulaw and len(mulaw) % 160 == 0  # whole 20 ms frames of 8 kHz mu-law


@pytest.mark.parametrize("body, headers, status, words", [
    (_bytes_request(PCM_24K), {"X-API-Key": "wrong"}, 401, "API key"),
    (b"{not json", {}, 400, "invalid JSON"),
    (_bytes_request(PCM_24K, transcript="  "), {}, 400, "transcript"),
    (_bytes_request({"container": "ogg", "sample_rate": 48000}), {}, 400, "container"),
    (_bytes_request({"container": "wav", "encoding": "pcm_f32le", "sample_rate": 16000}), {}, 400, "pcm_s16le"),
    (_bytes_request({"container": "raw", "encoding": "pcm_s16le", "sample_rate": 12345}), {}, 400, "sample_rate"),
    ({**_bytes_request(PCM_24K), "voice": {"mode": "embedding", "embedding": []}}, {}, 400, "voice"),
])
async def test_bad_bytes_requests_get_a_status_and_a_reason(port, body, headers, status, words):
    got, ctype, data = await _post_bytes(port, body, headers)
    assert got == status and ctype.startswith("application/json")
    error = json.loads(data)
    assert words in error["message"] and error["status_code"] == status and error["error"]


async def test_a_bytes_client_gone_mid_stream_leaves_nothing_behind(port, engine):
    story = " ".join(f"This is sentence {i} of an answer nobody waits for." for i in range(40))
    async with aiohttp.ClientSession() as http, http.post(f"http://127.0.0.1:{port}/tts/bytes", headers={
            "X-API-Key": KEY}, json=_bytes_request(PCM_24K, story)) as r:
        assert r.status == 200
        await r.content.readexactly(960)
        assert engine.stats().in_flight >= 1
    await released(port, engine)


async def test_sse_sends_chunks_word_timestamps_and_done(port):
    body = {**_bytes_request({"container": "raw", "encoding": "pcm_f32le", "sample_rate": 16000},
                             "Hello there. How are you today?"), "add_timestamps": True, "context_id": "sse-1"}
    async with aiohttp.ClientSession() as http, http.post(f"http://127.0.0.1:{port}/tts/sse", json=body,
                                                          headers={"X-API-Key": KEY}) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        events = [json.loads(line[len(b"data: "):]) for line in (await r.read()).split(b"\n\n") if line]
    from cartesia.types import tts_sse_event as sse

    models = {"chunk": sse.TTSSSEChunkEvent, "timestamps": sse.TTSSSETimestampsEvent, "done": sse.TTSSSEDoneEvent}
    for event in events:  # each as the `cartesia` SDK's own event model
        conforms(models[event["type"]], event)
    assert all(e["context_id"] == "sse-1" for e in events) and events[-1]["type"] == "done"
    chunks = [e for e in events if e["type"] == "chunk"]
    samples = np.concatenate([np.frombuffer(base64.b64decode(c["data"]), dtype="<f4") for c in chunks])
    assert len(samples) % 320 == 0 and np.abs(samples).max() <= 1.0  # 20 ms of f32 at 16 kHz per chunk
    words = [w for e in events if e["type"] == "timestamps" for w in e["word_timestamps"]["words"]]
    ends = [t for e in events if e["type"] == "timestamps" for t in e["word_timestamps"]["end"]]
    assert words == ["Hello", "there.", "How", "are", "you", "today?"]
    assert ends[-1] == pytest.approx(len(samples) / 16000, abs=0.021)


async def test_sse_takes_raw_output_only(port):
    async with aiohttp.ClientSession() as http, http.post(f"http://127.0.0.1:{port}/tts/sse", headers={
            "X-API-Key": KEY}, json=_bytes_request({"container": "wav", "encoding": "pcm_s16le",
                                                    "sample_rate": 16000})) as r:
        assert r.status == 400 and "raw" in (await r.json())["message"]
