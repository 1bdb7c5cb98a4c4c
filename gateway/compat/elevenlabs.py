"""ElevenLabs-compatible streaming WebSockets: `/v1/text-to-speech/{voice_id}/stream-input` (one utterance per
socket) and `/multi-stream-input` (contexts). Pipecat's and LiveKit's ElevenLabs plugins work with only a URL change.

Client -> native: the init message (`text: " "`, `voice_settings`, `generation_config.chunk_length_schedule`,
`xi_api_key`) sets up the session (schedule -> chunking.schedule); text -> text.append; `flush` -> text.flush;
stream-input's `text: ""` (end of input) -> context.end; multi-stream's `text: ""` is a keepalive -> ping;
`close_context` -> context.end when everything sent was flushed (Pipecat's end of turn: flush, then close), else
context.cancel (a barge-in: the unflushed rest is dropped, audio stops now); `close_socket` -> close.
Native -> client: audio frames -> {"audio": base64, "normalizedAlignment", "alignment", "contextId"} (the SDK's
AudioOutput / AudioOutputMulti): a segment's character alignment (estimated: VoxCPM gives none) rides on the
segment's last audio message, which is held back until the segment's end is known, and is null on the others; its
times count from that segment's start, or from the context's start with `?sync_alignment=true` (`socket_alignment`);
context.done / context.cancelled -> {"isFinal": true, "contextId"}; error -> {"message", "error", "code"} and a close
with that code (1008 for the client's mistakes and auth, 1011 for server faults). `apply_text_normalization` (the
query; HTTP: the body) -> generation.normalize; `pronunciation_dictionary_locators` (the init message; HTTP: the
body) -> generation.pronunciations. `voice_settings` (stability, similarity, style, speed) have no VoxCPM
equivalent and are accepted and ignored; a `voice_id` that is not a stored voice speaks with the default voice.

HTTP (below): `POST /v1/text-to-speech/{voice_id}[/stream][/with-timestamps]`, one request one text (compat.oneshot)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway import protocol as p
from gateway.audio import MP3_RATES, PCM_RATES, OutputFormat, av_available
from gateway.compat import (
    AuthError,
    SocketBridge,
    Transcoder,
    check_api_key,
    gateway_of,
    http_status,
    json_body,
    json_object,
)
from gateway.compat.alignment import (
    AlignedLines,
    AlignmentCarrier,
    Span,
    http_alignment,
    segment_spans,
    socket_alignment,
)
from gateway.compat.oneshot import NativeError, OneTurn
from gateway.protocol import ErrorCode
from gateway.sockets import open_socket
from gateway.text.normalize import MODES as NORMALIZE_MODES
from gateway.voices import VoiceRefused

if TYPE_CHECKING:
    from gateway.server import Gateway

log = logging.getLogger("voxgate.compat.elevenlabs")

DEFAULT_OUTPUT_FORMAT = "mp3_44100_128"  # ElevenLabs' default
DEFAULT_INACTIVITY_S = 20
MAX_INACTIVITY_S = 180
MAX_CONTEXTS = 5  # ElevenLabs' limit per multi-stream socket
SINGLE_CONTEXT = "0"  # the one context of a stream-input socket
DEFAULT_CONTEXT = "default"  # multi-stream messages without a context_id
POLICY_VIOLATION, INTERNAL_ERROR = 1008, 1011
# native error code -> ElevenLabs' error name; unlisted codes keep the native name
_ERROR_NAMES = {
    ErrorCode.UNAUTHORIZED: "invalid_api_key",
    ErrorCode.IDLE_TIMEOUT: "input_timeout_exceeded",
    ErrorCode.TOO_MANY_CONTEXTS: "max_active_conversations",
    ErrorCode.BAD_JSON: "invalid_message",
    ErrorCode.INVALID_VALUE: "invalid_request",
}
_SERVER_FAULTS = {ErrorCode.ENGINE_ERROR, ErrorCode.INTERNAL_ERROR, ErrorCode.OVERLOADED, ErrorCode.SERVER_SHUTDOWN}


class ElevenLabsError(Exception):
    """`code`: the socket's close code; `status`: the HTTP endpoints' status."""

    def __init__(self, error: str, message: str, code: int = POLICY_VIOLATION, status: int = 400):
        super().__init__(message)
        self.error, self.message, self.code, self.status = error, message, code, status

    def response(self) -> web.Response:
        """ElevenLabs' HTTP error: {"detail": {"status", "message"}}."""
        return web.json_response({"detail": {"status": self.error, "message": self.message}}, status=self.status)


@dataclass(frozen=True)
class WireFormat:
    """An ElevenLabs `output_format`: what the session sends, and the container wrapped around it (if any)."""

    native: dict[str, Any]  # session.start "output"
    container: OutputFormat | None  # mp3 / Ogg Opus: made from the session's PCM per context


def parse_output_format(name: str) -> WireFormat:
    """pcm_<rate>, ulaw_8000, alaw_8000, mp3_<rate>_<kbps>, opus_48000_<kbps>; ElevenLabsError otherwise."""
    m = re.fullmatch(r"(pcm|ulaw|alaw|mp3|opus)_(\d+)(?:_(\d+))?", name)
    kind, rate, kbps = (m.group(1), int(m.group(2)), int(m.group(3) or 0)) if m else ("", 0, 0)
    if kind == "pcm" and not kbps and rate in PCM_RATES:
        return WireFormat({"format": "pcm_s16le", "sample_rate": rate}, None)
    if kind in ("ulaw", "alaw") and not kbps and rate == 8000:
        return WireFormat({"format": "mulaw" if kind == "ulaw" else "alaw", "sample_rate": 8000}, None)
    if kind in ("mp3", "opus") and 8 <= kbps <= 320 and rate in (MP3_RATES if kind == "mp3" else (48000,)):
        if kind == "mp3" and not av_available():
            raise ElevenLabsError("invalid_output_format", "mp3 output needs PyAV on the server (`pip install av`); "
                                  "ask for pcm_<rate> or opus_48000_<kbps>")
        container = OutputFormat.from_dict({"format": "mp3" if kind == "mp3" else "ogg_opus", "sample_rate": rate,
                                            "bitrate": kbps * 1000})
        return WireFormat({"format": "pcm_s16le", "sample_rate": rate}, container)
    raise ElevenLabsError("invalid_output_format", f"output_format {name!r} is not supported; use pcm_<8000|16000|"
                          "22050|24000|44100|48000>, ulaw_8000, alaw_8000, mp3_<rate>_<kbps> or opus_48000_<kbps>")


def _inactivity(value: str | None) -> float:
    if value is None:
        return DEFAULT_INACTIVITY_S
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= MAX_INACTIVITY_S:  # "²".isdigit()
        raise ElevenLabsError("invalid_request", f"inactivity_timeout must be an integer from 1 to {MAX_INACTIVITY_S}")
    return float(value)


@dataclass
class _Context:
    index: int | None = None  # the native context's frame index, once context.started arrived
    opened: bool = False  # text.append sent (the native turn exists)
    unflushed: bool = False  # text arrived since the last flush
    transcoder: Transcoder | None = None
    segment: tuple[float, str] | None = None  # (pts_ms, text) of the segment being sent, for its alignment
    carrier: AlignmentCarrier = field(default_factory=AlignmentCarrier)


class Bridge(SocketBridge):
    """One ElevenLabs socket: translates its messages for the session, and is the session's EventSink."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, voice_id: str, multi: bool):
        super().__init__(request, ws)
        self.multi, self.voice_id = multi, voice_id
        self.wire = WireFormat({}, None)  # the query's output_format, once parsed
        self.normalize = "auto"  # the query's apply_text_normalization
        # alignment times from the context's start (`sync_alignment=true`, LiveKit's plugin) or from the start of the
        # audio each alignment covers (ElevenLabs' documented default, Pipecat's service): `socket_alignment`
        self.sync_alignment = request.query.get("sync_alignment", "").lower() == "true"
        self.inactivity_s = float(DEFAULT_INACTIVITY_S)  # the query's inactivity_timeout, once parsed
        self.contexts: dict[str, _Context] = {}

    # ------------------------------------------------------------------------------------------------ client -> us

    async def handle(self, raw: str | bytes) -> None:
        try:
            message = self._parse(raw)
            if self.key is None:
                self.key = await self._authenticate(message)
            if self.session is None:
                await self._start(message)
            await self._dispatch(message)
        except ElevenLabsError as e:
            await self.fail(e)

    def _parse(self, raw: str | bytes) -> dict[str, Any]:
        try:
            message = json_object(raw)
        except ValueError as e:
            raise ElevenLabsError("invalid_message", str(e)) from None
        for name, types in (("text", str), ("context_id", str), ("flush", bool), ("close_context", bool),
                            ("close_socket", bool), ("try_trigger_generation", bool), ("voice_settings", dict),
                            ("generation_config", dict), ("xi_api_key", str),
                            ("pronunciation_dictionary_locators", list)):
            if message.get(name) is not None and not isinstance(message[name], types):
                raise ElevenLabsError("invalid_message", f"field '{name}' must be a {types.__name__}")
        return message

    async def _authenticate(self, message: dict[str, Any]) -> str:
        gw = self.gw
        try:
            key = check_api_key(gw, message.get("xi_api_key"))
        except AuthError as e:
            gw.metrics.errors.labels(code=str(ErrorCode.UNAUTHORIZED)).inc()
            raise ElevenLabsError("invalid_api_key", f"Invalid API key: {e}; send the xi-api-key header or "
                                  "xi_api_key in the first message") from None
        refused = await gw.refusal(key, pending=self.pending)
        if refused is not None:
            raise ElevenLabsError("max_concurrency_exceeded", refused.message, INTERNAL_ERROR if gw.draining else
                                  POLICY_VIOLATION)
        return key

    def first_message_within(self) -> float | None:
        """As ElevenLabs: a socket whose key is known waits inactivity_timeout for its first message."""
        within = super().first_message_within()
        return within if within is None or self.key is None else self.inactivity_s

    async def first_message_late(self) -> None:
        await self.fail(ElevenLabsError("input_timeout_exceeded", f"no message for {self.inactivity_s:g} s"
                                        if self.key is not None else "no first message with xi_api_key within "
                                        f"{self.gw.config.handshake_timeout_s:g} s"))

    async def _start(self, first: dict[str, Any]) -> None:
        chunking = _chunking(first.get("generation_config"))
        limits = dataclasses.replace(self.gw.config.limits, idle_timeout_s=self.inactivity_s,
                                     max_contexts=MAX_CONTEXTS if self.multi else 1)
        assert self.key is not None
        voice = await _voice(self.gw, self.voice_id, self.key)
        await self.start_session(limits, voice=voice, output=self.wire.native, chunking=chunking,
                                 generation={"normalize": self.normalize,
                                             **_pronunciations(first.get("pronunciation_dictionary_locators"))})

    async def _dispatch(self, m: dict[str, Any]) -> None:
        if m.get("close_socket"):
            await self.close(1000, "close_socket")
            return
        cid = m.get("context_id") or (DEFAULT_CONTEXT if self.multi else SINGLE_CONTEXT)
        ctx = self.contexts.get(cid)
        if m.get("close_context"):
            await self._close_context(cid, ctx)
            return
        text = m.get("text")
        if text == "":
            if not self.multi:  # end of input: speak the rest, then isFinal and close
                await self._end(cid, ctx)
            else:
                await self.to_session("ping")
        elif text is not None:
            if ctx is None or not ctx.opened:
                if ctx is None and m.get("generation_config") is not None and self.multi:
                    await self.to_session("session.update", chunking=_chunking(m["generation_config"]))
                ctx = self.contexts.setdefault(cid, _Context())
                if not text.strip():  # the init message: the context opens with its first words
                    return
                ctx.opened = True
            ctx.unflushed = True
            await self.to_session("text.append", context_id=cid, text=text)
        if m.get("flush") and ctx is not None and ctx.opened:
            ctx.unflushed = False
            await self.to_session("text.flush", context_id=cid)

    async def _end(self, cid: str, ctx: _Context | None) -> None:
        if ctx is not None and ctx.opened:
            await self.to_session("context.end", context_id=cid)
        else:  # nothing was said: the utterance is over at once
            await self._final(cid)
            self.background(self.close(1000, "done"))

    async def _close_context(self, cid: str, ctx: _Context | None) -> None:
        if ctx is None or not ctx.opened:
            self.contexts.pop(cid, None)
            await self._final(cid)
        elif ctx.unflushed:
            await self.to_session("context.cancel", context_id=cid)
        else:
            await self.to_session("context.end", context_id=cid)

    # ------------------------------------------------------------------------------------------------ us -> client
    # (the session's EventSink)

    async def message(self, msg: p.ServerMessage) -> None:
        if isinstance(msg, p.ContextStarted):
            ctx = self.contexts.setdefault(msg.context_id, _Context(opened=True))
            ctx.index = msg.index
            ctx.transcoder = Transcoder(self.wire.container) if self.wire.container is not None else None
        elif isinstance(msg, p.SegmentStarted) and msg.context_id in self.contexts:
            ctx = self.contexts[msg.context_id]
            await self._segment_end(msg.context_id, ctx, msg.pts_ms)
            ctx.segment = (msg.pts_ms, msg.text)
        elif isinstance(msg, p.ContextDone | p.ContextCancelled):
            cid = msg.context_id
            ctx = self.contexts.pop(cid, None)
            if ctx is not None and ctx.index is not None and isinstance(msg, p.ContextDone):
                if ctx.transcoder is not None:
                    await self._send_audio(cid, ctx.carrier.audio(ctx.transcoder.finish(), msg.audio_ms))
                await self._segment_end(cid, ctx, msg.audio_ms)
                await self._send_audio(cid, ctx.carrier.finish())
            await self._final(cid)
            if not self.multi:
                self.background(self.close(1000, "done"))
        elif isinstance(msg, p.Error):
            await self.fail(ElevenLabsError(_ERROR_NAMES.get(msg.code, msg.code), msg.message,
                                            INTERNAL_ERROR if msg.code in _SERVER_FAULTS else POLICY_VIOLATION))

    async def audio(self, packets: p.AudioPackets) -> None:
        cid = packets.context_id
        ctx = self.contexts.get(cid)
        if ctx is None or ctx.index != packets.index:  # a context that ended here (done, cancelled, refused)
            return
        for frame in packets.frames():
            end_ms = frame.pts_ms + len(frame.payload) * 1000.0 / self._bytes_per_s
            await self._send_audio(cid, ctx.carrier.audio(ctx.transcoder.write(frame.payload)
                                                          if ctx.transcoder is not None else frame.payload, end_ms))

    async def fail(self, e: ElevenLabsError) -> None:
        """ElevenLabs reports an error as a JSON message, then closes the socket with the code."""
        if self.closing:
            return
        self.closing = True  # no more client messages are read
        log.info("elevenlabs socket error %s: %s", e.error, e.message)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.send_str(json.dumps({"message": e.message, "error": e.error,
                                                                "code": e.code})), 1.0)
        self.background(self.close(e.code, e.message))

    @property
    def _bytes_per_s(self) -> int:
        """Of the session's raw output (s16 PCM, or G.711 at one byte a sample)."""
        native = self.wire.native
        return native["sample_rate"] * (2 if native["format"] == "pcm_s16le" else 1)

    async def _segment_end(self, cid: str, ctx: _Context, end_ms: float) -> None:
        if ctx.segment is not None:
            start_ms, text = ctx.segment
            ctx.segment = None
            await self._send_audio(cid, ctx.carrier.segment_end((start_ms, text, end_ms)))

    async def _send_audio(self, cid: str, messages: list[tuple[bytes, list[Span]]]) -> None:
        """Audio messages in the SDK's AudioOutput(Multi) form, each with the alignment of the segments it ends."""
        for payload, spans in messages:
            aligned = socket_alignment(spans, self.sync_alignment) if spans else None
            message = {"audio": base64.b64encode(payload).decode(), "normalizedAlignment": aligned,
                       "alignment": aligned}
            if self.multi:
                message["contextId"] = cid
            await self.send_json(message)

    async def _final(self, cid: str) -> None:
        await self.send_json({"isFinal": True, "contextId": cid} if self.multi else {"isFinal": True})



def _chunking(generation_config: dict[str, Any] | None) -> dict[str, Any]:
    """ElevenLabs' chunk_length_schedule (characters before each of the first segments) -> native chunking."""
    schedule = (generation_config or {}).get("chunk_length_schedule")
    if schedule is None:
        return {}
    if not isinstance(schedule, list) or not schedule or not all(type(v) is int and 1 <= v <= 8000 for v in schedule):
        raise ElevenLabsError("invalid_request", "generation_config.chunk_length_schedule must be a non-empty list "
                              "of positive integers")
    return {"schedule": schedule, "max_chars": max(300, *schedule)}


# ---------------------------------------------------------------------------------------------------- handlers


async def stream_input(request: web.Request) -> web.StreamResponse:
    """/v1/text-to-speech/{voice_id}/stream-input: one utterance, ended by `text: ""`."""
    return await _serve(request, multi=False)


async def multi_stream_input(request: web.Request) -> web.StreamResponse:
    """/v1/text-to-speech/{voice_id}/multi-stream-input: up to 5 contexts over one socket."""
    return await _serve(request, multi=True)


async def _serve(request: web.Request, multi: bool) -> web.StreamResponse:
    gw = gateway_of(request)
    ws = await open_socket(request, gw.config.limits.ws_max_msg_size, gw.config.socket_send_buffer)
    bridge = Bridge(request, ws, request.match_info["voice_id"], multi)
    try:
        bridge.wire = parse_output_format(request.query.get("output_format", DEFAULT_OUTPUT_FORMAT))
        bridge.inactivity_s = _inactivity(request.query.get("inactivity_timeout"))
        bridge.normalize = _text_normalization(request.query.get("apply_text_normalization"))
        header_key = request.headers.get("xi-api-key")
        if header_key is not None or not gw.auth.enabled:  # else: xi_api_key in the first message
            bridge.key = await bridge._authenticate({"xi_api_key": header_key})
        elif (refused := gw.full()) is not None:  # a full server takes no more sockets, keyed or not
            raise ElevenLabsError("max_concurrency_exceeded", refused.message, INTERNAL_ERROR if gw.draining else
                                  POLICY_VIOLATION)
    except ElevenLabsError as e:
        await bridge.fail(e)
        await bridge.release()
        return ws
    await bridge.serve()
    return ws


# ---------------------------------------------------------------------------------------------------- HTTP
# POST /v1/text-to-speech/{voice_id}[/stream][/with-timestamps] on compat.oneshot; the audio is streamed as it is made
# on every variant (a client of the non-stream ones reads it whole all the same), but the non-stream with-timestamps
# answer is one JSON object.

CONTENT_TYPES = {"mp3": "audio/mpeg", "ogg_opus": "audio/ogg", "pcm_s16le": "audio/pcm", "mulaw": "audio/basic",
                 "alaw": "application/octet-stream"}


async def text_to_speech(request: web.Request) -> web.StreamResponse:
    """POST /v1/text-to-speech/{voice_id}, `.../stream`, `.../with-timestamps`, `.../stream/with-timestamps`."""
    try:
        key, text, voice, generation, output = await _speech_request(request)
    except ElevenLabsError as e:
        return e.response()
    async with OneTurn.open(request, key) as turn:
        try:
            first = await turn.speak(text, voice=voice, sample_rate=output.sample_rate, generation=generation)
            if not request.path.endswith("/with-timestamps"):
                return await turn.respond(request, first, Transcoder(output),
                                          {"Content-Type": CONTENT_TYPES[output.format]})
            if "/stream" not in request.path:  # one JSON object: the whole audio and its alignment
                audio, done = await turn.collect(first, Transcoder(output))
                alignment = http_alignment(segment_spans(turn.segments, done.audio_ms))
                return web.json_response({"audio_base64": base64.b64encode(audio).decode(), "alignment": alignment,
                                          "normalized_alignment": alignment})
        except NativeError as e:
            return ElevenLabsError(_ERROR_NAMES.get(e.code, e.code), e.message, status=http_status(e.code)).response()

        # newline-delimited JSON audio lines, each segment's alignment on its last one
        lines = AlignedLines(turn.segments, output)
        return await turn.respond(request, first, Transcoder(output), {"Content-Type": "application/x-ndjson"},
                                  frame=lines.audio, segment_done=lines.segment_done, trailer=lines.trailer)


async def _speech_request(request: web.Request) -> tuple[str, str, str | None, dict[str, Any], OutputFormat]:
    """(key, text, voice, generation settings, output) of a request; ElevenLabsError with its HTTP status."""
    gw = gateway_of(request)
    try:
        key = check_api_key(gw, request.headers.get("xi-api-key"))
    except AuthError as e:
        gw.metrics.errors.labels(code=str(ErrorCode.UNAUTHORIZED)).inc()
        raise ElevenLabsError("invalid_api_key", f"Invalid API key: {e}; send the xi-api-key header",
                              status=401) from None
    refused = await gw.refusal(key)
    if refused is not None:
        raise ElevenLabsError("max_concurrency_exceeded", refused.message, status=503 if gw.draining else 429)
    wire = parse_output_format(request.query.get("output_format", DEFAULT_OUTPUT_FORMAT))
    try:
        body = await json_body(request)
    except ValueError as e:
        raise ElevenLabsError("invalid_request", str(e), status=422) from None
    text, seed = body.get("text"), body.get("seed")
    if not isinstance(text, str) or not text.strip():
        raise ElevenLabsError("invalid_request", "text is required: a non-empty string", status=422)
    if len(text) > gw.config.limits.max_buffered_chars:
        raise ElevenLabsError("text_too_long", f"text has {len(text)} characters; the limit is "
                              f"{gw.config.limits.max_buffered_chars}", status=400)
    if seed is not None and (type(seed) is not int or not 0 <= seed <= 4294967295):
        raise ElevenLabsError("invalid_request", "seed must be an integer from 0 to 4294967295", status=422)
    generation = {"seed": seed, "normalize": _text_normalization(body.get("apply_text_normalization"), status=422),
                  **_pronunciations(body.get("pronunciation_dictionary_locators"), status=422)}
    voice = await _voice(gw, request.match_info["voice_id"], key)
    return key, text, voice, generation, wire.container or OutputFormat.from_dict(wire.native)


def _pronunciations(locators: Any, status: int = 400) -> dict[str, Any]:
    """`pronunciation_dictionary_locators` ([{pronunciation_dictionary_id, version_id}], at most 3 as on ElevenLabs)
    -> the native `generation.pronunciations` (ids of `POST /v1/pronunciations`; a dictionary has one version)."""
    if locators is None:
        return {}
    if not isinstance(locators, list) or len(locators) > 3 or not all(
            isinstance(loc, dict) and isinstance(loc.get("pronunciation_dictionary_id"), str) for loc in locators):
        raise ElevenLabsError("invalid_request", "pronunciation_dictionary_locators must be a list of at most 3 "
                              "{pronunciation_dictionary_id, version_id} objects", status=status)
    return {"pronunciations": [loc["pronunciation_dictionary_id"] for loc in locators]}


def _text_normalization(value: Any, status: int = 400) -> str:
    """`apply_text_normalization` (auto / on / off; absent: auto) -> the native `generation.normalize`."""
    if value is None:
        return "auto"
    if value not in NORMALIZE_MODES:
        raise ElevenLabsError("invalid_request", f"apply_text_normalization must be one of "
                              f"{', '.join(NORMALIZE_MODES)}", status=status)
    return value


async def _voice(gw: Gateway, voice_id: str, key: str) -> str | None:
    """A stored voice this key may use, or None (the default voice) for another id; in strict mode an unknown id is
    ElevenLabs' voice_not_found (HTTP 404; on a socket, a policy-violation close)."""
    try:
        return await gw.voices.voice_or_default(voice_id, gw.auth.caller(key), "elevenlabs")
    except VoiceRefused as e:
        if e.status == 404:
            raise ElevenLabsError("voice_not_found", f"A voice with the voice_id {voice_id!r} was not found.",
                                  status=404) from None
        raise ElevenLabsError(e.code, e.message, INTERNAL_ERROR, status=e.status) from None


def register(app: web.Application) -> None:
    app.router.add_get("/v1/text-to-speech/{voice_id}/stream-input", stream_input)
    app.router.add_get("/v1/text-to-speech/{voice_id}/multi-stream-input", multi_stream_input)
    for variant in ("", "/stream", "/with-timestamps", "/stream/with-timestamps"):
        app.router.add_post(f"/v1/text-to-speech/{{voice_id}}{variant}", text_to_speech)
