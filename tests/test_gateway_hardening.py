"""Issue 28's findings, each against a real server and the real tiny engine: text that is valid JSON but not valid
Unicode, malformed multipart, malformed Twilio messages, sockets that never identify themselves, clients that stop
reading, oversized frames, malformed HTTP in the logs, a key for /metrics, turns ended by a disconnect, and a server
bug answered in the protocol's own form."""

import asyncio
import base64
import json
import logging
import os
import re
import socket
import struct
import time

import aiohttp
import pytest
import pytest_asyncio
from compat_support import compat_server
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from gateway.auth import Auth
from gateway.client import VoxgateClient
from gateway.protocol import Limits
from gateway.server import ServerConfig, create_app, start_server
from gateway.session import SessionConfig

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

KEY = "hardening-key"
LONE = "\ud800"  # a lone surrogate: json.dumps writes it as the escape "\\ud800", valid JSON but not valid text
LONG_TEXT = ("A listener who stops reading gets a long answer, with several clauses and sentences to speak. "
             "It keeps going for a while, so the audio would fill every buffer on the way. And then some more.")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def port(engine):
    async with compat_server(engine, KEY) as port:
        yield port


async def _serve(engine, **config):
    """A server of its own for a test that needs other settings: (runner, port)."""
    auth = config.pop("auth", None)
    return await start_server(create_app(engine, ServerConfig(web_client_dir=None, **config), auth=auth, compat=True))


async def _get(port: int, path: str, headers: dict | None = None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}{path}", headers=headers) as r:
        return r.status, await r.text()


async def _metric(port: int, pattern: str) -> float:
    _, text = await _get(port, "/metrics", {"Authorization": f"Bearer {KEY}"})
    return sum(float(v) for v in re.findall("^" + pattern + r" (\S+)$", text, re.M))


async def _replies(ws, seconds: float = 2.0) -> tuple[list, int | None]:
    """What the server sends within `seconds` (or until it closes), and its close code (None: still open)."""
    answers = []
    try:
        while True:
            answers.append(await asyncio.wait_for(ws.recv(), seconds))
    except (TimeoutError, ConnectionClosed):
        pass
    closed = ws.protocol.close_rcvd
    return answers, None if closed is None else closed.code


# ------------------------------------------------------------------------------------------------ 1. lone surrogates


async def test_lone_surrogates_get_invalid_value_naming_the_field_on_the_native_socket(port):
    async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key=KEY) as c:
        await c.start()
        for message, field in [({"type": "text.append", "context_id": "c", "text": f"hi {LONE}"}, "text"),
                               ({"type": "text.append", "context_id": LONE, "text": "hi"}, "context_id"),
                               ({"type": "ping", "id": LONE}, "id"),
                               ({"type": "session.update", "generation": {LONE: 1}}, "generation")]:
            await c.ws.send(json.dumps(message))
            error = await c.expect("error")
            assert error["code"] == "invalid_value" and not error["fatal"] and f"'{field}" in error["message"]
        utt = await c.speak("Still here.", "after")
        assert utt.done["audio_ms"] > 0
    assert await _metric(port, r'voxgate_errors_total\{code="internal_error"\}') == 0


@pytest.mark.parametrize("path, message, check", [
    ("/v1/text-to-speech/v/stream-input?output_format=pcm_16000", {"text": f"hi {LONE}", "xi_api_key": KEY},
     lambda answers, code: code == 1008 and json.loads(answers[0])["error"] == "invalid_message"),
    ("/v1/speak", {"type": "Speak", "text": LONE},
     lambda answers, code: any(json.loads(a).get("code") == "INVALID_MESSAGE" for a in answers if isinstance(a, str))),
    ("/tts/websocket", {"context_id": LONE, "transcript": "hi", "continue": False},
     lambda answers, code: code is None and json.loads(answers[0])["type"] == "error"
     and json.loads(answers[0])["context_id"] is None),
])
async def test_lone_surrogates_get_each_protocols_typed_answer(port, path, message, check):
    headers = {"Authorization": f"Token {KEY}"} if path == "/v1/speak" else {"X-API-Key": KEY}
    async with connect(f"ws://127.0.0.1:{port}{path}", additional_headers=headers) as ws:
        await ws.send(json.dumps(message))
        answers, code = await _replies(ws, 1.0)
    assert check(answers, code), (answers, code)
    assert await _metric(port, r'voxgate_errors_total\{code="internal_error"\}') == 0


async def test_lone_surrogates_on_http_get_a_4xx_naming_the_field(port):
    bodies = {"/v1/audio/speech": {"model": "tts-1", "voice": "alloy", "input": f"hi {LONE}"},
              "/v1/text-to-speech/v": {"text": LONE}, "/tts/bytes": {"transcript": LONE}, "/v1/speak": {"text": LONE},
              "/v1/voices": {"description": f"warm {LONE}"},
              "/v1/pronunciations": {"rules": [{"word": LONE, "alias": "x"}]},
              "/v1/pronunciation-dictionaries/add-from-rules": {"name": LONE, "rules": []}}
    headers = {"Authorization": f"Bearer {KEY}", "xi-api-key": KEY, "X-API-Key": KEY}
    async with aiohttp.ClientSession() as http:
        for path, body in bodies.items():
            h = {**headers, "Authorization": f"Token {KEY}"} if path == "/v1/speak" else headers
            h = {**h, "Content-Type": "application/json"}
            async with http.post(f"http://127.0.0.1:{port}{path}", data=json.dumps(body), headers=h) as r:
                text = await r.text()
                assert 400 <= r.status < 500 and "not valid Unicode" in text, (path, r.status, text)


# ------------------------------------------------------------------------------------------------ 2. multipart

MALFORMED_MULTIPART = [
    ("multipart/form-data", b'--zz\r\nContent-Disposition: form-data; name="audio"\r\n\r\nabc\r\n--zz--\r\n'),
    ("multipart/form-data; boundary=zz", b"no boundary anywhere"),
    ("multipart/form-data; boundary=zz", b"--zz\r\nbroken header line\r\n\r\nabc\r\n--zz--\r\n"),
    ("multipart/form-data; boundary=zz", b'--zz\r\nContent-Disposition: form-data; name="audio"\r\n\r\ncut short'),
    ('multipart/form-data; boundary="', b"--\r\n"),
    ("multipart/form-data; boundary=zz",
     b'--zz\r\nContent-Disposition: form-data; name="text"\r\nContent-Type: text/plain; charset=nope\r\n\r\nab\r\n'
     b"--zz--\r\n"),
]


@pytest.mark.parametrize("route", ["/v1/voices", "/v1/loras"])
async def test_malformed_multipart_is_a_400_with_a_typed_body(port, route):
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http:
        for content_type, body in MALFORMED_MULTIPART:
            async with http.post(f"http://127.0.0.1:{port}{route}", data=body,
                                 headers={"Content-Type": content_type}) as r:
                assert r.status == 400, (content_type, body[:30], r.status, await r.text())
                assert (await r.json())["error"]["code"] in ("invalid_value", "missing_field")


# ------------------------------------------------------------------------------------------------ 3. Twilio


async def _call(port: int):
    """An agent on the control socket and a Twilio stream joined to its session: (agent, twilio)."""
    agent = await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/twilio/control", api_key=KEY)
    session_id = (await agent.start())["session_id"]
    twilio = await connect(f"ws://127.0.0.1:{port}/v1/twilio/media")
    media_format = {"encoding": "audio/x-mulaw", "sampleRate": 8000}
    await twilio.send(json.dumps({"event": "start", "streamSid": "MZ1", "start": {
        "customParameters": {"session": session_id}, "mediaFormat": media_format}}))
    await agent.expect("call.started")
    return agent, twilio


async def test_malformed_twilio_messages_are_dropped_and_the_call_goes_on(port):
    agent, twilio = await _call(port)
    async with agent:
        for junk in [{"event": "media", "media": "x"},
                     {"event": "media", "media": {"payload": "AA==", "timestamp": None}},
                     {"event": "media", "media": {"payload": "AA==", "timestamp": [1]}},
                     {"event": "mark", "mark": 5},
                     {"event": "dtmf", "dtmf": None}, {"event": "media", "media": {"payload": "!!"}}, [1], "x",
                     {"event": "start", "start": {"mediaFormat": "mulaw"}}]:
            await twilio.send(json.dumps(junk))
        await twilio.send(json.dumps({"event": "dtmf", "dtmf": {"digit": "7"}}))
        assert (await agent.expect("call.dtmf"))["digit"] == "7"  # still bridged, in order
        payload = base64.b64encode(b"\xff" * 160).decode()
        await twilio.send(json.dumps({"event": "media", "media": {"payload": payload, "timestamp": "40"}}))
        frame = await agent.recv(5)
        assert frame.pts_ms == 40 and frame.payload == b"\xff" * 160
        await twilio.close()
    assert await _metric(port, r'voxgate_errors_total\{code="internal_error"\}') == 0


@pytest.mark.parametrize("start", [{"mediaFormat": "audio/x-mulaw"}, {"customParameters": ["session", "x"]},
                                   {"customParameters": {"session": 5}}, "start"])
async def test_a_malformed_twilio_start_is_closed_with_1008(port, start):
    async with connect(f"ws://127.0.0.1:{port}/v1/twilio/media") as twilio:
        await twilio.send(json.dumps({"event": "start", "streamSid": "MZ1", "start": start}))
        _, code = await _replies(twilio, 2.0)
    assert code == 1008


# ------------------------------------------------------------------------------------------------ 4. handshake deadline

UNIDENTIFIED = ["/v1/twilio/media", "/v1/text-to-speech/v/stream-input?output_format=pcm_16000",
                "/v1/text-to-speech/v/multi-stream-input?output_format=pcm_16000"]


async def test_sockets_that_never_identify_themselves_are_closed_and_count_meanwhile(engine):
    runner, port = await _serve(engine, handshake_timeout_s=0.5, max_sessions=len(UNIDENTIFIED),
                                auth=Auth({KEY}))
    try:
        sockets = [await connect(f"ws://127.0.0.1:{port}{path}") for path in UNIDENTIFIED]
        # the server is full of sockets that have said nothing: a native session is refused
        async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key=KEY) as late:
            assert (await late.expect("error"))["code"] == "overloaded"
        t0 = time.monotonic()
        for path, ws in zip(UNIDENTIFIED, sockets, strict=True):
            answers, code = await _replies(ws, 3.0)
            assert code == 1008, (path, answers)
            if "text-to-speech" in path:
                assert json.loads(answers[0])["error"] == "input_timeout_exceeded"
        assert time.monotonic() - t0 < 2.5
        await asyncio.sleep(0.2)
        async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key=KEY) as c:
            await c.start()  # their places are free again
    finally:
        await runner.cleanup()


def _silent_connection_lasts(port: int, trickle: bytes) -> float:
    """Seconds until the server closes a TCP connection that sends `trickle` (a request never finished), up to 10."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(trickle)
        try:
            while s.recv(4096):
                pass
        except OSError:
            pass
        return time.monotonic() - t0


async def test_a_connection_that_never_finishes_its_request_is_closed(engine):
    runner, port = await _serve(engine, handshake_timeout_s=0.5)
    try:
        for trickle in (b"", b"GET /v1/stream HTTP/1.1\r\nHost: x\r\n"):
            assert await asyncio.to_thread(_silent_connection_lasts, port, trickle) < 3.0
    finally:
        await runner.cleanup()


# ------------------------------------------------------------------------------------------------ 5. slow consumers


async def test_a_client_that_stops_reading_is_dropped_at_the_stall_time(engine):
    stall_s = 1.0
    limits = Limits(slow_consumer_timeout_s=stall_s)
    runner, port = await _serve(engine, session=SessionConfig(limits=limits), socket_send_buffer=8192)
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        # reads nothing once its one-message queue is full: no audio, no pings answered
        slow = await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", sock=sock, max_queue=1)
        await slow.start(output={"format": "mulaw"})  # 8 kB/s: the socket buffers alone would hold seconds of it
        await slow.append(LONG_TEXT, "t")
        await slow.end("t")
        t0 = time.monotonic()
        while await _metric(port, r'voxgate_errors_total\{code="slow_consumer"\}') < 1:
            assert time.monotonic() - t0 < stall_s + 2.5, "the stalled client was not dropped at the stall time"
            await asyncio.sleep(0.05)
        assert await _metric(port, r"voxgate_sessions") == 0
    finally:
        await runner.cleanup()


async def test_an_idle_client_that_stops_reading_is_dropped_too(engine):
    limits = Limits(slow_consumer_timeout_s=0.5)
    runner, port = await _serve(engine, session=SessionConfig(limits=limits))
    try:
        healthy = await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream")  # reads (and pongs) by itself
        await healthy.start()
        slow = await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", max_queue=1)
        await slow.start()
        await slow.ping("a")
        await slow.ping("b")  # two pongs: the queue is full, the client reads nothing more
        t0 = time.monotonic()
        while await _metric(port, r'voxgate_errors_total\{code="slow_consumer"\}') < 1:
            assert time.monotonic() - t0 < 3.0
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # several probe periods more: a client that reads is never taken for a slow one
        await healthy.ping("still")
        assert (await healthy.expect("pong"))["id"] == "still"
        assert await _metric(port, r'voxgate_errors_total\{code="slow_consumer"\}') == 1
        await healthy.close()
    finally:
        await runner.cleanup()


async def test_a_twilio_stream_that_stops_reading_is_dropped_and_the_call_ends(engine):
    limits = Limits(slow_consumer_timeout_s=0.5)
    runner, port = await _serve(engine, session=SessionConfig(limits=limits), auth=Auth({KEY}))
    try:
        agent = await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/twilio/control", api_key=KEY)
        session_id = (await agent.start())["session_id"]
        twilio = await connect(f"ws://127.0.0.1:{port}/v1/twilio/media", max_queue=1)  # reads no more once full
        await twilio.send(json.dumps({"event": "start", "streamSid": "MZ1", "start": {
            "customParameters": {"session": session_id}}}))
        await agent.expect("call.started")
        await agent.append(LONG_TEXT, "t")
        await agent.end("t")
        assert (await agent.expect("call.stopped", timeout=10))["stream_sid"] == "MZ1"
        assert await _metric(port, r'voxgate_errors_total\{code="slow_consumer"\}') >= 1
        t0 = time.monotonic()
        while await _metric(port, r"voxgate_sessions") > 0:
            assert time.monotonic() - t0 < 5
            await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()


# ------------------------------------------------------------------------------------------------ 6. oversized frames


def _send_frame_then_read(port: int, size: int, path: str = "/v1/stream") -> tuple[int, bytes]:
    """A raw client: handshake, one masked text frame of `size` bytes sent whole, then everything the server sends
    until it closes: (bytes of the frame sent, what came back after the handshake). A reset fails the send or the
    read."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nX-API-Key: {KEY}\r\n"
                  f"Authorization: Bearer {KEY}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(4096)
        assert head.startswith(b"HTTP/1.1 101"), head
        rest = head.split(b"\r\n\r\n", 1)[1]
        s.sendall(bytes([0x81, 0xFF]) + struct.pack("!Q", size) + b"\0\0\0\0")
        chunk = b"x" * 65536
        sent = 0
        while sent < size:
            s.sendall(chunk[:size - sent])
            sent += min(len(chunk), size - sent)
        while data := s.recv(65536):
            rest += data
        return sent, rest


@pytest.mark.parametrize("size", [3 << 20, 10 << 20])
@pytest.mark.parametrize("path", ["/v1/stream", "/tts/websocket"])
async def test_oversized_frames_are_closed_with_1009(port, size, path):
    sent, received = await asyncio.to_thread(_send_frame_then_read, port, size, path)
    assert sent == size  # no reset while the client was still sending
    close = received.rfind(b"\x88\x02")
    assert close >= 0 and struct.unpack("!H", received[close + 2:close + 4])[0] == 1009


# ------------------------------------------------------------------------------------------------ 8. log noise

NOISE = [b"GET /" + b"a" * 100000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
         b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(500)) + b"\r\n",
         b"POST /v1/voices HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
         b"POST /v1/voices HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
         b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 64]
CUT_SHORT = [b"POST /v1/voices HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\nAuthorization: Bearer " + KEY.encode()
             + b'\r\nContent-Type: multipart/form-data; boundary=zz\r\n\r\n--zz\r\nContent-Disposition: form-data; '
             b'name="audio"; filename="a.wav"\r\n\r\nabc',
             b"POST /v1/voices HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\nAuthorization: Bearer " + KEY.encode()
             + b"\r\n\r\nabc",
             b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\nAuthorization: Bearer "
             + KEY.encode() + b'\r\n\r\n{"a']


def _raw(port: int, data: bytes, hang_up: bool) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        if hang_up:
            return b""
        return s.recv(200)


async def test_malformed_http_is_answered_400_and_never_logged_as_an_error(port, caplog):
    caplog.set_level(logging.DEBUG)
    for data in NOISE:
        assert (await asyncio.to_thread(_raw, port, data, False)).startswith(b"HTTP/1.0 400")
    for data in CUT_SHORT:
        await asyncio.to_thread(_raw, port, data, True)
    await asyncio.sleep(0.5)  # the handlers notice the hang-ups
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [(r.name, r.levelname, r.getMessage()) for r in loud]
    assert any(r.name == "voxgate.http" for r in caplog.records)  # still there at DEBUG, one line each
    assert (await _get(port, "/healthz"))[0] == 200


# ------------------------------------------------------------------------------------------------ 9. /metrics key


async def test_metrics_can_require_a_key_while_probes_stay_open(engine):
    runner, port = await _serve(engine, metrics_key="scrape-key")
    try:
        status, body = await _get(port, "/metrics")
        assert status == 401 and json.loads(body)["error"]["code"] == "unauthorized"
        assert (await _get(port, "/metrics", {"Authorization": "Bearer wrong"}))[0] == 401
        status, body = await _get(port, "/metrics", {"Authorization": "Bearer scrape-key"})
        assert status == 200 and "voxgate_sessions" in body
        assert (await _get(port, "/healthz"))[0] == 200 and (await _get(port, "/readyz"))[0] == 200
    finally:
        await runner.cleanup()


@pytest.mark.asyncio(loop_scope="module")
async def test_the_metrics_key_comes_from_a_file_on_the_command_line(tmp_path):
    from gateway.cli import CliError, _first_line, _parser

    (tmp_path / "key").write_text("\n  scrape-key  \n")
    args = _parser().parse_args(["serve", "--metrics-key-file", str(tmp_path / "key")])
    assert _first_line(args.metrics_key_file, "--metrics-key-file") == "scrape-key"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(CliError):
        _first_line(str(tmp_path / "empty"), "--metrics-key-file")


# ------------------------------------------------------------------------------------------------ 10. turns metric


async def test_turns_ended_by_a_disconnect_are_counted(port, engine):
    pattern = r'voxgate_turns_finished_total\{outcome="disconnected"\}'
    before = await _metric(port, pattern)
    c = await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key=KEY)
    await c.start(output={"format": "pcm_s16le"})
    await c.append(LONG_TEXT, "t")
    await c.recv(10)  # context.started: the turn runs
    c.ws.transport.abort()
    t0 = time.monotonic()
    while await _metric(port, pattern) < before + 1:
        assert time.monotonic() - t0 < 5
        await asyncio.sleep(0.05)
    while engine.stats().in_flight:
        assert time.monotonic() - t0 < 5
        await asyncio.sleep(0.05)


# ------------------------------------------------------------------------------------------------ server bugs


async def test_a_handler_bug_is_a_typed_500_logged_once(port, engine, monkeypatch, caplog):
    def broken():
        raise RuntimeError("a bug")

    monkeypatch.setattr(engine, "list_voices", broken)
    caplog.set_level(logging.ERROR)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http, \
            http.get(f"http://127.0.0.1:{port}/v1/voices") as r:
        assert r.status == 500 and (await r.json())["error"]["code"] == "internal_error"
    logged = [r for r in caplog.records if r.exc_info]
    assert len(logged) == 1 and "a bug" in str(logged[0].exc_info[1])


async def test_a_socket_bug_gets_the_protocols_error_and_the_server_serves_on(port, monkeypatch, caplog):
    from gateway.compat import cartesia

    async def broken(self, cid, m):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cartesia.CartesiaBridge, "_generate", broken)
    caplog.set_level(logging.ERROR)
    async with connect(f"ws://127.0.0.1:{port}/tts/websocket", additional_headers={"X-API-Key": KEY}) as ws:
        await ws.send(json.dumps({"context_id": "c", "transcript": "hi"}))
        answers, _ = await _replies(ws, 2.0)
    error = json.loads(answers[0])
    assert error["type"] == "error" and error["error_code"] == "internal_error" and error["done"] is True
    assert len([r for r in caplog.records if r.exc_info]) == 1
    assert (await _get(port, "/healthz"))[0] == 200


async def test_digits_that_are_not_ascii_in_query_parameters_are_refused_cleanly(port):
    """"²".isdigit() is true but int("²") fails: such parameters are the protocol's 4xx, not a server error."""
    internal = r'voxgate_errors_total\{code="internal_error"\}'
    before = await _metric(port, internal)
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/speak?sample_rate=²", "/v1/speak?encoding=mp3&bit_rate=²"):
            async with http.post(f"http://127.0.0.1:{port}{path}", json={"text": "hi"},
                                 headers={"Authorization": f"Token {KEY}"}) as r:
                assert r.status == 400 and (await r.json())["err_code"] == "INVALID_QUERY_PARAMETER"
    path = "/v1/text-to-speech/v/stream-input?output_format=pcm_16000&inactivity_timeout=²"
    async with connect(f"ws://127.0.0.1:{port}{path}", additional_headers={"xi-api-key": KEY}) as ws:
        answers, code = await _replies(ws, 2.0)
    assert code == 1008 and json.loads(answers[0])["error"] == "invalid_request"
    assert await _metric(port, internal) == before
