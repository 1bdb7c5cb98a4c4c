"""The aiohttp application: native WebSocket endpoint, voices and token API, health, readiness, Prometheus metrics,
and the static web client."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import socket
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import BodyPartReader, WSMsgType, web

from engine import errors as engine_errors
from gateway import normalize
from gateway.auth import Auth, AuthError
from gateway.metrics import GatewayMetrics
from gateway.protocol import ErrorCode, Limits, ProtocolError
from gateway.session import Session, SessionConfig

log = logging.getLogger("voxgate.server")

WEB_CLIENT_DIR = Path(__file__).resolve().parent.parent / "web_client"


@dataclass(frozen=True)
class ServerConfig:
    session: SessionConfig = field(default_factory=SessionConfig)
    max_sessions: int = 1000
    max_sessions_per_key: int = 100
    shutdown_timeout_s: float = 10.0  # turns in progress may finish within this, then sessions are closed
    web_client_dir: Path | None = WEB_CLIENT_DIR
    max_voice_bytes: int = 20 << 20
    max_lora_bytes: int = 1 << 30  # a LoRA upload (streamed, so not bound by max_voice_bytes)
    socket_send_buffer: int | None = None  # SO_SNDBUF; small values make pacing and barge-in tighter

    @property
    def limits(self) -> Limits:
        return self.session.limits


class Gateway:
    """State shared by the handlers: the engine, auth, metrics and the open sessions."""

    def __init__(self, engine: Any, config: ServerConfig, auth: Auth, metrics: GatewayMetrics):
        self.engine, self.config, self.auth, self.metrics = engine, config, auth, metrics
        self.sessions: set[Session] = set()
        self.per_key: Counter[str] = Counter()
        self.draining = False

    def refusal(self, key: str) -> ProtocolError | None:
        """Why a new session for this key is refused now (fatal error to send), or None. Compat adapters use it too."""
        if self.draining:
            return ProtocolError(ErrorCode.SERVER_SHUTDOWN, "the server is shutting down", fatal=True)
        if len(self.sessions) >= self.config.max_sessions:
            return ProtocolError(ErrorCode.OVERLOADED, f"the server is at its limit of {self.config.max_sessions} "
                                 "sessions; retry shortly or elsewhere", fatal=True)
        if self.auth.enabled and self.per_key[key] >= self.config.max_sessions_per_key:
            return ProtocolError(ErrorCode.RATE_LIMITED, f"at most {self.config.max_sessions_per_key} concurrent "
                                 "sessions per API key", fatal=True)
        return None

    @contextlib.contextmanager
    def tracked(self, session: Session, key: str) -> Iterator[None]:
        """Count a session (limits, readiness, shutdown drain) while the block runs."""
        self.sessions.add(session)
        self.per_key[key] += 1
        try:
            yield
        finally:
            self.sessions.discard(session)
            self.per_key[key] -= 1
            if self.per_key[key] <= 0:
                del self.per_key[key]


GATEWAY = web.AppKey("gateway", Gateway)


def create_app(engine: Any, config: ServerConfig | None = None, *, auth: Auth | None = None,
               metrics: GatewayMetrics | None = None, compat: bool = False) -> web.Application:
    """The gateway as an aiohttp application around a started engine; `compat` adds the foreign protocols
    (OpenAI speech, ElevenLabs stream-input, Twilio Media Streams: gateway/compat)."""
    config = config or ServerConfig()
    metrics = metrics or GatewayMetrics()
    metrics.watch_engine(engine)
    app = web.Application(client_max_size=config.max_voice_bytes)
    app[GATEWAY] = Gateway(engine, config, auth or Auth(), metrics)
    r = app.router
    r.add_get("/v1/stream", stream)
    r.add_post("/v1/tokens", create_token)
    r.add_post("/v1/voices", add_voice)
    r.add_get("/v1/voices", list_voices)
    r.add_delete("/v1/voices/{voice_id}", remove_voice)
    r.add_post("/v1/loras", add_lora)
    r.add_get("/v1/loras", list_loras)
    r.add_delete("/v1/loras/{name}", remove_lora)
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    r.add_get("/metrics", prometheus)
    if compat:
        from gateway import compat as adapters  # imports this module: only here

        adapters.register(app)
    web_dir = config.web_client_dir
    if web_dir is not None and (web_dir / "index.html").is_file():
        async def index(_: web.Request) -> web.FileResponse:
            return web.FileResponse(web_dir / "index.html")

        r.add_get("/", index)
        r.add_static("/", web_dir)  # last: it matches every other path
    app.on_startup.append(_preload_normalizer)
    app.on_shutdown.append(_shutdown)
    return app


async def _preload_normalizer(_: web.Application) -> None:
    """The TN grammars load (~2 s) in a thread while the server starts, not in the first turn with a number."""
    asyncio.get_running_loop().run_in_executor(None, normalize.preload)


async def start_server(app: web.Application, host: str = "127.0.0.1", port: int = 0,
                       shutdown_timeout_s: float = 15.0) -> tuple[web.AppRunner, int]:
    """Listen on host:port (0: a free port); returns the runner (`await runner.cleanup()` stops it) and the port."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    server = site._server  # aiohttp exposes the bound port only here
    return runner, server.sockets[0].getsockname()[1] if server is not None else port


# ---------------------------------------------------------------------------------------------------- WebSocket


RAW_WRITE_LIMIT = 64 << 10  # bytes queued in the transport above which sends go through aiohttp (and wait)
# below this, no send can make aiohttp wait for the socket to drain (it waits only once asyncio's transport pauses
# writing, at its high-water mark of 64 KiB), so the session needs no stall timer for it
SEND_READY_LIMIT = 16 << 10
_WS_LEN7 = struct.Struct("!BB")
_WS_LEN16 = struct.Struct("!BBH")
_WS_LEN64 = struct.Struct("!BBQ")


def _ws_binary_header(n: int) -> bytes:
    """RFC 6455 header of one unmasked, final binary frame of n bytes."""
    if n < 126:
        return _WS_LEN7.pack(0x82, n)
    if n < 1 << 16:
        return _WS_LEN16.pack(0x82, 126, n)
    return _WS_LEN64.pack(0x82, 127, n)


class _WsTransport:
    def __init__(self, ws: web.WebSocketResponse, request: web.Request):
        self.ws, self.request = ws, request

    async def send_text(self, data: str) -> None:
        await self.ws.send_str(data)

    async def send_bytes(self, data: bytes) -> None:
        await self.ws.send_bytes(data)

    def send_ready(self) -> bool:
        """Little is queued for the socket, so a send completes without waiting for the client."""
        transport = self.request.transport
        return transport is not None and transport.get_write_buffer_size() < SEND_READY_LIMIT

    async def send_frames(self, frames: list[bytes]) -> None:
        """Several binary messages in one socket write (one syscall per engine chunk rather than per 20 ms frame:
        measured 0.8 vs 4.5 us of loop time per frame). Server frames are unmasked, so framing them is the RFC 6455
        header alone; aiohttp writes its own frames to the same transport synchronously, so order is kept. Once
        the client falls behind (bytes pile up in the transport), aiohttp's own send path takes over: it waits for
        the socket to drain, which is what the session's stall timeout watches."""
        transport = self.request.transport
        if transport is None or self.ws.closed or transport.get_write_buffer_size() > RAW_WRITE_LIMIT:
            for data in frames:
                await self.ws.send_bytes(data)
            return
        if transport.is_closing():
            raise ConnectionResetError("the connection is closing")
        transport.write(b"".join([_ws_binary_header(len(data)) + data for data in frames]))

    async def close(self, code: int, reason: str) -> None:
        await self.ws.close(code=code, message=reason.encode()[:120])

    def abort(self) -> None:
        if self.request.transport is not None:
            self.request.transport.abort()


async def stream(request: web.Request) -> web.StreamResponse:
    """GET /v1/stream: the native protocol (docs/PROTOCOL.md)."""
    gw = request.app[GATEWAY]
    try:
        key = gw.auth.authenticate(request.headers.get("Authorization"), request.query.get("token"))
    except AuthError as e:
        gw.metrics.errors.labels(code=str(ErrorCode.UNAUTHORIZED)).inc()
        return _error(401, ErrorCode.UNAUTHORIZED, str(e))
    if gw.draining:
        return _error(503, ErrorCode.SERVER_SHUTDOWN, "the server is shutting down")
    ws = web.WebSocketResponse(max_msg_size=gw.config.limits.ws_max_msg_size, compress=False, autoping=True)
    await ws.prepare(request)
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if gw.config.socket_send_buffer and sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, gw.config.socket_send_buffer)
    session = Session(gw.engine, _WsTransport(ws, request), gw.config.session, metrics=gw.metrics)
    session.open()
    refusal = gw.refusal(key)
    if refusal is not None:
        await session.fail(refusal)
        return ws
    log.info("session %s opened (%s)", session.id, request.remote)
    with gw.tracked(session, key):
        try:
            async for msg in ws:
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    await session.receive(msg.data)
                elif msg.type == WSMsgType.ERROR:
                    break
                if session.closed:
                    break
        finally:
            await session.close(1000, "")
            log.info("session %s closed", session.id)
    return ws


async def _shutdown(app: web.Application) -> None:
    gw = app[GATEWAY]
    gw.draining = True
    sessions = list(gw.sessions)
    if sessions:
        log.info("shutting down: %d sessions get %.0f s to finish their turns", len(sessions),
                 gw.config.shutdown_timeout_s)
    await asyncio.gather(*(s.shutdown(gw.config.shutdown_timeout_s) for s in sessions), return_exceptions=True)


# ---------------------------------------------------------------------------------------------------- HTTP API


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": str(code), "message": message}}, status=status)


def _check_key(request: web.Request) -> str | web.Response:
    gw = request.app[GATEWAY]
    try:
        return gw.auth.check_key(request.headers.get("Authorization"))
    except AuthError as e:
        gw.metrics.errors.labels(code=str(ErrorCode.UNAUTHORIZED)).inc()
        return _error(401, ErrorCode.UNAUTHORIZED, str(e))


async def create_token(request: web.Request) -> web.Response:
    """POST /v1/tokens: a short-lived single-use token for a browser's `?token=`."""
    key = _check_key(request)
    if isinstance(key, web.Response):
        return key
    token, ttl = request.app[GATEWAY].auth.issue_token(key)
    return web.json_response({"token": token, "expires_in": ttl})


async def add_voice(request: web.Request) -> web.Response:
    """POST /v1/voices: multipart (`audio` file + optional `text`, `lora`) or a raw WAV/FLAC body (+ `?text=`,
    `?lora=`). `lora` names a registered adapter the voice's requests use; with it the audio is optional."""
    key = _check_key(request)
    if isinstance(key, web.Response):
        return key
    gw = request.app[GATEWAY]
    text = request.query.get("text")
    lora = request.query.get("lora")
    data = b""
    try:
        if request.content_type.startswith("multipart/"):
            form = await request.post()
            upload = form.get("audio") or form.get("file")
            lora = form.get("lora") if isinstance(form.get("lora"), str) else lora
            if upload is None and lora:
                return await _add_lora_voice(gw, lora)
            if upload is None or not hasattr(upload, "file"):
                return _error(400, ErrorCode.MISSING_FIELD, "multipart body needs a file field 'audio'")
            data = upload.file.read()
            text = form.get("text", text) if isinstance(form.get("text", text), str | None) else text
        else:
            data = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _error(413, ErrorCode.MESSAGE_TOO_LARGE, f"voice audio over {gw.config.max_voice_bytes} bytes")
    if not data and lora:
        return await _add_lora_voice(gw, lora)
    if not data:
        return _error(400, ErrorCode.MISSING_FIELD, "no audio in the request body")
    try:
        audio, rate = _decode_audio(data)
    except ValueError as e:
        return _error(400, ErrorCode.INVALID_VALUE, f"cannot read the audio (WAV or FLAC expected): {e}")
    try:
        voice_id = await gw.engine.add_voice(audio=audio, sample_rate=rate, text=text or None,
                                             **({"lora": lora} if lora else {}))
    except engine_errors.UnknownLoRA as e:
        return _error(404, ErrorCode.UNKNOWN_LORA, str(e))
    except engine_errors.InvalidRequest as e:
        return _error(400, ErrorCode.INVALID_VALUE, str(e))
    except engine_errors.EngineError as e:
        return _error(503, ErrorCode.ENGINE_ERROR, f"{type(e).__name__}: {e}")
    return web.json_response({"voice_id": voice_id}, status=201)


async def _add_lora_voice(gw: Gateway, lora: str) -> web.Response:
    """A voice that is a LoRA adapter alone (a fine-tuned speaker needs no reference audio)."""
    try:
        voice_id = await gw.engine.add_voice(lora=lora)
    except engine_errors.UnknownLoRA as e:
        return _error(404, ErrorCode.UNKNOWN_LORA, str(e))
    except engine_errors.InvalidRequest as e:
        return _error(400, ErrorCode.INVALID_VALUE, str(e))
    return web.json_response({"voice_id": voice_id}, status=201)


def _decode_audio(data: bytes) -> tuple[np.ndarray, int]:
    import soundfile

    try:
        audio, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:  # soundfile raises its own error types for every malformed file
        raise ValueError(str(e)) from None
    return audio.mean(axis=1), int(rate)


async def list_voices(request: web.Request) -> web.Response:
    key = _check_key(request)
    if isinstance(key, web.Response):
        return key
    voices = request.app[GATEWAY].engine.list_voices()
    if asyncio.iscoroutine(voices):
        voices = await voices
    return web.json_response({"voices": [v if isinstance(v, str) else asdict(v) for v in voices]})


async def remove_voice(request: web.Request) -> web.Response:
    key = _check_key(request)
    if isinstance(key, web.Response):
        return key
    voice_id = request.match_info["voice_id"]
    try:
        result = request.app[GATEWAY].engine.remove_voice(voice_id)
        if asyncio.iscoroutine(result):
            await result
    except (engine_errors.UnknownVoice, KeyError):
        return _error(404, ErrorCode.UNKNOWN_VOICE, f"no stored voice {voice_id!r}")
    return web.Response(status=204)


async def add_lora(request: web.Request) -> web.Response:
    """POST /v1/loras: multipart with `name`, `weights` (lora_weights.safetensors) and `config` (the contents of
    lora_config.json, as a field or a file). 201 with the adapter's info; a bad adapter is a 400 naming the problem."""
    key = _check_key(request)
    if isinstance(key, web.Response):
        return key
    gw = request.app[GATEWAY]
    if not request.content_type.startswith("multipart/"):
        return _error(400, ErrorCode.INVALID_VALUE, "send the adapter as multipart/form-data: name, weights, config")
    fields: dict[str, bytes] = {}
    size = 0
    reader = await request.multipart()
    async for part in reader:
        if not isinstance(part, BodyPartReader) or part.name not in ("name", "weights", "config"):
            continue
        chunks = []
        while chunk := await part.read_chunk():
            size += len(chunk)
            if size > gw.config.max_lora_bytes:
                return _error(413, ErrorCode.MESSAGE_TOO_LARGE, f"adapter over {gw.config.max_lora_bytes} bytes")
            chunks.append(chunk)
        fields[part.name] = b"".join(chunks)
    missing = [f for f in ("name", "weights", "config") if not fields.get(f)]
    if missing:
        return _error(400, ErrorCode.MISSING_FIELD, f"multipart body needs the field(s) {missing}")
    try:
        name = fields["name"].decode()
        config = json.loads(fields["config"])
        tensors = await asyncio.to_thread(_read_safetensors, fields["weights"])
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        return _error(400, ErrorCode.INVALID_VALUE, f"cannot read the adapter: {e}")
    try:
        info = await gw.engine.register_lora(name, tensors, config=config)
    except engine_errors.InvalidRequest as e:
        return _error(400, ErrorCode.INVALID_VALUE, str(e))
    except engine_errors.EngineError as e:
        return _error(503, ErrorCode.ENGINE_ERROR, f"{type(e).__name__}: {e}")
    return web.json_response({"lora": asdict(info)}, status=201)


def _read_safetensors(data: bytes) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except SafetensorError as e:
        raise ValueError(f"weights: not a safetensors file ({e})") from None


async def list_loras(request: web.Request) -> web.Response:
    key = _check_key(request)
    if isinstance(key, web.Response):
        return key
    return web.json_response({"loras": [asdict(i) for i in request.app[GATEWAY].engine.list_loras()]})


async def remove_lora(request: web.Request) -> web.Response:
    """DELETE /v1/loras/{name}: new requests for it are refused at once; answers 204 once those in flight finished
    and the adapter is freed."""
    key = _check_key(request)
    if isinstance(key, web.Response):
        return key
    name = request.match_info["name"]
    try:
        await request.app[GATEWAY].engine.unregister_lora(name)
    except engine_errors.UnknownLoRA as e:
        return _error(404, ErrorCode.UNKNOWN_LORA, str(e))
    except engine_errors.InvalidRequest as e:  # still named by a stored voice
        return _error(409, ErrorCode.INVALID_VALUE, str(e))
    return web.Response(status=204)


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process answers."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: the engine serves and the server is not draining."""
    gw = request.app[GATEWAY]
    if gw.draining:
        return web.json_response({"status": "draining"}, status=503)
    try:
        health = gw.engine.health()
        if asyncio.iscoroutine(health):
            health = await health
    except Exception as e:
        return web.json_response({"status": "engine unavailable", "detail": str(e)}, status=503)
    status = health.get("status") if isinstance(health, dict) else None
    ok = status in ("ok", "degraded")  # degraded: some workers serve while others restart
    body = {"status": "ready" if ok else f"engine {status}", "sessions": len(gw.sessions)}
    return web.json_response(body, status=200 if ok else 503)


async def prometheus(request: web.Request) -> web.Response:
    body = request.app[GATEWAY].metrics.render()
    return web.Response(body=body, content_type="text/plain", charset="utf-8")
