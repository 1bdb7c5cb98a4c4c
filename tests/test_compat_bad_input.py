"""Junk at every foreign endpoint (compat sockets and HTTP) gets that protocol's typed answer: an error message or a
policy close on a socket, a 4xx on HTTP; never an internal error, and the server serves on."""

import asyncio
import json
import re

import aiohttp
import pytest
import pytest_asyncio
from compat_support import compat_server
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

JUNK: list[str | bytes] = [
    b"\x00\x01binary", "{", "[]", "null", "42", json.dumps({"a": 1}), json.dumps({"type": None}),
    json.dumps({"context_id": "x" * 500, "transcript": "hi", "voice": {"mode": "id", "id": "v"},
                "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}}),
    json.dumps({"context_id": "a", "transcript": "hi", "voice": "v", "output_format": {}}),
    json.dumps({"context_id": "a", "cancel": "yes"}), json.dumps({"type": "Speak", "text": ["x"]}),
    json.dumps({"type": "Flush", "extra": {"deep": [1, 2]}}), json.dumps({"text": 5}),
    json.dumps({"text": " ", "xi_api_key": 7}), "x" * 70000,
]
SOCKETS = ["/tts/websocket", "/v1/speak", "/v1/text-to-speech/v/multi-stream-input?output_format=pcm_16000",
           "/v1/text-to-speech/v/stream-input?output_format=pcm_16000"]
HTTP = ["/tts/bytes", "/tts/sse", "/v1/speak", "/v1/text-to-speech/v", "/v1/text-to-speech/v/stream/with-timestamps",
        "/v1/audio/speech"]
BODIES = [b"", b"{", b"[]", b'{"text": 5, "input": 5, "transcript": 5}', json.dumps({"text": "x" * 9000}).encode()]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def port(engine):
    async with compat_server(engine) as port:
        yield port


async def _internal_errors(port: int) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    return sum(float(v) for v in re.findall(r'voxgate_errors_total\{code="internal_error"\} (\S+)', text))


@pytest.mark.parametrize("path", SOCKETS)
async def test_junk_on_a_socket_gets_typed_answers(port, path):
    async with connect(f"ws://127.0.0.1:{port}{path}", max_size=None) as ws:
        for message in JUNK:
            await ws.send(message)
        answers = []
        with pytest.raises((TimeoutError, ConnectionClosed)):
            while True:
                answers.append(await asyncio.wait_for(ws.recv(), 1.0))
        closed = ws.protocol.close_rcvd  # the server's close frame, if it closed
    assert answers, "junk went unanswered"
    assert closed is None or closed.code in (1008, 1009)  # a policy close, or aiohttp's cap on one message
    assert await _internal_errors(port) == 0


@pytest.mark.parametrize("path", HTTP)
async def test_junk_on_http_gets_a_4xx(port, path):
    async with aiohttp.ClientSession() as http:
        for body in BODIES:
            async with http.post(f"http://127.0.0.1:{port}{path}", data=body) as r:
                assert 400 <= r.status < 500, (path, body[:20], r.status, await r.text())
                assert (await r.read()).startswith(b"{")  # a JSON error body in the protocol's own form
    assert await _internal_errors(port) == 0
