"""The aiohttp application: native WebSocket endpoint, health, readiness, Prometheus metrics and the static web
client; the voices, adapters and tokens API is gateway.http.voice_api."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.app_keys import GATEWAY
from gateway.auth import Auth, AuthError
from gateway.compat import routes as compat_routes
from gateway.encode_procs import close_shared as close_encode_procs
from gateway.gateway_config import GatewayConfig
from gateway.http import pronunciation_api, voice_api
from gateway.http.http_errors import error_response, quiet_malformed_http, typed_errors
from gateway.http.readiness import drain, readyz, refuse_sockets_while_draining
from gateway.http.refusals import log_refusal
from gateway.leases import Leases
from gateway.metrics import GatewayMetrics
from gateway.native_sink import NativeSink
from gateway.protocol import ErrorCode, EventSink, Limits, ProtocolError
from gateway.session import Session, SessionConfig
from gateway.sockets import Messages, open_socket
from gateway.store import Store, StoreUnavailable, open_store
from gateway.text import normalize
from gateway.text.pronunciation import Pronunciations
from gateway.voices import Catalog, Unavailable, VoiceRefused

log = logging.getLogger("voxgate.server")

WEB_CLIENT_DIR = Path(__file__).resolve().parent / "web_client"  # package data: installed with the gateway


@dataclass(frozen=True)
class ServerConfig:
    session: SessionConfig = field(default_factory=SessionConfig)
    # the defaults of what `voxgate serve` sets are GatewayConfig's (one definition with the flag's range and help)
    max_sessions: int = GatewayConfig.max_sessions
    max_sessions_per_key: int = GatewayConfig.max_sessions_per_key
    shutdown_timeout_s: float = GatewayConfig.shutdown_timeout_s  # turns in progress may finish, then sessions close
    web_client_dir: Path | None = WEB_CLIENT_DIR
    max_voice_bytes: int = 20 << 20
    max_lora_bytes: int = 1 << 30  # a LoRA upload (streamed, so not bound by max_voice_bytes)
    socket_send_buffer: int | None = None  # SO_SNDBUF; small values make pacing and barge-in tighter
    # where stored voices, adapters, tokens and leases live: `store_url` redis://host:port/db (many nodes), else the
    # local store in `data_dir` (None: memory only, gone with the process)
    store_url: str | None = None
    data_dir: Path | None = None
    strict_voices: bool = GatewayConfig.strict_voices  # compat protocols answer unknown voice ids with not-found
    lease_ttl_s: float = GatewayConfig.lease_ttl_s
    # a socket that identifies itself with its first message (ElevenLabs' xi_api_key, Twilio's start event) must send
    # it within this; until then it counts against max_sessions
    handshake_timeout_s: float = 10.0
    metrics_key: str | None = None  # GET /metrics needs `Authorization: Bearer <this>` (None: open, like /healthz)
    # the owner id under which this node's sessions also hold store leases, so max_sessions holds across the gateway
    # fronts of one node (`gateway.fronts`); None: this process's own count is the node's
    node_lease_owner: str | None = None

    @property
    def limits(self) -> Limits:
        return self.session.limits


class Gateway:
    """State shared by the handlers: the engine, auth, the store and what it holds, metrics, the open sessions."""

    def __init__(self, engine: Any, config: ServerConfig, auth: Auth, metrics: GatewayMetrics, store: Store):
        self.engine, self.config, self.auth, self.metrics, self.store = engine, config, auth, metrics, store
        self.voices = Catalog(engine, store, strict=config.strict_voices)
        self.pronunciations = Pronunciations(store)
        self.leases = Leases(store, config.lease_ttl_s)
        self.sessions: set[Session] = set()
        self.pending = 0  # open sockets not yet bound to a session (`pending_socket`)
        self.metrics_auth = Auth({config.metrics_key}) if config.metrics_key is not None else None
        self.draining = False

    def full(self, *, pending: bool = False) -> ProtocolError | None:
        """Why the server takes no more sockets now (draining, or at max_sessions counting pending sockets), or None.
        `pending`: the caller is a socket counted by `pending_socket` (not counted twice)."""
        if self.draining:
            return ProtocolError(ErrorCode.SERVER_SHUTDOWN, "the server is shutting down", fatal=True)
        if len(self.sessions) + self.pending - pending >= self.config.max_sessions:
            return self._overloaded()
        return None

    def _overloaded(self) -> ProtocolError:
        return ProtocolError(ErrorCode.OVERLOADED, f"the server is at its limit of {self.config.max_sessions} "
                             "sessions; retry shortly or elsewhere", fatal=True)

    async def refusal(self, key: str, *, pending: bool = False) -> ProtocolError | None:
        """Why a new session for this key is refused now (fatal error to send), or None: then a per-key place is
        reserved for it (in the store, so the limit holds across nodes), taken by `tracked`. Compat adapters use
        it too; `pending` as for `full`."""
        full = self.full(pending=pending)
        if full is not None:
            return full
        node = self.config.node_lease_owner
        if node is not None and not await self.leases.reserve(node, self.config.max_sessions):
            return self._overloaded()
        if self.auth.enabled and not await self.leases.reserve(self.auth.caller(key).tenant,
                                                               self.config.max_sessions_per_key):
            if node is not None:
                self.leases.unreserve(node)
            return ProtocolError(ErrorCode.RATE_LIMITED, f"at most {self.config.max_sessions_per_key} concurrent "
                                 "sessions per API key", fatal=True)
        return None

    @contextlib.contextmanager
    def pending_socket(self) -> Iterator[None]:
        """Count a socket that has no session yet (it identifies itself with its first message) against
        max_sessions while the block runs: open sockets are what the limit bounds."""
        self.pending += 1
        try:
            yield
        finally:
            self.pending -= 1

    @contextlib.contextmanager
    def tracked(self, session: Session, key: str) -> Iterator[None]:
        """Count a session (limits, readiness, shutdown drain) while the block runs."""
        self.sessions.add(session)
        lease = self.leases.claim(self.auth.caller(key).tenant) if self.auth.enabled else None
        node = self.config.node_lease_owner
        node_lease = self.leases.claim(node) if node is not None else None
        try:
            yield
        finally:
            self.sessions.discard(session)
            self.leases.release(lease)
            self.leases.release(node_lease)

    def session(self, sink: EventSink, key: str, config: SessionConfig | None = None,
                session_id: str | None = None) -> Session:
        """A new session for this key: it speaks the stored voices the key may use."""
        caller = self.auth.caller(key)

        async def voices(voice_id: str) -> str | None:
            try:
                return await self.voices.resolve(voice_id, caller)
            except Unavailable as e:
                raise ProtocolError(ErrorCode.STORE_UNAVAILABLE, e.message) from None
            except VoiceRefused as e:  # the engine could not load it
                raise ProtocolError(ErrorCode.ENGINE_ERROR, e.message) from None

        async def pronunciations(ids: list[str]) -> Callable[[str], str] | None:
            try:
                return await self.pronunciations.rewrite(ids, caller)
            except Unavailable as e:
                raise ProtocolError(ErrorCode.STORE_UNAVAILABLE, e.message) from None
            except VoiceRefused as e:
                raise ProtocolError(ErrorCode.UNKNOWN_PRONUNCIATION, e.message) from None

        session = Session(self.engine, sink, config or self.config.session, metrics=self.metrics,
                          voices=voices, session_id=session_id, pronunciations=pronunciations)
        session.tenant = caller.tenant or None  # the engine shares prefill fairly and limits queued prompts per key
        return session


def create_app(engine: Any, config: ServerConfig | None = None, *, auth: Auth | None = None,
               metrics: GatewayMetrics | None = None, compat: bool = False, store: Store | None = None,
               restore_progress: Callable[[str], None] | None = None) -> web.Application:
    """The gateway as an aiohttp application around a started engine; `compat` adds the foreign protocols
    (OpenAI speech, ElevenLabs stream-input, Twilio Media Streams: gateway/compat). The store is `store`, else the
    one the config names; at start-up a local store's voices and adapters are loaded back into the engine."""
    config = config or ServerConfig()
    metrics = metrics or GatewayMetrics()
    metrics.watch_engine(engine)
    auth = auth or Auth()
    store = store or open_store(config.store_url, config.data_dir)
    auth.bind(store)
    quiet_malformed_http()
    app = web.Application(client_max_size=config.max_voice_bytes,
                          middlewares=[typed_errors, refuse_sockets_while_draining])
    gw = app[GATEWAY] = Gateway(engine, config, auth, metrics, store)
    r = app.router
    r.add_get("/v1/stream", stream)
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    r.add_get("/metrics", prometheus)
    voice_api.register(app)
    pronunciation_api.register(app)
    if compat:
        compat_routes.register(app)
    web_dir = config.web_client_dir
    if web_dir is not None and (web_dir / "index.html").is_file():
        async def index(_: web.Request) -> web.FileResponse:
            return web.FileResponse(web_dir / "index.html")

        r.add_get("/", index)
        r.add_static("/", web_dir)  # last: it matches every other path

    async def background(_: web.Application) -> AsyncIterator[None]:
        if not store.shared:  # a shared store's items are loaded on first use, on each node
            await gw.voices.restore(restore_progress or log.info)
        if auth.keys_from_store:
            try:
                await auth.refresh_keys()
            except StoreUnavailable as e:  # the file's keys serve meanwhile; refreshed once the store answers
                log.warning("API keys from the store: %s", e)
        tasks = [asyncio.create_task(gw.leases.keep_fresh())]
        if auth.keys_from_store:
            tasks.append(asyncio.create_task(auth.keep_keys_fresh()))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await gw.leases.close()
        await store.close()
        close_encode_procs()  # the Opus encoder processes, if this loop started any (bounded: a wedged one is killed)

    app.cleanup_ctx.append(background)
    app.on_startup.append(_preload_normalizer)
    app.on_response_prepare.append(log_refusal)
    app.on_shutdown.append(drain)
    return app


async def _preload_normalizer(_: web.Application) -> None:
    """The TN grammars load (~2 s) in a thread while the server starts, not in the first turn with a number."""
    asyncio.get_running_loop().run_in_executor(None, normalize.preload)


async def start_server(app: web.Application, host: str = "127.0.0.1", port: int = 0,
                       shutdown_timeout_s: float = 15.0, *, reuse_port: bool = False) -> tuple[web.AppRunner, int]:
    """Listen on host:port (0: a free port); returns the runner (`await runner.cleanup()` stops it) and the port.
    `reuse_port`: other processes listen on the same port (SO_REUSEPORT: the kernel spreads connections).
    A connection must bring a whole request within handshake_timeout_s (and an idle keep-alive connection closes
    after as long): a socket that says nothing, or trickles its headers, does not hold a file descriptor."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout_s,
                           keepalive_timeout=app[GATEWAY].config.handshake_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    server = site._server  # aiohttp exposes the bound port only here
    return runner, server.sockets[0].getsockname()[1] if server is not None else port


# ---------------------------------------------------------------------------------------------------- WebSocket


async def stream(request: web.Request) -> web.StreamResponse:
    """GET /v1/stream: the native protocol (docs/PROTOCOL.md)."""
    gw = request.app[GATEWAY]
    try:
        key = await gw.auth.authenticate(request.headers.get("Authorization"), request.query.get("token"))
    except AuthError as e:
        gw.metrics.errors.labels(code=str(ErrorCode.UNAUTHORIZED)).inc()
        return error_response(401, ErrorCode.UNAUTHORIZED, str(e))
    if gw.draining:
        return error_response(503, ErrorCode.SERVER_SHUTDOWN, "the server is shutting down")
    ws = await open_socket(request, gw.config.limits.ws_max_msg_size, gw.config.socket_send_buffer)
    session = gw.session(NativeSink(ws, request), key)
    session.open()
    refusal = await gw.refusal(key)
    if refusal is not None:
        await session.fail(refusal)
        return ws
    log.info("session %s opened (%s)", session.id, request.remote)
    with gw.tracked(session, key):
        try:
            async with Messages(ws, stall_s=gw.config.limits.slow_consumer_timeout_s,
                                on_stall=session.drop_slow_consumer) as messages:
                async for msg in messages:
                    await session.receive(msg.data, messages.arrived_at)
                    if session.closed:
                        break
        except ConnectionError:  # the client went away
            pass
        except Exception:  # a bug: the client hears of it, the server serves on
            log.exception("session %s: internal error", session.id)
            await session.fail(ProtocolError(ErrorCode.INTERNAL_ERROR, "internal error", fatal=True))
        finally:
            await session.close(1000, "")
            log.info("session %s closed", session.id)
    return ws


# ---------------------------------------------------------------------------------------------------- HTTP API


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process answers (with its pid: the gateway fronts of one node each answer for themselves)."""
    return web.json_response({"status": "ok", "pid": os.getpid()})


async def prometheus(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text; with `metrics_key` set, only for `Authorization: Bearer <metrics_key>`."""
    gw = request.app[GATEWAY]
    if gw.metrics_auth is not None and not gw.metrics_auth.accepts(request.headers.get("Authorization")):
        return error_response(401, ErrorCode.UNAUTHORIZED, "GET /metrics needs Authorization: Bearer <metrics key>")
    body = gw.metrics.render()
    return web.Response(body=body, content_type="text/plain", charset="utf-8")
