"""Deepgram-compatible speech: the streaming WebSocket `GET /v1/speak` (Aura's continuous text stream) and the REST
`POST /v1/speak {"text"}` (compat.oneshot; audio streamed in the body: linear16 raw or wav, mulaw, alaw, mp3 or Ogg
Opus; mp3 by default, as Deepgram). Pipecat's Deepgram services (tested) and other Deepgram clients that take a base
URL work with only a URL change.

Handshake: `model` (a stored voice id speaks with that voice; any other name, aura-2-helena-en say, the default
voice), `encoding` linear16 (default) | mulaw | alaw, `sample_rate` (linear16: 8000, 16000, 24000 (default), 48000;
G.711: 8000 (default)); `speed`, `mip_opt_out` and `container=none` are accepted and have no effect. Auth:
`Authorization: Token <key>` (or `Bearer <key>`), `Sec-WebSocket-Protocol: token, <key>` for browsers, or `?token=`
(a voxgate token from `POST /v1/tokens`). A bad parameter or credential is refused before the upgrade, with HTTP
400/401/429/503 and the reason in the `dg-error` header (where Deepgram puts it) and a JSON body.

Deepgram's output is one audio stream, so its text is a sequence of utterances, each closed by Flush, each one native
context; the next starts once the previous one's audio has all been sent (audio never interleaves, and the next
utterance still has all the audio the listener has queued to start in).
Client -> native: Speak {text} -> text.append; Flush -> context.end, answered by Flushed {sequence_id} once that
utterance's audio is all sent; Clear -> context.cancel of what speaks, and the utterances waiting are dropped,
answered by Cleared {sequence_id}; Close -> Flush, then the socket closes once everything is sent. sequence_id
counts those answers from 0.
Native -> client: a Metadata message first; audio frames -> binary messages of raw samples; errors -> Warning
{description, code: the native code in upper case}; a fatal one is followed by the close (1008 for the client's
mistakes, 1011 for server faults). Text waiting behind the utterance speaking is bounded like a native turn's
(max_text_chars per Speak, max_buffered_chars in all, MAX_WAITING utterances): beyond, the message is dropped with
a Warning BUFFER_FULL."""

from __future__ import annotations

import itertools
import logging
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway import protocol as p
from gateway.audio import OutputFormat, av_available
from gateway.auth import AuthError
from gateway.compat import SocketBridge, Transcoder, check_api_key, gateway_of, http_status, json_body, json_object
from gateway.compat.oneshot import NativeError, OneTurn
from gateway.protocol import ErrorCode
from gateway.sockets import open_socket
from gateway.voices import VoiceRefused

log = logging.getLogger("voxgate.compat.deepgram")

DEFAULT_MODEL = "aura-2-helena-en"
MAX_WAITING = 32  # utterances queued behind the one speaking (their text is bounded by max_buffered_chars)
# encoding -> (default rate, rates, {container: gateway.audio format}, REST's default container); the stream sends
# raw samples of the first three (container none)
ENCODINGS = {"linear16": (24000, (8000, 16000, 24000, 48000), {"none": "pcm_s16le", "wav": "wav"}, "wav"),
             "mulaw": (8000, (8000,), {"none": "mulaw"}, "none"),
             "alaw": (8000, (8000,), {"none": "alaw"}, "none"),
             "mp3": (22050, (22050,), {"none": "mp3"}, "none"),
             "opus": (48000, (48000,), {"ogg": "ogg_opus"}, "ogg")}
STREAM_ENCODINGS = ("linear16", "mulaw", "alaw")
CONTENT_TYPES = {"pcm_s16le": "application/octet-stream", "wav": "audio/wav", "mulaw": "audio/basic",
                 "alaw": "application/octet-stream", "mp3": "audio/mpeg", "ogg_opus": "audio/ogg"}


class DeepgramError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def response(self) -> web.Response:
        request_id = str(uuid.uuid4())
        return web.json_response({"err_code": self.code, "err_msg": self.message, "request_id": request_id},
                                 status=self.status, headers={"dg-error": self.message, "dg-request-id": request_id})


@dataclass
class _Utterance:
    """Speak text up to a Flush, waiting for the utterance before it to finish."""

    texts: list[str] = field(default_factory=list)
    flushed: bool = False


class DeepgramBridge(SocketBridge):
    """One Deepgram socket: translates its messages for the session, and is the session's EventSink."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, key: str, voice: str | None,
                 output: dict[str, Any]):
        super().__init__(request, ws)
        self.key, self.voice, self.output = key, voice, output
        self.current: str | None = None  # the native context of the utterance speaking (ending or cancelled too)
        self.open = False  # Speak text still goes to `current` (not yet flushed)
        self.cancelling: str | None = None  # the context a Clear cancelled: its context.cancelled answers the Clear
        self.clears = 0  # Clears that wait for that answer (one cancel serves them all)
        self.waiting: deque[_Utterance] = deque()
        self.sequence = 0  # the next Flushed / Cleared sequence_id
        self.close_when_done = False  # Close arrived
        self._ids = (str(i) for i in itertools.count())

    async def on_open(self) -> None:
        model = self.request.query.get("model", DEFAULT_MODEL)
        await self.send_json({"type": "Metadata", "request_id": str(uuid.uuid4()), "model_name": model,
                              "model_version": "voxgate", "model_uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, model))})
        await self.start_session(self.gw.config.limits, voice=self.voice, output=self.output)

    # ------------------------------------------------------------------------------------------------ client -> us

    async def handle(self, raw: str | bytes) -> None:
        try:
            m = _parse(raw)
        except ValueError as e:
            await self._warning("INVALID_MESSAGE", str(e))
            return
        kind = m["type"]
        if kind == "Speak":
            await self._speak(m["text"])
        elif kind in ("Flush", "Close"):
            self.close_when_done |= kind == "Close"
            await self._flush()
        elif kind == "Clear":
            await self._clear()

    async def _speak(self, text: str) -> None:
        if self.open and not self.waiting:  # the session bounds what a speaking context holds
            await self.to_session("text.append", context_id=self.current, text=text)
            return
        limits = self.gw.config.limits
        if len(text) > limits.max_text_chars:
            await self._warning(ErrorCode.TEXT_TOO_LONG, f"{len(text)} characters exceed the limit of "
                                f"{limits.max_text_chars} per Speak; this Speak was dropped")
            return
        if sum(len(t) for u in self.waiting for t in u.texts) + len(text) > limits.max_buffered_chars:
            await self._warning(ErrorCode.BUFFER_FULL, f"more than {limits.max_buffered_chars} characters would wait "
                                "behind the utterance speaking; this Speak was dropped")
            return
        if not self.waiting or self.waiting[-1].flushed:
            if not await self._room():
                return
            self.waiting.append(_Utterance())
        self.waiting[-1].texts.append(text)
        await self._advance()

    async def _room(self) -> bool:
        """Whether one more utterance may wait; a Warning if not."""
        if len(self.waiting) < MAX_WAITING:
            return True
        await self._warning(ErrorCode.BUFFER_FULL, f"at most {MAX_WAITING} utterances may wait behind "
                            "the one speaking; this message was dropped")
        return False

    async def _flush(self) -> None:
        if self.open and not self.waiting:
            self.open = False
            await self.to_session("context.end", context_id=self.current)
        elif self.waiting and not self.waiting[-1].flushed:
            self.waiting[-1].flushed = True
        elif await self._room():  # nothing said since the last Flush: answered in its turn
            self.waiting.append(_Utterance(flushed=True))
        await self._advance()

    async def _clear(self) -> None:
        self.waiting.clear()
        if self.current is None:
            await self._answer("Cleared")
            return
        self.open, self.clears = False, self.clears + 1
        if self.cancelling != self.current:
            self.cancelling = self.current
            await self.to_session("context.cancel", context_id=self.current)

    async def _advance(self) -> None:
        """Start the next utterance when none is speaking; answer the empty ones on the way; close after Close."""
        while self.current is None and self.waiting:
            utterance = self.waiting.popleft()
            if not utterance.texts:
                await self._answer("Flushed")
                continue
            self.current, self.open = next(self._ids), not utterance.flushed
            for text in utterance.texts:
                await self.to_session("text.append", context_id=self.current, text=text)
            if utterance.flushed:
                await self.to_session("context.end", context_id=self.current)
        if self.close_when_done and self.current is None and not self.waiting:
            self.background(self.close(1000, "Close"))

    # ------------------------------------------------------------------------------------------------ us -> client
    # (the session's EventSink)

    async def message(self, msg: p.ServerMessage) -> None:
        cid: str | None = getattr(msg, "context_id", None)
        if isinstance(msg, p.Error):
            await self._warning(msg.code, msg.message)
            assert self.session is not None
            if msg.fatal:
                self.closing = True  # the session closes the socket next
                return
            if cid is None or cid != self.current or self.session.is_live(cid):
                return  # a refused message: the utterance goes on
            self.current = None  # the error ended it: a Flush it had is answered, nothing more of it comes
            if not self.open and self.cancelling != cid:
                await self._answer("Flushed")
        elif isinstance(msg, p.ContextDone) and cid == self.current:
            self.current = None
            await self._answer("Flushed")
        elif isinstance(msg, p.ContextCancelled) and cid == self.cancelling:  # also when it finished before the Clear
            self.cancelling = None
            if cid == self.current:
                self.current = None
            for _ in range(self.clears):
                await self._answer("Cleared")
            self.clears = 0
        else:
            return
        self.open = False
        self.background(self._advance())  # not from inside the session's own send

    async def audio(self, packets: p.AudioPackets) -> None:
        for payload in packets.payloads:  # one context speaks at a time: its frames in order
            await self.ws.send_bytes(payload)

    async def _answer(self, kind: str) -> None:
        await self.send_json({"type": kind, "sequence_id": self.sequence})
        self.sequence += 1

    async def _warning(self, code: str, description: str) -> None:
        """Deepgram's form of an error: `code` in its upper-case style (native codes too: TEXT_TOO_LONG)."""
        log.info("deepgram socket warning %s: %s", code, description)
        await self.send_json({"type": "Warning", "code": str(code).upper(), "description": description})


def _parse(raw: str | bytes) -> dict[str, Any]:
    """ValueError with the reason when the message is not one of Speak, Flush, Clear, Close."""
    m = json_object(raw)
    if m.get("type") not in ("Speak", "Flush", "Clear", "Close"):
        raise ValueError("a message is one of type Speak, Flush, Clear or Close")
    if m["type"] == "Speak" and not isinstance(m.get("text"), str):
        raise ValueError("Speak needs a string text")
    return m


async def _admit(request: web.Request) -> str:
    """The key of a request: `?token=` (a voxgate token), `Authorization: Token|Bearer <key>`, or the browser's
    `Sec-WebSocket-Protocol: token, <key>`; DeepgramError (401, 429, 503) if refused."""
    gw = gateway_of(request)
    try:
        if request.query.get("token") is not None:
            key = await gw.auth.authenticate(None, request.query["token"])
        else:
            scheme, _, key = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() not in ("token", "bearer"):
                protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
                key = protocols[1] if len(protocols) == 2 and protocols[0].lower() == "token" else ""
            key = check_api_key(gw, key.strip() or None)
    except AuthError as e:
        gw.metrics.errors.labels(code=str(ErrorCode.UNAUTHORIZED)).inc()
        raise DeepgramError(401, "INVALID_AUTH", f"{e}; send Authorization: Token <api key>") from None
    refused = await gw.refusal(key)
    if refused is not None:
        raise DeepgramError(429 if refused.code == ErrorCode.RATE_LIMITED else 503, str(refused.code).upper(),
                            refused.message)
    return key


async def _settings(request: web.Request, key: str, stream: bool) -> tuple[str | None, OutputFormat]:
    """(voice, what the audio is) from the query; DeepgramError (400) when a parameter is not supported."""
    q = request.query
    encoding = q.get("encoding", "linear16" if stream else "mp3")
    encodings = STREAM_ENCODINGS if stream else tuple(ENCODINGS)
    if encoding not in encodings:
        raise DeepgramError(400, "INVALID_QUERY_PARAMETER", f"encoding {encoding!r} is not supported "
                            f"{'on the stream' if stream else 'here'}; use {', '.join(encodings)}")
    default_rate, rates, containers, default_container = ENCODINGS[encoding]
    rate = q.get("sample_rate", str(default_rate))
    if not (rate.isascii() and rate.isdigit()) or int(rate) not in rates:  # "²".isdigit(), int("²") fails
        raise DeepgramError(400, "INVALID_QUERY_PARAMETER", f"sample_rate {rate!r} is not supported for {encoding}; "
                            f"use {', '.join(map(str, rates))}")
    container = q.get("container", "none" if stream else default_container)
    if container not in containers or stream and container != "none":
        raise DeepgramError(400, "INVALID_QUERY_PARAMETER", f"container {container!r} is not supported for "
                            f"{encoding}{' on the stream' if stream else ''}; use "
                            f"{'none' if stream else ', '.join(containers)}")
    spec: dict[str, Any] = {"format": containers[container], "sample_rate": int(rate)}
    if spec["format"] == "mp3" and not av_available():
        raise DeepgramError(400, "UNSUPPORTED_ENCODING", "mp3 needs PyAV on the server (`pip install av`); ask for "
                            "linear16, mulaw, alaw or opus")
    if "bit_rate" in q:
        if not (q["bit_rate"].isascii() and q["bit_rate"].isdigit()):
            raise DeepgramError(400, "INVALID_QUERY_PARAMETER", f"bit_rate {q['bit_rate']!r} is not a number")
        spec["bitrate"] = int(q["bit_rate"])
    try:
        output = OutputFormat.from_dict(spec)
    except ValueError as e:
        raise DeepgramError(400, "INVALID_QUERY_PARAMETER", str(e)) from None
    model = q.get("model", DEFAULT_MODEL)
    if model.startswith("aura"):  # Deepgram's own voices: the default voice, as a matter of course
        return None, output
    gw = gateway_of(request)
    try:
        return await gw.voices.voice_or_default(model, gw.auth.caller(key), "deepgram"), output
    except VoiceRefused as e:
        if e.status == 404:
            raise DeepgramError(400, "INVALID_QUERY_PARAMETER", f"No such model: {model!r}") from None
        raise DeepgramError(e.status, e.code.upper(), e.message) from None


async def speak(request: web.Request) -> web.StreamResponse:
    """GET /v1/speak: the streaming WebSocket."""
    try:
        key = await _admit(request)
        voice, output = await _settings(request, key, stream=True)
    except DeepgramError as e:
        return e.response()
    config = gateway_of(request).config
    ws = await open_socket(request, config.limits.ws_max_msg_size, config.socket_send_buffer, protocols=("token",))
    await DeepgramBridge(request, ws, key, voice, {"format": output.format, "sample_rate": output.sample_rate}).serve()
    return ws


async def speak_rest(request: web.Request) -> web.StreamResponse:
    """POST /v1/speak {"text"}: the audio streamed in the response body as it is made."""
    gw = gateway_of(request)
    try:
        key = await _admit(request)
        voice, output = await _settings(request, key, stream=False)
        try:
            text = (await json_body(request)).get("text")
        except ValueError as e:
            raise DeepgramError(400, "INVALID_BODY", str(e)) from None
        if not isinstance(text, str) or not text.strip():
            raise DeepgramError(400, "INVALID_BODY", "the body must be {\"text\": \"<what to say>\"}")
        if len(text) > gw.config.limits.max_buffered_chars:
            raise DeepgramError(400, "INVALID_BODY", f"text has {len(text)} characters; the limit is "
                                f"{gw.config.limits.max_buffered_chars}")
    except DeepgramError as e:
        return e.response()
    async with OneTurn.open(request, key) as turn:
        try:
            first = await turn.speak(text, voice=voice, sample_rate=output.sample_rate)
        except NativeError as e:
            return DeepgramError(http_status(e.code), e.code.upper(), e.message).response()
        return await turn.respond(request, first, Transcoder(output), {
            "Content-Type": CONTENT_TYPES[output.format], "dg-request-id": str(uuid.uuid4()),
            "dg-model-name": request.query.get("model", DEFAULT_MODEL), "dg-char-count": str(len(text))})


def register(app: web.Application) -> None:
    app.router.add_get("/v1/speak", speak)
    app.router.add_post("/v1/speak", speak_rest)
