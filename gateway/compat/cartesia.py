"""Cartesia-compatible streaming WebSocket `GET /tts/websocket`: Pipecat's Cartesia service (tested) and other
Cartesia clients that take a base URL (LiveKit's plugin authenticates with `?api_key=`) work with only a URL change.

Auth: `X-API-Key` or `Authorization: Bearer` headers, `?api_key=`, or `?access_token=` (a voxgate token from
`POST /v1/tokens`, for browsers); `Cartesia-Version` is accepted and ignored. A refused handshake gets HTTP 401/429/503.
`POST /tts/bytes` (one transcript, its audio streamed in the body: raw as below, wav or mp3) and `POST /tts/sse` (the
socket's chunk, timestamps and done messages as server-sent events) are the same over HTTP (compat.oneshot), for
Pipecat's CartesiaHttpTTSService, Cartesia's SDK and plain scripts.

Client -> native:
- a generation request {context_id, transcript, voice (an id, {id} or {mode: "id", id}: `voice_id`), output_format
  {container: "raw", encoding: pcm_s16le | pcm_f32le | pcm_mulaw | pcm_alaw, sample_rate}, continue, flush,
  max_buffer_delay_ms, add_timestamps, model_id, language, ...} -> text.append on that context, opened with its voice
  and format (a session.update first when they differ from the previous context's: contexts already speaking keep
  theirs);
- `flush` -> text.flush, answered by flush_done with flush_id 1, 2, ... right after that flush's last audio (chunks
  carry the flush_id their audio belongs to; audio after the last flush requested carries none);
  `max_buffer_delay_ms: 0` (the client buffers: each input is a whole unit) -> text.flush after every input;
- `continue` false or missing (no more input) -> context.end;
- {context_id, cancel: true} -> context.cancel; nothing more is sent for that context.
Native -> client: audio frames -> {type: "chunk", data: base64, done: false, status_code: 206, step_time (ms since
the context's previous chunk), context_id}; context.done -> {type: "done", done: true, status_code: 200}; errors ->
{type: "error", context_id, status_code, title, message, error_code, done} (done: false when only that message was
refused and the context goes on). `add_timestamps` -> {type: "timestamps", word_timestamps {words, start, end}} once
a segment's audio span is known: VoxCPM gives no alignment, so each segment's span is shared among its words by
length (an estimate, close enough to keep an agent's transcript in step with playback). Model, language and speed
have no VoxCPM equivalent and are ignored; a voice id that is not a stored voice speaks with the default voice."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from gateway import protocol as p
from gateway.audio import PCM_RATES, OutputFormat, av_available
from gateway.auth import AuthError
from gateway.compat import (
    SocketBridge,
    Transcoder,
    check_api_key,
    gateway_of,
    http_status,
    json_body,
    json_object,
    share_span,
)
from gateway.compat.oneshot import NativeError, OneTurn, Spoken
from gateway.protocol import MAX_INSTRUCTION_CHARS, ErrorCode, Limits
from gateway.sockets import open_socket
from gateway.voices import VoiceRefused

if TYPE_CHECKING:
    from gateway.server import Gateway

log = logging.getLogger("voxgate.compat.cartesia")

IDLE_TIMEOUT_S = 300.0  # Cartesia closes an idle socket after 5 minutes
ENCODINGS = {"pcm_s16le": "pcm_s16le", "pcm_f32le": "pcm_s16le", "pcm_mulaw": "mulaw", "pcm_alaw": "alaw"}
# a word for the timestamps: one CJK character (Cartesia reports those one by one), or a run of anything but spaces
_CJK = "\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af"
_WORD = re.compile(f"[{_CJK}]|[^\\s{_CJK}]+")


class CartesiaError(Exception):
    def __init__(self, message: str, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.message, self.status, self.code = message, status, code

    @classmethod
    def of(cls, e: NativeError) -> CartesiaError:
        """A native session's refusal (unknown voice, bad setting, ...) in Cartesia's form, with its HTTP status."""
        return cls(e.message, http_status(e.code), e.code)

    def response(self) -> web.Response:
        """The error as an HTTP answer (a refused handshake, or /tts/bytes before its first byte)."""
        return web.json_response({"error": self.code, "message": self.message, "status_code": self.status},
                                 status=self.status)


@dataclass
class _Context:
    encoding: str  # the client's: pcm_f32le is made here from the session's s16
    timestamps: bool
    index: int | None = None  # the native context's frame index, once context.started arrived
    flushes: int = 0  # flush requests so far
    flushed: int = 0  # flush_done sent so far: the audio being sent belongs to flush_id flushed + 1
    ended: bool = False  # `continue: false` arrived
    segment: tuple[float, str] | None = None  # (pts_ms, text) of the segment being sent, for timestamps
    last_chunk_at: float = field(default_factory=time.monotonic)


class CartesiaBridge(SocketBridge):
    """One Cartesia socket: translates its messages for the session, and is the session's EventSink."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, key: str):
        super().__init__(request, ws)
        self.key = key
        self.contexts: dict[str, _Context] = {}
        self.settings: tuple[str | None, str] = (None, "")  # (voice, output as JSON) of the session now

    async def on_open(self) -> None:
        await self.start_session(dataclasses.replace(self.gw.config.limits, idle_timeout_s=IDLE_TIMEOUT_S))

    # ------------------------------------------------------------------------------------------------ client -> us

    async def handle(self, raw: str | bytes) -> None:
        try:
            m = json_object(raw)
        except ValueError as e:
            await self._error(None, 400, "invalid_request", str(e))
            return
        cid = m["context_id"] if isinstance(m.get("context_id"), str) else None  # named in an error about it
        try:
            _check(m, self.gw.config.limits)
            if m.get("cancel") is True:
                if cid in self.contexts:
                    await self.to_session("context.cancel", context_id=cid)
                return
            await self._generate(cid, m)
        except CartesiaError as e:  # a refused message: a context already speaking goes on
            await self._error(cid, e.status, e.code, e.message, done=cid not in self.contexts)

    async def _generate(self, cid: str, m: dict[str, Any]) -> None:
        ctx = self.contexts.get(cid)
        if ctx is None:
            voice = await _voice(m.get("voice"), self.gw, self.key)
            output, encoding = _output_format(m.get("output_format"))
            style = _style(m)
            settings = (voice, json.dumps(output, sort_keys=True), style)
            if settings != self.settings:  # contexts already speaking keep theirs
                await self.to_session("session.update", voice=voice, output=output,
                                      generation={"instruction": style})
                self.settings = settings
            ctx = self.contexts[cid] = _Context(encoding, m.get("add_timestamps") is True)
        elif ctx.ended:
            raise CartesiaError(f"context {cid!r} already had its last input (continue: false); use a new "
                                "context_id")
        transcript = m["transcript"]
        await self.to_session("text.append", context_id=cid, text=transcript)
        if m.get("flush") is True:
            ctx.flushes += 1
            await self.to_session("text.flush", context_id=cid, flush_id=str(ctx.flushes))
        elif m.get("max_buffer_delay_ms") == 0 and transcript.strip():
            await self.to_session("text.flush", context_id=cid)  # each input is a whole unit: speak it now
        if m.get("continue") is not True:
            ctx.ended = True
            await self.to_session("context.end", context_id=cid)

    # ------------------------------------------------------------------------------------------------ us -> client
    # (the session's EventSink)

    async def message(self, msg: p.ServerMessage) -> None:
        cid: str | None = getattr(msg, "context_id", None)
        ctx = self.contexts.get(cid) if cid is not None else None
        if isinstance(msg, p.Error):
            await self._native_error(msg, ctx)
        elif ctx is None or cid is None:
            return  # session replies, and what comes after a cancel or an error
        elif isinstance(msg, p.ContextStarted):
            ctx.index = msg.index
        elif isinstance(msg, p.SegmentStarted):
            await self._timestamps(cid, ctx, msg.pts_ms)
            ctx.segment = (msg.pts_ms, msg.text)
        elif isinstance(msg, p.TextFlushed) and msg.flush_id is not None:
            ctx.flushed = int(msg.flush_id)
            await self.send_json({"type": "flush_done", "context_id": cid, "flush_id": ctx.flushed, "flush_done": True,
                                  "done": False, "status_code": 206})
        elif isinstance(msg, p.ContextDone):
            await self._timestamps(cid, ctx, msg.audio_ms)
            self._forget(cid)
            await self.send_json({"type": "done", "context_id": cid, "done": True, "status_code": 200})
        elif isinstance(msg, p.ContextCancelled):
            self._forget(cid)

    async def audio(self, packets: p.AudioPackets) -> None:
        cid = packets.context_id
        ctx = self.contexts.get(cid)
        if ctx is None or ctx.index != packets.index:  # a context that ended here (done, cancelled, refused)
            return
        for payload in packets.payloads:
            if ctx.encoding == "pcm_f32le":
                payload = _f32(payload)
            now = time.monotonic()
            message = {"type": "chunk", "context_id": cid, "data": base64.b64encode(payload).decode(), "done": False,
                       "status_code": 206, "step_time": round((now - ctx.last_chunk_at) * 1000.0, 1)}
            if ctx.flushed < ctx.flushes:  # audio after the last flush requested belongs to none
                message["flush_id"] = ctx.flushed + 1
            ctx.last_chunk_at = now
            await self.send_json(message)

    async def _native_error(self, error: p.Error, ctx: _Context | None) -> None:
        """A refused message leaves its context running (done: false); an error that ended the context, or the
        session, is its last word (done: true)."""
        assert self.session is not None
        cid = error.context_id
        over = error.fatal or ctx is not None and cid is not None and not self.session.is_live(cid)
        await self._error(cid, http_status(error.code), error.code, error.message, done=over)
        if error.fatal:
            self.closing = True  # the session closes the socket next
        elif over and cid is not None:
            self._forget(cid)

    async def _timestamps(self, cid: str, ctx: _Context, end_ms: float) -> None:
        if ctx.timestamps and ctx.segment is not None:
            message = _word_timestamps(cid, *ctx.segment, end_ms)
            if message is not None:
                await self.send_json(message)

    async def _error(self, cid: str | None, status: int, code: str, message: str, done: bool = True) -> None:
        log.info("cartesia socket error %s (context %s): %s", code, cid, message)
        await self.send_json({"type": "error", "context_id": cid, "status_code": status, "done": done,
                              "title": code.replace("_", " "), "error_code": code, "message": message})

    def _forget(self, cid: str) -> None:
        self.contexts.pop(cid, None)


def _check(m: dict[str, Any], limits: Limits) -> None:
    """CartesiaError naming what is wrong with a generation or cancel request."""
    cid = m.get("context_id")
    if not isinstance(cid, str) or not 0 < len(cid) <= limits.max_id_chars:
        raise CartesiaError(f"context_id is required: a string of 1 to {limits.max_id_chars} characters")
    if m.get("cancel") is True:
        return
    if not isinstance(m.get("transcript"), str):
        raise CartesiaError("transcript is required (a string)")
    for name in ("continue", "flush", "add_timestamps"):
        if m.get(name) is not None and not isinstance(m[name], bool):
            raise CartesiaError(f"{name} must be true or false")
    delay = m.get("max_buffer_delay_ms")
    if delay is not None and (type(delay) is not int or not 0 <= delay <= 5000):
        raise CartesiaError("max_buffer_delay_ms must be an integer from 0 to 5000")


def voice_id(voice: Any) -> str | None:
    """The voice id of any form Cartesia's API versions document: a plain id string (SDK 4.x, `cartesia-version`
    2026-08-14), {"id"}, {"mode": "id", "id"}, or {"mode": "embedding", "embedding": [...]} (earlier versions), which
    names no voice here: None. Other keys (`__experimental_controls`) are ignored. CartesiaError otherwise."""
    if isinstance(voice, str) and voice:
        return voice
    if isinstance(voice, dict):
        mode = voice.get("mode", "id")
        if mode == "id" and isinstance(voice.get("id"), str) and voice["id"]:
            return voice["id"]
        embedding = voice.get("embedding")
        if mode == "embedding" and isinstance(embedding, list) and embedding and all(
                type(v) in (int, float) for v in embedding):
            return None
    raise CartesiaError("voice must be a voice id: \"<id>\", {\"id\": \"<id>\"} or {\"mode\": \"id\", \"id\": "
                        "\"<id>\"} (or {\"mode\": \"embedding\", \"embedding\": [numbers]})")


def _style(m: dict[str, Any]) -> str | None:
    """`generation_config.emotion` ("excited", or a list of them) -> the native style instruction ("(excited)text");
    Cartesia's other generation settings (speed, volume) have no VoxCPM equivalent."""
    config = m.get("generation_config")
    emotion = config.get("emotion") if isinstance(config, dict) else None
    if emotion is None:
        return None
    emotions = [emotion] if isinstance(emotion, str) else emotion
    if not isinstance(emotions, list) or not all(isinstance(e, str) and e.strip() for e in emotions):
        raise CartesiaError("generation_config.emotion must be a string or a list of strings")
    style = ", ".join(e.strip() for e in emotions)
    if len(style) > MAX_INSTRUCTION_CHARS:
        raise CartesiaError(f"generation_config.emotion is over {MAX_INSTRUCTION_CHARS} characters")
    return style


async def _voice(voice: Any, gw: Gateway, key: str | None) -> str | None:
    """A stored voice id this key may use, or None (the default voice) for any other id or an embedding; in strict
    mode an unknown id is Cartesia's 404."""
    vid = voice_id(voice)
    if vid is None:
        return None
    try:
        return await gw.voices.voice_or_default(vid, gw.auth.caller(key or ""), "cartesia")
    except VoiceRefused as e:
        raise CartesiaError("Voice not found" if e.status == 404 else e.message, e.status,
                            "not_found" if e.status == 404 else e.code) from None


def _output_format(fmt: Any) -> tuple[dict[str, Any], str]:
    """Cartesia's raw output_format -> (native session output, the client's encoding)."""
    if not isinstance(fmt, dict) or fmt.get("container") != "raw":
        raise CartesiaError("output_format must be {\"container\": \"raw\", \"encoding\": ..., \"sample_rate\": ...}")
    encoding, rate = fmt.get("encoding"), fmt.get("sample_rate")
    if encoding not in ENCODINGS:
        raise CartesiaError(f"output_format.encoding {encoding!r} is not one of {', '.join(ENCODINGS)}")
    native = ENCODINGS[encoding]
    rates = PCM_RATES if native == "pcm_s16le" else (8000,)
    if rate not in rates:
        raise CartesiaError(f"output_format.sample_rate {rate!r} is not one of {', '.join(map(str, rates))} for "
                            f"{encoding}")
    return {"format": native, "sample_rate": rate}, encoding


def _http_format(fmt: Any) -> tuple[OutputFormat, str, str]:
    """Cartesia's output_format for /tts/bytes -> (what the response carries, the client's encoding, content type):
    raw (as on the socket), wav (s16) or mp3 (`bit_rate`, default 128 kb/s)."""
    if not isinstance(fmt, dict) or fmt.get("container") not in ("raw", "wav", "mp3"):
        raise CartesiaError("output_format.container must be raw, wav or mp3")
    container, rate = fmt["container"], fmt.get("sample_rate")
    if container == "raw":
        output, encoding = _output_format(fmt)
        return OutputFormat.from_dict(output), encoding, "application/octet-stream"
    if container == "wav" and fmt.get("encoding") != "pcm_s16le":
        raise CartesiaError("output_format.encoding must be pcm_s16le in a wav container here")
    if container == "mp3" and not av_available():
        raise CartesiaError("mp3 output needs PyAV on the server (`pip install av`); ask for raw or wav")
    try:
        out = OutputFormat.from_dict({"format": container, "sample_rate": rate,
                                      "bitrate": fmt.get("bit_rate", 128000) if container == "mp3" else 32000})
    except ValueError as e:
        raise CartesiaError(f"output_format: {e}") from None
    return out, "pcm_s16le", "audio/wav" if container == "wav" else "audio/mpeg"


async def _authenticate(request: web.Request) -> str:
    """The key of a request: `?access_token=` (a voxgate token), `Authorization: Bearer`, `X-API-Key` or
    `?api_key=`; CartesiaError (401, 429, 503) if refused."""
    gw = gateway_of(request)
    try:
        token = request.query.get("access_token")
        if token is not None or request.headers.get("Authorization"):
            key = await gw.auth.authenticate(request.headers.get("Authorization"), token)
        else:
            key = check_api_key(gw, request.headers.get("X-API-Key") or request.query.get("api_key"))
    except AuthError as e:
        gw.metrics.errors.labels(code=str(ErrorCode.UNAUTHORIZED)).inc()
        raise CartesiaError(f"{e}; send X-API-Key", 401, "unauthorized") from None
    refused = await gw.refusal(key)
    if refused is not None:
        raise CartesiaError(refused.message, 429 if refused.code == ErrorCode.RATE_LIMITED else 503,
                            str(refused.code))
    return key


async def websocket(request: web.Request) -> web.StreamResponse:
    """GET /tts/websocket."""
    try:
        key = await _authenticate(request)
    except CartesiaError as e:
        return e.response()
    config = gateway_of(request).config
    ws = await open_socket(request, config.limits.ws_max_msg_size, config.socket_send_buffer)
    await CartesiaBridge(request, ws, key).serve()
    return ws


async def _http_request(request: web.Request) -> tuple[str, dict[str, Any], str, str | None]:
    """(key, body, transcript, voice) of a /tts/bytes or /tts/sse request; CartesiaError with its status."""
    gw = gateway_of(request)
    key = await _authenticate(request)
    try:
        body = await json_body(request)
    except ValueError as e:
        raise CartesiaError(str(e)) from None
    transcript = body.get("transcript")
    if not isinstance(transcript, str) or not transcript.strip():
        raise CartesiaError("transcript is required (a non-empty string)")
    if len(transcript) > gw.config.limits.max_buffered_chars:
        raise CartesiaError(f"transcript has {len(transcript)} characters; the limit is "
                            f"{gw.config.limits.max_buffered_chars}")
    return key, body, transcript, await _voice(body.get("voice"), gw, key)


@contextlib.asynccontextmanager
async def _spoken(request: web.Request, key: str, transcript: str, voice: str | None, out: OutputFormat,
                  style: str | None) -> AsyncIterator[tuple[OneTurn, Spoken]]:
    """The request's turn and its first audio, for the block; a refusal (unknown voice, ...) as CartesiaError."""
    async with OneTurn.open(request, key) as turn:
        try:
            first = await turn.speak(transcript, voice=voice, sample_rate=out.sample_rate,
                                     generation={"instruction": style})
        except NativeError as e:
            raise CartesiaError.of(e) from None
        yield turn, first


async def tts_bytes(request: web.Request) -> web.StreamResponse:
    """POST /tts/bytes: one transcript, its audio streamed in the response body as it is made."""
    try:
        key, body, transcript, voice = await _http_request(request)
        out, encoding, content_type = _http_format(body.get("output_format"))
        async with _spoken(request, key, transcript, voice, out, _style(body)) as (turn, first):
            return await turn.respond(request, first, Transcoder(out), {"Content-Type": content_type},
                                      frame=_f32 if encoding == "pcm_f32le" else None)
    except CartesiaError as e:
        return e.response()


async def tts_sse(request: web.Request) -> web.StreamResponse:
    """POST /tts/sse: one transcript (raw output formats), its chunks, timestamps and done as server-sent events."""
    try:
        key, body, transcript, voice = await _http_request(request)
        out, encoding, _ = _http_format(body.get("output_format"))
        if body["output_format"]["container"] != "raw":
            raise CartesiaError("output_format.container must be raw for server-sent events")
        timestamps = body.get("add_timestamps") is True
        cid = body["context_id"] if isinstance(body.get("context_id"), str) else str(uuid.uuid4())
        async with _spoken(request, key, transcript, voice, out, _style(body)) as (turn, first):
            return await _sse_response(request, turn, first, out, encoding, cid, timestamps)
    except CartesiaError as e:
        return e.response()


async def _sse_response(request: web.Request, turn: OneTurn, first: Spoken, out: OutputFormat,
                        encoding: str, cid: str, timestamps: bool) -> web.StreamResponse:
    """/tts/sse's body: each chunk, each segment's word timestamps once its span is known (the next starts), then
    done."""
    last = time.monotonic()

    def chunk(data: bytes) -> bytes:
        nonlocal last
        now = time.monotonic()
        step_ms, last = round((now - last) * 1000.0, 1), now
        payload = _f32(data) if encoding == "pcm_f32le" else data
        return _sse({"type": "chunk", "context_id": cid, "data": base64.b64encode(payload).decode(),
                     "done": False, "status_code": 206, "step_time": step_ms})

    def segment_done(k: int, end_ms: float) -> bytes:
        message = _word_timestamps(cid, *turn.segments[k], end_ms) if timestamps else None
        return _sse(message) if message is not None else b""

    def done(event: p.ContextDone) -> bytes:
        last_words = segment_done(len(turn.segments) - 1, event.audio_ms) if turn.segments else b""
        return last_words + _sse({"type": "done", "context_id": cid, "done": True, "status_code": 200})

    return await turn.respond(request, first, Transcoder(out), {"Content-Type": "text/event-stream"},
                              frame=chunk, segment_done=segment_done, trailer=done)


def _word_timestamps(cid: str, start_ms: float, text: str, end_ms: float) -> dict[str, Any] | None:
    """The timestamps message of a segment (its audio span shared among its words by length), None without words."""
    words = _WORD.findall(text)
    if not words:
        return None
    edges = share_span([len(w) + 1 for w in words], start_ms, end_ms)  # a space's worth of time between words
    return {"type": "timestamps", "context_id": cid, "done": False, "status_code": 206,
            "word_timestamps": {"words": words, "start": edges[:-1], "end": edges[1:]}}


def _sse(message: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(message, ensure_ascii=False)}\n\n".encode()


def _f32(s16: bytes) -> bytes:
    return (np.frombuffer(s16, dtype="<i2").astype("<f4") / 32768.0).tobytes()


def register(app: web.Application) -> None:
    app.router.add_get("/tts/websocket", websocket)
    app.router.add_post("/tts/bytes", tts_bytes)
    app.router.add_post("/tts/sse", tts_sse)
