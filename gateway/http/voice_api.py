"""HTTP API for what keys store: voices (`/v1/voices`), LoRA adapters (`/v1/loras`) and browser tokens
(`/v1/tokens`). Ownership and loading are gateway.voices' job; this module parses requests and answers them."""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from engine import errors as engine_errors
from gateway.app_keys import GATEWAY
from gateway.auth import AuthError, Caller
from gateway.http.http_errors import error_response
from gateway.protocol import ErrorCode
from gateway.store import StoreUnavailable
from gateway.voice_design import parse_design
from gateway.voices import LORA, VOICE, VoiceRefused

# what aiohttp's multipart reader raises for a body that is not well-formed multipart: no or an unknown boundary,
# broken part headers, an unknown charset, a body cut short (ValueError covers UnicodeDecodeError)
MALFORMED_MULTIPART = (ValueError, LookupError, HttpProcessingError)

Handler = Callable[[web.Request], Awaitable[web.Response]]


def _malformed_multipart(e: Exception) -> web.Response:
    detail = str(getattr(e, "message", None) or e).strip().splitlines()
    return error_response(400, ErrorCode.INVALID_VALUE, "malformed multipart/form-data body: "
                          f"{detail[0] if detail else type(e).__name__}")


def _caller(request: web.Request) -> Caller | web.Response:
    gw = request.app[GATEWAY]
    try:
        return gw.auth.caller(gw.auth.check_key(request.headers.get("Authorization")))
    except AuthError as e:
        gw.metrics.errors.labels(code=str(ErrorCode.UNAUTHORIZED)).inc()
        return error_response(401, ErrorCode.UNAUTHORIZED, str(e))


def keyed(handler: Callable[[web.Request, Caller], Awaitable[web.Response]]) -> Handler:
    """A handler of a key's stored things: it gets the calling key (401 without a valid one), and a VoiceRefused it
    raises (another key's item: 404, the store down: 503, ...) is answered as the refusal says."""
    @functools.wraps(handler)
    async def handle(request: web.Request) -> web.Response:
        caller = _caller(request)
        if isinstance(caller, web.Response):
            return caller
        try:
            return await handler(request, caller)
        except VoiceRefused as e:
            return error_response(e.status, e.code, e.message)

    return handle


def _flag(value: object) -> bool:
    return str(value).lower() in ("1", "true", "yes")


@keyed
async def create_token(request: web.Request, caller: Caller) -> web.Response:
    """POST /v1/tokens: a short-lived single-use token for a browser's `?token=` (good once, on any node)."""
    try:
        token, ttl = await request.app[GATEWAY].auth.issue_token(caller.key)
    except StoreUnavailable as e:
        return error_response(503, ErrorCode.STORE_UNAVAILABLE, str(e))
    return web.json_response({"token": token, "expires_in": ttl})


@keyed
async def add_voice(request: web.Request, caller: Caller) -> web.Response:
    """POST /v1/voices: multipart (`audio` file + optional `text`, `lora`, `public`) or a raw WAV/FLAC body (+
    `?text=`, `?lora=`, `?public=`). `lora` names an adapter the voice's requests use; with it the audio is
    optional. `public=true` (operator keys only) shares the voice with every key. A JSON body
    `{"description", "text"?, "seed"?, "public"?}` designs the voice from a description (gateway.voice_design)."""
    gw = request.app[GATEWAY]
    text, lora, public = request.query.get("text"), request.query.get("lora"), _flag(request.query.get("public"))
    data = b""
    design = None
    try:
        if request.content_type == "application/json":
            try:
                design = parse_design(await request.read())
            except ValueError as e:
                return error_response(400, ErrorCode.INVALID_VALUE, str(e))
            public = design.public
        elif request.content_type.startswith("multipart/"):
            form = await request.post()
            upload = form.get("audio") or form.get("file")
            lora = form.get("lora") if isinstance(form.get("lora"), str) else lora
            public = _flag(form["public"]) if isinstance(form.get("public"), str) else public
            if upload is not None and not hasattr(upload, "file"):
                return error_response(400, ErrorCode.MISSING_FIELD, "multipart body needs a file field 'audio'")
            if upload is not None:
                data = upload.file.read()
            elif not lora:
                return error_response(400, ErrorCode.MISSING_FIELD, "multipart body needs a file field 'audio'")
            text = form.get("text", text) if isinstance(form.get("text", text), str | None) else text
        else:
            data = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, ErrorCode.MESSAGE_TOO_LARGE, f"voice audio over {gw.config.max_voice_bytes} bytes")
    except MALFORMED_MULTIPART as e:
        return _malformed_multipart(e)
    if not data and not lora and design is None:
        return error_response(400, ErrorCode.MISSING_FIELD, "no audio in the request body")
    try:  # the file as is: the engine reads it (and says what is wrong with it)
        voice = await gw.voices.create_voice(caller, audio=data or None, text=text or None, lora=lora, public=public,
                                             design=design)
    except engine_errors.AudioTooLong as e:  # read from the file's header: nothing was decoded
        return error_response(413, ErrorCode.MESSAGE_TOO_LARGE, str(e))
    except engine_errors.UnknownLoRA as e:
        return error_response(404, ErrorCode.UNKNOWN_LORA, str(e))
    except engine_errors.InvalidRequest as e:
        return error_response(400, ErrorCode.INVALID_VALUE, str(e))
    except engine_errors.EngineError as e:
        return error_response(503, ErrorCode.ENGINE_ERROR, f"{type(e).__name__}: {e}")
    return web.json_response(voice, status=201)


@keyed
async def list_voices(request: web.Request, caller: Caller) -> web.Response:
    """GET /v1/voices: the voices this key may use (its own, shared ones; every voice for an operator key)."""
    return web.json_response({"voices": await request.app[GATEWAY].voices.list_voices(caller)})


@keyed
async def remove_voice(request: web.Request, caller: Caller) -> web.Response:
    """DELETE /v1/voices/{voice_id}: another key's voice is a 404, as if it did not exist."""
    voice_id = request.match_info["voice_id"]
    try:
        await request.app[GATEWAY].voices.delete_voice(caller, voice_id)
    except engine_errors.UnknownVoice:
        return error_response(404, ErrorCode.UNKNOWN_VOICE, f"no stored voice {voice_id!r}")
    return web.Response(status=204)


async def _share(request: web.Request, caller: Caller, kind: str, name: str) -> web.Response:
    """PATCH /v1/voices/{voice_id} or /v1/loras/{name} with {"public": bool}: operator keys share or unshare."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return error_response(400, ErrorCode.BAD_JSON, "send a JSON object: {\"public\": true}")
    if not isinstance(body, dict) or set(body) != {"public"} or not isinstance(body["public"], bool):
        return error_response(400, ErrorCode.INVALID_VALUE, "send a JSON object: {\"public\": true|false}")
    view = await request.app[GATEWAY].voices.set_public(caller, kind, name, body["public"])
    return web.json_response(view if kind == VOICE else {"lora": view})


@keyed
async def share_voice(request: web.Request, caller: Caller) -> web.Response:
    return await _share(request, caller, VOICE, request.match_info["voice_id"])


@keyed
async def share_lora(request: web.Request, caller: Caller) -> web.Response:
    return await _share(request, caller, LORA, request.match_info["name"])


@keyed
async def add_lora(request: web.Request, caller: Caller) -> web.Response:
    """POST /v1/loras: multipart with `name`, `weights` (lora_weights.safetensors), `config` (the contents of
    lora_config.json, as a field or a file) and optional `public`. 201 with the adapter's info; a bad adapter is a
    400 naming the problem. Names are per key: two keys may each have an adapter `alice`."""
    gw = request.app[GATEWAY]
    if not request.content_type.startswith("multipart/"):
        return error_response(400, ErrorCode.INVALID_VALUE,
                              "send the adapter as multipart/form-data: name, weights, config")
    fields: dict[str, bytes] = {}
    size = 0
    try:
        reader = await request.multipart()
        async for part in reader:
            if not isinstance(part, BodyPartReader) or part.name not in ("name", "weights", "config", "public"):
                continue
            chunks = []
            while chunk := await part.read_chunk():
                size += len(chunk)
                if size > gw.config.max_lora_bytes:
                    return error_response(413, ErrorCode.MESSAGE_TOO_LARGE,
                                          f"adapter over {gw.config.max_lora_bytes} bytes")
                chunks.append(chunk)
            fields[part.name] = b"".join(chunks)
    except MALFORMED_MULTIPART as e:
        return _malformed_multipart(e)
    missing = [f for f in ("name", "weights", "config") if not fields.get(f)]
    if missing:
        return error_response(400, ErrorCode.MISSING_FIELD, f"multipart body needs the field(s) {missing}")
    try:
        name = fields["name"].decode()
        config = json.loads(fields["config"])
        info = await gw.voices.create_lora(caller, name, fields["weights"], config,
                                           public=_flag(fields.get("public", b"").decode()))
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        return error_response(400, ErrorCode.INVALID_VALUE, f"cannot read the adapter: {e}")
    except engine_errors.InvalidRequest as e:
        return error_response(400, ErrorCode.INVALID_VALUE, str(e))
    except engine_errors.EngineError as e:
        return error_response(503, ErrorCode.ENGINE_ERROR, f"{type(e).__name__}: {e}")
    return web.json_response({"lora": info}, status=201)


@keyed
async def list_loras(request: web.Request, caller: Caller) -> web.Response:
    """GET /v1/loras: the adapters this key may use."""
    return web.json_response({"loras": await request.app[GATEWAY].voices.list_loras(caller)})


@keyed
async def remove_lora(request: web.Request, caller: Caller) -> web.Response:
    """DELETE /v1/loras/{name}: new requests for it are refused at once; answers 204 once those in flight finished
    and the adapter is freed."""
    try:
        await request.app[GATEWAY].voices.delete_lora(caller, request.match_info["name"])
    except engine_errors.UnknownLoRA as e:
        return error_response(404, ErrorCode.UNKNOWN_LORA, str(e))
    except engine_errors.InvalidRequest as e:  # still named by a stored voice
        return error_response(409, ErrorCode.INVALID_VALUE, str(e))
    return web.Response(status=204)


def register(app: web.Application) -> None:
    r = app.router
    r.add_post("/v1/tokens", create_token)
    r.add_post("/v1/voices", add_voice)
    r.add_get("/v1/voices", list_voices)
    r.add_delete("/v1/voices/{voice_id}", remove_voice)
    r.add_patch("/v1/voices/{voice_id}", share_voice)
    r.add_post("/v1/loras", add_lora)
    r.add_get("/v1/loras", list_loras)
    r.add_delete("/v1/loras/{name}", remove_lora)
    r.add_patch("/v1/loras/{name}", share_lora)



