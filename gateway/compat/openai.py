"""OpenAI-compatible speech API: `POST /v1/audio/speech` (audio streamed as it is made, or SSE), `GET /v1/models`,
`GET /v1/audio/voices`, each answer with an `x-request-id` header. Errors in OpenAI's form: HTTP status +
{"error": {"message", "type", "param", "code"}}.

One request is one native session with one turn (compat.oneshot): session.start asking for PCM at the container's
rate, the input, context.end. The session's PCM frames are wrapped into the requested container (gateway.audio's
Encoder)."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.audio import OutputFormat, av_available
from gateway.compat import AuthError, Transcoder, gateway_of, json_body
from gateway.compat.oneshot import NativeError, OneTurn
from gateway.protocol import MAX_INSTRUCTION_CHARS, ContextDone, ErrorCode
from gateway.voices import VoiceRefused

if TYPE_CHECKING:
    from gateway.server import Gateway

BUILTIN_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse",
                  "marin", "cedar")  # all speak with the model's default voice
MODEL_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")  # accepted (any model name is), listed for clients that check
MAX_INPUT_CHARS = 4096  # OpenAI's limit
# response_format -> (gateway.audio format, sample rate, content type); OpenAI's "opus" is Ogg Opus, "pcm" 24 kHz s16le
RESPONSE_FORMATS = {
    "mp3": ("mp3", 24000, "audio/mpeg"),
    "opus": ("ogg_opus", 48000, "audio/ogg"),
    "aac": ("aac", 24000, "audio/aac"),
    "flac": ("flac", 24000, "audio/flac"),
    "wav": ("wav", 24000, "audio/wav"),
    "pcm": ("pcm_s16le", 24000, "audio/pcm"),
}
# `generation` is voxgate's extension: the native session's generation settings (seed, cfg_value, ...)
_FIELDS = {"model", "input", "voice", "instructions", "response_format", "speed", "stream_format", "generation"}


class OpenAIError(Exception):
    """An error answered in OpenAI's JSON form."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status)


# native error codes that are not the client's fault -> (HTTP status, OpenAI error type); every other code is a 400
_SERVER_ERRORS = {
    ErrorCode.RATE_LIMITED: (429, "rate_limit_exceeded"),
    ErrorCode.OVERLOADED: (503, "server_error"),
    ErrorCode.SERVER_SHUTDOWN: (503, "server_error"),
    ErrorCode.ENGINE_ERROR: (500, "server_error"),
    ErrorCode.INTERNAL_ERROR: (500, "server_error"),
    ErrorCode.SLOW_CONSUMER: (500, "server_error"),
    ErrorCode.IDLE_TIMEOUT: (500, "server_error"),
}


def _from_native(e: NativeError, param: str) -> OpenAIError:
    status, kind = _SERVER_ERRORS.get(e.code, (400, "invalid_request_error"))  # type: ignore[call-overload]
    if e.code == ErrorCode.UNKNOWN_VOICE:
        param = "voice"
    return OpenAIError(status, e.message, type=kind, param=param if status == 400 else None, code=e.code)


@dataclass(frozen=True)
class SpeechRequest:
    model: str
    input: str
    voice: str | None  # a stored voice id, or None for the default voice
    response_format: str = "mp3"
    stream_format: str = "audio"
    generation: dict[str, Any] = dataclasses.field(default_factory=dict)  # checked by the session


def parse_speech_request(body: Any, stored_voices: set[str]) -> SpeechRequest:
    """Validate a /v1/audio/speech body the way OpenAI does; OpenAIError (400) names the bad parameter."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        # a key is echoed back: one that is not valid text (a lone surrogate) is echoed escaped
        name = unknown[0].encode("utf-8", "backslashreplace").decode("utf-8")
        raise OpenAIError(400, f"Unrecognized request argument supplied: {name}", param=name,
                          code="unknown_parameter")
    model, text, voice = (_required_str(body, name) for name in ("model", "input", "voice"))
    if not text.strip():
        raise OpenAIError(400, "input must contain text to speak", param="input", code="invalid_value")
    if len(text) > MAX_INPUT_CHARS:
        raise OpenAIError(400, f"input has {len(text)} characters; the maximum is {MAX_INPUT_CHARS}", param="input",
                          code="string_above_max_length")
    voice_id = _voice(voice, stored_voices)
    if body.get("instructions") is not None and not isinstance(body["instructions"], str):
        raise OpenAIError(400, "instructions must be a string", param="instructions", code="invalid_type")
    fmt = body.get("response_format", "mp3")
    if not isinstance(fmt, str) or fmt not in RESPONSE_FORMATS:
        raise OpenAIError(400, f"response_format {fmt!r} is not one of {', '.join(RESPONSE_FORMATS)}",
                          param="response_format", code="invalid_value")
    if fmt in ("mp3", "aac", "flac") and not av_available():
        raise OpenAIError(400, f"response_format {fmt!r} needs PyAV on the server (`pip install av`); use wav, pcm "
                          "or opus", param="response_format", code="unsupported_value")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not math.isfinite(speed) \
            or not 0.25 <= speed <= 4.0:
        raise OpenAIError(400, "speed must be a number from 0.25 to 4.0", param="speed", code="invalid_value")
    if speed != 1.0:  # time-stretching would cost quality and latency; say so instead of ignoring it
        raise OpenAIError(400, "voxgate speaks at the model's natural pace: speed must be 1.0", param="speed",
                          code="unsupported_value")
    stream_format = body.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        raise OpenAIError(400, "stream_format must be 'audio' or 'sse'", param="stream_format", code="invalid_value")
    generation = body.get("generation", {})
    if not isinstance(generation, dict):
        raise OpenAIError(400, "generation must be an object", param="generation", code="invalid_type")
    instructions = body.get("instructions")
    if instructions and instructions.strip():  # the native style instruction: "(instructions)input"
        if len(instructions) > MAX_INSTRUCTION_CHARS:
            raise OpenAIError(400, f"instructions has {len(instructions)} characters; the maximum is "
                              f"{MAX_INSTRUCTION_CHARS}", param="instructions", code="string_above_max_length")
        generation = {"instruction": instructions, **generation}
    return SpeechRequest(model, text, voice_id, fmt, stream_format, generation)


def _required_str(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if name == "voice" and isinstance(value, dict):  # {"id": "voice_1234"}: a custom voice reference
        value = value.get("id")
    if value is None:
        raise OpenAIError(400, f"you must provide '{name}'", param=name, code="missing_required_parameter")
    if not isinstance(value, str) or not value:
        raise OpenAIError(400, f"'{name}' must be a non-empty string", param=name, code="invalid_type")
    return value


def _voice(voice: str, stored: set[str]) -> str | None:
    if voice in stored:
        return voice
    if voice.lower() in BUILTIN_VOICES or voice == "default":
        return None
    raise OpenAIError(400, f"voice {voice!r} is neither a built-in voice ({', '.join(BUILTIN_VOICES)}) nor a stored "
                      "voice (see GET /v1/audio/voices; create one with POST /v1/voices)", param="voice",
                      code="invalid_value")


# ---------------------------------------------------------------------------------------------------- handlers


async def speech(request: web.Request) -> web.StreamResponse:
    """POST /v1/audio/speech."""
    gw = gateway_of(request)
    try:
        key = _authenticate(request)
        try:
            body = await json_body(request)
        except ValueError as e:
            raise OpenAIError(400, f"the request body is not a valid JSON object: {e}") from None
        req = parse_speech_request(body, await _stored(gw, key, body))
        refused = await gw.refusal(key)
        if refused is not None:
            raise OpenAIError(503 if gw.draining else 429, refused.message, type="server_error" if gw.draining else
                              "rate_limit_exceeded", code=str(ErrorCode.OVERLOADED))
    except OpenAIError as e:
        return e.response()
    async with OneTurn.open(request, key) as turn:
        try:
            await turn.start(voice=req.voice, sample_rate=RESPONSE_FORMATS[req.response_format][1],
                             generation=req.generation)
        except NativeError as e:  # unknown voice, bad generation settings, ...
            return _from_native(e, "generation").response()
        try:
            first = await turn.say(req.input)  # the first audio, so an engine refusal still gets a proper status
        except NativeError as e:
            return _from_native(e, "input").response()
        container, rate, content_type = RESPONSE_FORMATS[req.response_format]
        transcoder = Transcoder(OutputFormat.from_dict({"format": container, "sample_rate": rate}))
        if req.stream_format != "sse":
            return await turn.respond(request, first, transcoder, {"Content-Type": content_type})

        def delta(data: bytes) -> bytes:
            return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})

        def usage(done: ContextDone) -> bytes:
            patches = round(float(done.audio_ms) / (turn.session.model_info.patch_ms or 1.0))
            return _sse({"type": "speech.audio.done", "usage": {
                "input_tokens": len(req.input), "output_tokens": patches, "total_tokens": len(req.input) + patches}})

        return await turn.respond(request, first, transcoder, {"Content-Type": "text/event-stream"}, frame=delta,
                                  trailer=usage)


async def _stored(gw: Gateway, key: str, body: Any) -> set[str]:
    """The body's voice, if it names a stored voice this key may use (as a set for parse_speech_request)."""
    voice = body.get("voice") if isinstance(body, dict) else None
    voice = voice.get("id") if isinstance(voice, dict) else voice
    if not isinstance(voice, str) or not voice:
        return set()
    try:
        found = await gw.voices.resolve(voice, gw.auth.caller(key))
    except VoiceRefused as e:  # the store or the engine cannot serve it now
        raise OpenAIError(e.status, e.message, type="server_error", code=e.code) from None
    return {found} if found else set()


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def _authenticate(request: web.Request) -> str:
    gw = gateway_of(request)
    try:
        return gw.auth.check_key(request.headers.get("Authorization"))
    except AuthError as e:
        gw.metrics.errors.labels(code=str(ErrorCode.UNAUTHORIZED)).inc()
        raise OpenAIError(401, f"Incorrect API key provided: {e}", code="invalid_api_key") from None


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: the served model (by architecture) and the OpenAI names it answers to."""
    try:
        _authenticate(request)
    except OpenAIError as e:
        return e.response()
    info = gateway_of(request).engine.model_info()
    names = [info.architecture, *MODEL_ALIASES]
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "voxgate"} for name in names]})


async def voices(request: web.Request) -> web.Response:
    """GET /v1/audio/voices: stored voices (usable as `voice`), then the built-in names (the default voice)."""
    gw = gateway_of(request)
    try:
        key = _authenticate(request)
        stored = sorted(v["voice_id"] for v in await gw.voices.list_voices(gw.auth.caller(key)))
    except OpenAIError as e:
        return e.response()
    except VoiceRefused as e:
        return OpenAIError(e.status, e.message, type="server_error", code=e.code).response()
    data = [{"id": v, "object": "audio.voice", "name": v, "created_at": 0, "type": "audio_sample"} for v in stored]
    data += [{"id": v, "object": "audio.voice", "name": v, "created_at": 0, "type": "builtin"}
             for v in BUILTIN_VOICES]
    return web.json_response({"object": "list", "data": data})


ROUTES = ("/v1/audio/speech", "/v1/models", "/v1/audio/voices")


async def _request_id(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare` hook: every answer on the OpenAI routes carries an `x-request-id` header, as OpenAI's
    do (its SDK exposes it as `request_id`; LiveKit's plugin warns on every synthesis without it)."""
    if request.path in ROUTES and "x-request-id" not in response.headers:
        response.headers["x-request-id"] = f"req_{uuid.uuid4().hex}"


def register(app: web.Application) -> None:
    app.router.add_post("/v1/audio/speech", speech)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/audio/voices", voices)
    app.on_response_prepare.append(_request_id)
