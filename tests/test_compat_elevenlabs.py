"""ElevenLabs stream-input / multi-stream-input and the HTTP speech endpoints against a real aiohttp server and the real
tiny engine: Pipecat's own ElevenLabsTTSService and ElevenLabsHttpTTSService, and raw peers speaking the documented
message schema."""

import asyncio
import base64
import io
import json

import aiohttp
import av
import pytest
import pytest_asyncio
from compat_support import compat_server, conforms, elevenlabs_message, run_tts, spoken_audio, words_spoken
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

KEY = "xi-test-key"
VOICE = "21m00Tcm4TlvDq8ikWAM"  # an ElevenLabs voice id: not stored here, so the default voice speaks


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def port(engine):
    async with compat_server(engine, KEY) as port:
        yield port


def _url(port: int, endpoint: str, **query: str) -> str:
    q = "&".join(f"{k}={v}" for k, v in query.items())
    return f"ws://127.0.0.1:{port}/v1/text-to-speech/{VOICE}/{endpoint}?model_id=eleven_flash_v2_5&{q}"


async def _until_final(ws, context_id: str | None = None, alignments: list | None = None) -> list[bytes]:
    """Audio payloads (of one context) up to its isFinal message, every message checked against the `elevenlabs`
    SDK's models (stream-input's when `context_id` is None); the alignments (each on an audio message) go to
    `alignments` as (alignment, audio bytes before the message)."""
    payloads = []
    while True:
        m = json.loads(await asyncio.wait_for(ws.recv(), 20))
        assert "error" not in m, m
        elevenlabs_message(m, multi=context_id is not None)
        if context_id is not None and m.get("contextId") != context_id:
            continue
        if m.get("isFinal") is True:
            return payloads
        if m["alignment"] is not None:  # a segment's, on its last audio
            assert m["alignment"] == m["normalizedAlignment"] and m["alignment"]["chars"]
            if alignments is not None:
                alignments.append((m["alignment"], sum(map(len, payloads))))
        payloads.append(base64.b64decode(m["audio"]))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pipecat's own (audioop, AudioContextTTSService)
async def test_pipecat_elevenlabs_service_gets_24khz_audio_frames_and_the_words_spoken(port):
    from pipecat.frames.frames import TTSSpeakFrame
    from pipecat.services.elevenlabs.tts import ElevenLabsTTSService

    words = ["Hello", "there.", "How", "are", "you?"]
    tts = ElevenLabsTTSService(api_key=KEY, url=f"ws://127.0.0.1:{port}", sample_rate=24000,
                               settings=ElevenLabsTTSService.Settings(voice=VOICE))
    # Pipecat takes the words spoken from our alignment, pushed as the audio plays out: wait for them
    frames = await run_tts(tts, [TTSSpeakFrame(" ".join(words))], 24000,
                           until=lambda frames: len(words_spoken(frames)) >= len(words))
    assert words_spoken(frames) == words

    audio = spoken_audio(frames, 24000)
    assert all(len(f.audio) == 960 for f in audio)  # 20 ms of 16-bit PCM at 24 kHz per message


@pytest.mark.parametrize("sync_alignment", [False, True])
async def test_alignment_rides_on_each_segments_last_audio(port, sync_alignment):
    text = "Hello there. How are you? Fine, thanks."
    alignments: list[tuple[dict, int]] = []
    query = {"output_format": "pcm_16000", **({"sync_alignment": "true"} if sync_alignment else {})}
    async with connect(_url(port, "stream-input", **query), additional_headers={"xi-api-key": KEY}) as ws:
        await ws.send(json.dumps({"text": " "}))
        await ws.send(json.dumps({"text": text, "flush": True}))
        await ws.send(json.dumps({"text": ""}))
        audio = await _until_final(ws, alignments=alignments)
    assert len(alignments) > 1  # one per segment
    assert "".join(c for a, _ in alignments for c in a["chars"]).split() == text.split()
    ends_ms = []
    for a, before in alignments:  # in whole ms, back to back inside each
        starts, durations = a["charStartTimesMs"], a["charDurationsMs"]
        assert all(s + d == n for s, d, n in zip(starts, durations, starts[1:], strict=False))
        start_ms = ends_ms[-1] if ends_ms and sync_alignment else 0
        assert starts[0] == pytest.approx(start_ms, abs=1)  # restart at 0, or go on from the last (sync_alignment)
        ends_ms.append(starts[-1] + durations[-1] + (0 if sync_alignment else sum(ends_ms[-1:])))
        # the last audio of the segment carries it: the audio sent so far reaches the segment's end
        assert before / 32 < ends_ms[-1] <= before / 32 + 20 + 1
    assert ends_ms[-1] == pytest.approx(sum(map(len, audio)) / 32, abs=len(alignments))  # the spans tile the audio


async def test_stream_input_ulaw_with_key_in_first_message(port):
    async with connect(_url(port, "stream-input", output_format="ulaw_8000")) as ws:
        await ws.send(json.dumps({"text": " ", "xi_api_key": KEY, "voice_settings": {"stability": 0.5},
                                  "generation_config": {"chunk_length_schedule": [50, 120, 160, 250]}}))
        for piece in ("Hello ", "there. ", "How are ", "you?"):
            await ws.send(json.dumps({"text": piece, "try_trigger_generation": True}))
        await ws.send(json.dumps({"text": ""}))  # end of input
        payloads = await _until_final(ws)
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5)
    assert ws.close_code == 1000
    assert payloads and all(len(p) == 160 for p in payloads)  # 20 ms of 8 kHz mu-law each


async def test_multi_stream_contexts_flush_close_and_barge_in(port):
    async with connect(_url(port, "multi-stream-input", output_format="pcm_16000"),
                       additional_headers={"xi-api-key": KEY}) as ws:
        await ws.send(json.dumps({"text": " ", "context_id": "a", "voice_settings": {"speed": 1.0}}))
        await ws.send(json.dumps({"text": "Hello there. ", "context_id": "a"}))
        await ws.send(json.dumps({"text": "", "context_id": "a"}))  # keepalive
        await ws.send(json.dumps({"context_id": "a", "flush": True}))
        await ws.send(json.dumps({"context_id": "a", "close_context": True}))  # after a flush: finish speaking
        a = await _until_final(ws, "a")
        assert a and sum(map(len, a)) % 640 == 0  # whole 20 ms frames of 16 kHz s16le

        story = " ".join(f"This is part {i} of a reply the caller interrupts." for i in range(12))
        await ws.send(json.dumps({"text": story, "context_id": "b"}))
        first = json.loads(await asyncio.wait_for(ws.recv(), 20))
        assert first["contextId"] == "b" and first["audio"]
        await ws.send(json.dumps({"context_id": "b", "close_context": True}))  # unflushed: a barge-in
        b = await _until_final(ws, "b")
        assert sum(map(len, b)) / 32000 < 3.0  # cut short: the whole story is ~10 s, paced 1.5 s ahead
        with pytest.raises(TimeoutError):  # the interrupted context stays silent (its story had seconds left)
            m = json.loads(await asyncio.wait_for(ws.recv(), 0.5))
            pytest.fail(f"message after the barge-in: {m}")
        await ws.send(json.dumps({"close_socket": True}))
        with pytest.raises(ConnectionClosed):
            while True:
                m = json.loads(await asyncio.wait_for(ws.recv(), 5))
                assert "error" not in m, m
    assert ws.close_code == 1000


@pytest.mark.parametrize("output_format, container, rate", [("opus_48000_64", "ogg", 48000),
                                                             (None, "mp3", 44100)])
async def test_container_formats_are_one_decodable_stream_per_context(port, output_format, container, rate):
    query = {"output_format": output_format} if output_format else {}
    async with connect(_url(port, "stream-input", **query), additional_headers={"xi-api-key": KEY}) as ws:
        await ws.send(json.dumps({"text": " "}))
        await ws.send(json.dumps({"text": "Hi there.", "flush": True}))
        await ws.send(json.dumps({"text": ""}))
        data = b"".join(await _until_final(ws))
    with av.open(io.BytesIO(data)) as f:
        assert f.format.name.split(",")[0] == container
        assert f.streams.audio[0].rate == rate
        assert sum(frame.samples for frame in f.decode(audio=0)) > 0


async def _error(ws) -> dict:
    while True:
        m = json.loads(await asyncio.wait_for(ws.recv(), 10))
        if "error" in m:
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 5)
            return m


@pytest.mark.parametrize("query, headers, messages, error", [
    ({}, {"xi-api-key": "wrong"}, [], "invalid_api_key"),
    ({}, {}, [{"text": " ", "xi_api_key": "wrong"}], "invalid_api_key"),
    ({}, {}, [{"text": " "}], "invalid_api_key"),
    ({"output_format": "wav_44100"}, {"xi-api-key": KEY}, [], "invalid_output_format"),
    ({"inactivity_timeout": "999"}, {"xi-api-key": KEY}, [], "invalid_request"),
    ({}, {"xi-api-key": KEY}, ["{not json"], "invalid_message"),
    ({}, {"xi-api-key": KEY}, [{"text": 5}], "invalid_message"),
    ({}, {"xi-api-key": KEY}, [{"text": " ", "generation_config": {"chunk_length_schedule": "fast"}}],
     "invalid_request"),
])
async def test_bad_input_gets_an_elevenlabs_error_and_a_1008_close(port, query, headers, messages, error):
    async with connect(_url(port, "stream-input", **query), additional_headers=headers) as ws:
        for m in messages:
            await ws.send(m if isinstance(m, str) else json.dumps(m))
        reply = await _error(ws)
    assert reply["error"] == error and reply["code"] == 1008 and reply["message"]
    assert ws.close_code == 1008


async def test_a_sixth_context_exceeds_the_limit(port):
    async with connect(_url(port, "multi-stream-input", output_format="pcm_16000"),
                       additional_headers={"xi-api-key": KEY}) as ws:
        for i in range(6):
            await ws.send(json.dumps({"text": "Some words to say.", "context_id": f"c{i}"}))
        reply = await _error(ws)
    assert reply["error"] == "max_active_conversations" and ws.close_code == 1008


async def test_inactivity_timeout_closes_with_input_timeout_exceeded(port):
    async with connect(_url(port, "multi-stream-input", output_format="pcm_16000", inactivity_timeout="1"),
                       additional_headers={"xi-api-key": KEY}) as ws:
        await ws.send(json.dumps({"text": " ", "context_id": "a"}))
        reply = await _error(ws)
    assert reply["error"] == "input_timeout_exceeded" and ws.close_code == 1008


async def test_stream_input_with_nothing_to_say_ends_at_once(port):
    async with connect(_url(port, "stream-input", output_format="pcm_24000"),
                       additional_headers={"xi-api-key": KEY}) as ws:
        await ws.send(json.dumps({"text": " "}))
        await ws.send(json.dumps({"text": ""}))
        assert await _until_final(ws) == []
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5)
    assert ws.close_code == 1000


# ---------------------------------------------------------------------------------------------------- HTTP


async def _post(port: int, variant: str, body: dict | bytes, key: str = KEY, **query: str):
    """(status, content type, body) of POST /v1/text-to-speech/{VOICE}{variant}."""
    async with aiohttp.ClientSession() as http:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with http.post(f"http://127.0.0.1:{port}/v1/text-to-speech/{VOICE}{variant}", params=query, data=data,
                             headers={"xi-api-key": key, "Content-Type": "application/json"}) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.read()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pipecat's own
async def test_pipecat_elevenlabs_http_service_gets_audio_and_the_words_spoken(port):
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.services.elevenlabs.tts import ElevenLabsHttpTTSService

    words = ["Hello", "there,", "how", "are", "you", "today?"]
    async with aiohttp.ClientSession() as http:
        tts = ElevenLabsHttpTTSService(api_key=KEY, base_url=f"http://127.0.0.1:{port}", aiohttp_session=http,
                                       sample_rate=16000, settings=ElevenLabsHttpTTSService.Settings(voice=VOICE))
        # the words are pushed as the audio plays out, in step with the alignment: wait for them
        frames = await run_tts(tts, [TTSSpeakFrame(" ".join(words))], 16000,
                               until=lambda frames: len(words_spoken(frames)) >= len(words))
    assert not [f for f in frames if isinstance(f, ErrorFrame)]
    audio = b"".join(f.audio for f in frames if isinstance(f, TTSAudioRawFrame))
    assert audio and len(audio) % 640 == 0  # whole 20 ms frames of 16 kHz 16-bit PCM
    assert words_spoken(frames) == words  # from our alignment


@pytest.mark.parametrize("variant, query, frame_bytes", [("/stream", {"output_format": "pcm_16000"}, 640),
                                                         ("", {"output_format": "ulaw_8000"}, 160)])
async def test_http_speech_streams_raw_audio(port, variant, query, frame_bytes):
    status, ctype, data = await _post(port, variant, {"text": "Hello over HTTP.", "model_id": "eleven_flash_v2_5",
                                                      "voice_settings": {"stability": 0.5}}, **query)
    assert status == 200 and ctype in ("audio/pcm", "audio/basic")
    assert data and len(data) % frame_bytes == 0


async def test_http_speech_defaults_to_mp3_44100(port):
    status, ctype, data = await _post(port, "", {"text": "Hello over HTTP."})
    assert status == 200 and ctype == "audio/mpeg"
    with av.open(io.BytesIO(data)) as f:
        assert f.streams.audio[0].rate == 44100 and sum(frame.samples for frame in f.decode(audio=0)) > 0


async def test_the_same_seed_gives_the_same_audio(port):
    body = {"text": "Say it the same way twice.", "seed": 42}
    first = await _post(port, "/stream", body, output_format="pcm_24000")
    second = await _post(port, "/stream", body, output_format="pcm_24000")
    assert first[0] == second[0] == 200 and first[2] == second[2] and first[2]


async def test_with_timestamps_aligns_every_character_within_the_audio(port):
    text = "Hello there. How are you?"
    status, ctype, data = await _post(port, "/with-timestamps", {"text": text}, output_format="pcm_24000")
    assert status == 200 and ctype.startswith("application/json")
    reply = json.loads(data)
    audio_s = len(base64.b64decode(reply["audio_base64"])) / 48000
    alignment = reply["alignment"]
    assert "".join(alignment["characters"]).split() == text.split()
    starts, ends = alignment["character_start_times_seconds"], alignment["character_end_times_seconds"]
    assert len(starts) == len(ends) == len(alignment["characters"])
    assert starts[0] == 0.0 and all(a <= b for a, b in zip(starts, ends, strict=True)) and starts == sorted(starts)
    assert ends[-1] == pytest.approx(audio_s, abs=0.021)
    assert reply["normalized_alignment"] == alignment


async def test_stream_with_timestamps_sends_json_lines(port):
    status, ctype, data = await _post(port, "/stream/with-timestamps", {"text": "Hello there. How are you?"},
                                      output_format="pcm_16000")
    lines = [json.loads(line) for line in data.splitlines() if line.strip()]
    assert status == 200 and ctype == "application/x-ndjson"
    from elevenlabs.types import StreamingAudioChunkWithTimestampsResponse

    for line in lines:  # every line has audio; an alignment rides on its segment's last
        conforms(StreamingAudioChunkWithTimestampsResponse, line)
    alignments = [line["alignment"] for line in lines if line.get("alignment")]
    assert lines and all(len(base64.b64decode(line["audio_base64"])) % 640 == 0 for line in lines)
    chars = [c for a in alignments for c in a["characters"]]
    assert "".join(chars).split() == ["Hello", "there.", "How", "are", "you?"]


@pytest.mark.parametrize("query, body, key, status, error", [
    ({}, {"text": "Hi."}, "wrong", 401, "invalid_api_key"),
    ({}, {"model_id": "eleven_flash_v2_5"}, KEY, 422, "invalid_request"),
    ({}, b"{not json", KEY, 422, "invalid_request"),
    ({}, {"text": "Hi.", "seed": -1}, KEY, 422, "invalid_request"),
    ({"output_format": "wav_44100"}, {"text": "Hi."}, KEY, 400, "invalid_output_format"),
])
async def test_http_speech_errors_in_elevenlabs_form(port, query, body, key, status, error):
    got, ctype, data = await _post(port, "/stream", body, key=key, **query)
    detail = json.loads(data)["detail"]
    assert got == status and ctype.startswith("application/json")
    assert detail["status"] == error and detail["message"]
