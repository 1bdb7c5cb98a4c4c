"""Property-based fuzzing (hypothesis) of every client-facing parser and every WebSocket endpoint.

Parsers: random and mutated messages (valid ones with a field replaced, dropped or added; any JSON value, strings
with lone surrogates included) only ever raise the parser's own typed error. Sockets, against a real server and the
real tiny engine: random sequences of mutated messages, junk text, binary frames, fragmented messages, pings and
unsolicited pongs, frames over the size cap and pauses, ended by a close, a TCP abort or nothing at a random point;
the server answers only with documented error codes and close codes, stays up, and leaks nothing (no session, pending
socket, call or engine request outlives the client; the KV cache is all free again). HTTP speech endpoints: mutated
bodies, junk and bytes that are not UTF-8 get audio or a typed 4xx, never a 5xx. Bounded for the CPU suite (profile
"fast"); `-m soak` runs the same properties with many more examples (profile "soak") for a nightly or the GPU
machine."""

import asyncio
import base64
import contextlib
import json
import time
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.compat import cartesia, deepgram, elevenlabs, openai, twilio
from gateway.compat.twilio import CALLS
from gateway.protocol import ErrorCode, Limits, ProtocolError, parse_client_message
from gateway.server import GATEWAY, ServerConfig, create_app, start_server
from gateway.session import SessionConfig

pytestmark = [pytest.mark.timeout(600)]
ON_SERVER = pytest.mark.asyncio(loop_scope="module")

settings.register_profile("fast", max_examples=25, deadline=None, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("soak", settings.get_profile("fast"), max_examples=400)
FAST, SOAK = settings.get_profile("fast"), settings.get_profile("soak")
PARSER = settings(FAST, max_examples=300)  # pure functions: cheap

LIMITS = Limits(max_message_bytes=4096, max_text_chars=200, max_buffered_chars=600)
OVERSIZE = LIMITS.ws_max_msg_size + 1  # aiohttp closes with 1009 from here
CODES = {str(c) for c in ErrorCode}
CLOSE_CODES = {None, 1000, 1001, 1007, 1008, 1009, 1011}  # 1007: a text frame that is not UTF-8 (aiohttp)

# ------------------------------------------------------------------------------------------------ strategies

text = st.text(st.one_of(st.characters(), st.sampled_from(["\ud800", "\udfff", "\udc80"])), max_size=24)
keys = st.one_of(st.sampled_from(["type", "text", "context_id", "event", "media", "payload", "transcript", "flush",
                                  "output", "voice", "generation", "start", "cancel", "continue", "mark"]), text)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False), text)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(keys, inner, max_size=4)), max_leaves=8)


def mutated(valid: list[dict]) -> st.SearchStrategy[Any]:
    """A valid message, or one with a field's value replaced, a field dropped, or a field added."""
    def variants(m: dict) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.just(m),
            st.sampled_from(sorted(m)).flatmap(lambda k: json_values.map(lambda v: {**m, k: v})),
            st.sampled_from(sorted(m)).map(lambda k: {x: y for x, y in m.items() if x != k}),
            st.tuples(keys, json_values).map(lambda kv: {**m, kv[0]: kv[1]}),
        )
    return st.one_of(st.sampled_from(valid).flatmap(variants), json_values)


def raw_messages(valid: list[dict]) -> st.SearchStrategy[str | bytes]:
    return st.one_of(mutated(valid).map(json.dumps), text, st.binary(max_size=32))


SAY = {"format": "pcm_s16le", "sample_rate": 16000}
NATIVE = [{"type": "session.start", "output": SAY}, {"type": "text.append", "context_id": "c", "text": "Hello there. "},
          {"type": "text.flush", "context_id": "c", "flush_id": "f"}, {"type": "context.end", "context_id": "c"},
          {"type": "context.cancel", "context_id": "c"}, {"type": "playback.position", "context_id": "c",
                                                          "played_ms": 100}, {"type": "ping", "id": 1},
          {"type": "session.update", "generation": {"seed": 1}, "chunking": {"max_delay_ms": 50}},
          {"type": "session.end"}]
ELEVENLABS = [{"text": " ", "generation_config": {"chunk_length_schedule": [50]}}, {"text": "Hello. ", "flush": True},
              {"text": ""}, {"context_id": "a", "text": "Hi. "}, {"context_id": "a", "close_context": True},
              {"close_socket": True}, {"text": "More words. ", "try_trigger_generation": True}]
CARTESIA = [{"context_id": "a", "transcript": "Hello. ", "continue": True, "voice": {"mode": "id", "id": "v"},
             "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 16000}},
            {"context_id": "a", "transcript": "Bye.", "continue": False, "flush": True, "max_buffer_delay_ms": 0,
             "voice": {"mode": "id", "id": "v"}, "output_format": {"container": "raw", "encoding": "pcm_mulaw",
                                                                   "sample_rate": 8000}, "add_timestamps": True},
            {"context_id": "a", "cancel": True}]
DEEPGRAM = [{"type": "Speak", "text": "Hello there."}, {"type": "Flush"}, {"type": "Clear"}, {"type": "Close"}]
TWILIO = [{"event": "connected", "protocol": "Call", "version": "1.0.0"},
          {"event": "media", "media": {"payload": base64.b64encode(b"\xff" * 160).decode(), "timestamp": "20"}},
          {"event": "mark", "mark": {"name": "voxgate-0"}}, {"event": "dtmf", "dtmf": {"digit": "5"}},
          {"event": "stop"}]
SESSION_ID = "session-id-to-join"  # replaced by the agent's session id in the Twilio fuzzing
TWILIO_START = {"event": "start", "streamSid": "MZ", "start": {
    "customParameters": {"session": SESSION_ID}, "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000}}}
OPENAI = {"model": "tts-1", "input": "Hello.", "voice": "alloy", "response_format": "pcm", "speed": 1.0,
          "stream_format": "audio", "generation": {"seed": 1}, "instructions": "calm"}


def _is_text(value: Any) -> bool:
    """Every string in a value encodes as UTF-8 (it can go back to a client, or into the engine)."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_is_text(k) and _is_text(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(_is_text(v) for v in value)
    return True


# ------------------------------------------------------------------------------------------------ parsers


@PARSER
@given(raw=raw_messages(NATIVE))
def test_native_parser_raises_only_documented_codes(raw):
    try:
        message = parse_client_message(raw, LIMITS)
    except ProtocolError as e:
        assert str(e.code) in CODES and not e.fatal and _is_text(e.message)
    else:
        assert _is_text(vars(message))


@PARSER
@given(raw=raw_messages(ELEVENLABS), schedule=json_values, output_format=text, inactivity=text)
def test_elevenlabs_parsers_raise_only_their_error(raw, schedule, output_format, inactivity):
    for parse, arg in [(elevenlabs.Bridge._parse, raw), (elevenlabs._chunking, {"chunk_length_schedule": schedule}),
                       (elevenlabs.parse_output_format, output_format), (elevenlabs._inactivity, inactivity)]:
        try:
            parse(None, arg) if parse is elevenlabs.Bridge._parse else parse(arg)
        except elevenlabs.ElevenLabsError as e:
            assert _is_text(e.message)


@PARSER
@given(message=mutated(CARTESIA), fmt=json_values)
def test_cartesia_parsers_raise_only_their_error(message, fmt):
    for check in (lambda: cartesia._check(message, LIMITS), lambda: cartesia._output_format(fmt),
                  lambda: cartesia._http_format(fmt)):
        try:
            if isinstance(message, dict):
                check()
        except cartesia.CartesiaError as e:
            assert _is_text(e.message)


@PARSER
@given(raw=raw_messages(DEEPGRAM))
def test_deepgram_parser_raises_only_its_error(raw):
    try:
        message = deepgram._parse(raw)
    except ValueError as e:
        assert _is_text(str(e))
    else:
        assert message["type"] in ("Speak", "Flush", "Clear", "Close") and _is_text(message)


@PARSER
@given(body=mutated([OPENAI]))
def test_openai_parser_raises_only_its_error(body):
    try:
        request = openai.parse_speech_request(body, set())
    except openai.OpenAIError as e:
        assert 400 <= e.status < 500 and _is_text(e.message)
    else:
        assert isinstance(request.input, str) and request.input.strip()


@PARSER
@given(raw=raw_messages([*TWILIO, TWILIO_START]))
def test_twilio_parser_raises_only_its_error(raw):
    try:
        twilio.parse_twilio(raw)
    except twilio.MalformedTwilio as e:
        assert _is_text(str(e))


# ------------------------------------------------------------------------------------------------ sockets


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(engine):
    config = ServerConfig(session=SessionConfig(limits=LIMITS), web_client_dir=None, handshake_timeout_s=1.0)
    app = create_app(engine, config, compat=True)
    runner, port = await start_server(app)
    yield app, port
    await runner.cleanup()


def plans(valid: list[dict]) -> st.SearchStrategy[tuple[list[tuple[str, Any]], str]]:
    """What a client does: frames and pauses, then how it leaves (close, abort, or leave it to the server)."""
    frame = st.one_of(
        mutated(valid).map(lambda m: ("text", json.dumps(m))),
        mutated(valid).map(lambda m: ("text", json.dumps(m))),
        st.text(max_size=40).map(lambda t: ("text", t)),
        st.binary(max_size=64).map(lambda b: ("binary", b)),
        st.integers(OVERSIZE, OVERSIZE + 4096).map(lambda n: ("text", "x" * n)),
        st.just(("ping", b"")),
        st.just(("pong", b"")),  # unsolicited
        st.lists(st.text(max_size=8), min_size=1, max_size=3).map(lambda parts: ("fragments", parts)),
        st.floats(0.0, 0.2).map(lambda s: ("sleep", s)),
    )
    return st.tuples(st.lists(frame, max_size=8), st.sampled_from(["close", "abort", "wait"]))


def _native_reply_ok(m: dict) -> bool:
    return m.get("type") != "error" or m.get("code") in CODES


def _elevenlabs_reply_ok(m: dict) -> bool:
    names = CODES | set(elevenlabs._ERROR_NAMES.values()) | {
        "invalid_message", "invalid_request", "invalid_output_format", "max_concurrency_exceeded",
        "input_timeout_exceeded", "invalid_api_key", "text_too_long"}
    return "error" not in m or m["error"] in names and m.get("code") in (1008, 1011)


def _cartesia_reply_ok(m: dict) -> bool:
    return m.get("type") != "error" or m.get("error_code") in CODES | {"invalid_request"}


def _deepgram_reply_ok(m: dict) -> bool:
    return m.get("type") != "Warning" or m.get("code") in {c.upper() for c in CODES} | {"INVALID_MESSAGE"}


ENDPOINTS = {  # path -> (valid messages, check of one JSON reply)
    "/v1/stream": (NATIVE, _native_reply_ok),
    "/v1/twilio/control": (NATIVE, _native_reply_ok),
    "/v1/text-to-speech/v/stream-input?output_format=pcm_16000": (ELEVENLABS, _elevenlabs_reply_ok),
    "/v1/text-to-speech/v/multi-stream-input?output_format=pcm_16000": (ELEVENLABS, _elevenlabs_reply_ok),
    "/tts/websocket": (CARTESIA, _cartesia_reply_ok),
    "/v1/speak": (DEEPGRAM, _deepgram_reply_ok),
    "/v1/twilio/media": (TWILIO, lambda m: m.get("event") in ("media", "mark", "clear")),
}


async def _play(ws, plan: list[tuple[str, Any]], ending: str, reply_ok) -> None:
    """Run the client's plan, check every reply, and leave as planned."""
    replies: list[str | bytes] = []

    async def read() -> None:
        with contextlib.suppress(ConnectionClosed):
            async for reply in ws:
                replies.append(reply)

    reader = asyncio.create_task(read())
    try:
        for kind, data in plan:
            if kind == "sleep":
                await asyncio.sleep(data)
            elif kind == "ping":
                await ws.ping()
            elif kind == "pong":
                await ws.pong()
            elif kind == "fragments":  # one text message in several frames
                await ws.send(iter(data))
            else:
                await ws.send(data)
        if ending == "wait":
            await asyncio.wait({reader}, timeout=0.3)
    except ConnectionClosed:
        pass
    if ending == "abort":
        ws.transport.abort()
    else:
        await ws.close()
    await asyncio.wait({reader}, timeout=5)
    reader.cancel()
    for reply in replies:
        if isinstance(reply, str):
            message = json.loads(reply)
            assert isinstance(message, dict) and reply_ok(message), message
    closed = ws.protocol.close_rcvd
    assert (None if closed is None else closed.code) in CLOSE_CODES, closed


async def _released(app, engine) -> None:
    """Nothing outlives the clients: sessions, pending sockets, calls, engine requests, KV blocks."""
    gw = app[GATEWAY]
    deadline = time.monotonic() + 10
    while True:
        s = engine.stats()
        idle = (s.running, s.waiting, s.in_flight) == (0, 0, 0) and s.free_blocks == s.total_blocks - s.voice_blocks
        if idle and not gw.sessions and gw.pending == 0 and not app[CALLS]:
            return
        assert time.monotonic() < deadline, (len(gw.sessions), gw.pending, len(app[CALLS]), s)
        await asyncio.sleep(0.02)


async def _exercise(server, engine, path: str, data) -> None:
    app, port = server
    valid, reply_ok = ENDPOINTS[path]
    # everything is drawn before the first connection: hypothesis may end an example at any draw
    plan, ending = data.draw(plans(valid))
    start = data.draw(mutated([TWILIO_START])) if path == "/v1/twilio/media" else None
    agent = None
    if start is not None:  # a call to join: an agent's session, and a start event naming it (or not)
        agent = await connect(f"ws://127.0.0.1:{port}/v1/twilio/control")
        await agent.send(json.dumps({"type": "session.start"}))
        session_id = json.loads(await agent.recv())["session_id"]
        plan = [("text", json.dumps(start).replace(SESSION_ID, session_id)), *plan]
    try:
        async with connect(f"ws://127.0.0.1:{port}{path}", max_size=None, open_timeout=10) as ws:
            await _play(ws, plan, ending, reply_ok)
    except InvalidStatus as e:  # refused before the upgrade: a typed HTTP error
        assert e.response.status_code in (400, 401, 429, 503)
    finally:
        if agent is not None:
            await agent.close()
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/healthz") as r:
        assert r.status == 200
    await _released(app, engine)


@ON_SERVER
@pytest.mark.parametrize("path", list(ENDPOINTS))
@FAST
@given(data=st.data())
async def test_fuzz_socket(server, engine, path, data):
    await _exercise(server, engine, path, data)


@ON_SERVER
@pytest.mark.soak
@pytest.mark.parametrize("path", list(ENDPOINTS))
@SOAK
@given(data=st.data())
async def test_soak_socket(server, engine, path, data):
    await _exercise(server, engine, path, data)


@ON_SERVER
async def test_no_internal_error_was_ever_sent(server):
    """Runs after the fuzzing in this module: not one of those messages met a server bug."""
    _, port = server
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as r:
        assert 'code="internal_error"' not in await r.text()


# ------------------------------------------------------------------------------------------------ HTTP bodies

HTTP_BODIES = {  # path -> a valid body; headers are the same for all
    "/v1/audio/speech": OPENAI,
    "/v1/text-to-speech/v?output_format=pcm_16000": {"text": "Hello.", "seed": 1, "model_id": "m"},
    "/v1/text-to-speech/v/stream/with-timestamps?output_format=pcm_16000": {"text": "Hello.", "seed": 1},
    "/tts/bytes": {"transcript": "Hello.", "voice": {"mode": "id", "id": "v"}, "model_id": "m",
                   "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 16000}},
    "/tts/sse": {"transcript": "Hello.", "voice": {"mode": "id", "id": "v"}, "context_id": "c", "add_timestamps": True,
                 "output_format": {"container": "raw", "encoding": "pcm_f32le", "sample_rate": 16000}},
    "/v1/speak?encoding=linear16&container=none": {"text": "Hello."},
}


@ON_SERVER
@pytest.mark.parametrize("path", list(HTTP_BODIES))
@settings(FAST, max_examples=10)
@given(data=st.data())
async def test_fuzz_http_bodies(server, engine, path, data):
    """Mutated bodies (and junk) get audio or the protocol's typed 4xx, never a 5xx."""
    app, port = server
    body = data.draw(st.one_of(mutated([HTTP_BODIES[path]]).map(json.dumps), text, st.binary(max_size=32)))
    if isinstance(body, str):  # lone surrogates go out as the bytes they would be: not UTF-8
        body = body.encode("utf-8", "surrogatepass")
    async with aiohttp.ClientSession() as http, http.post(f"http://127.0.0.1:{port}{path}", data=body) as r:
        answer = await r.read()
        assert r.status == 200 or 400 <= r.status < 500, (r.status, answer[:200])
        if r.status != 200:
            assert isinstance(json.loads(answer), dict)
    await _released(app, engine)
