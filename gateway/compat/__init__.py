"""Foreign protocols over the one native `Session`: OpenAI speech (HTTP), the ElevenLabs, Cartesia and Deepgram
streaming WebSockets, and a Twilio Media Streams bridge. Each adapter only translates messages: it feeds the session
native client messages and is the session's `EventSink`, translating the typed messages and audio packets the session
emits into the foreign form (nothing is serialised to be parsed again). Segmenting, pacing, encoding and cancellation
exist once, in gateway.session and gateway.audio; the life of a foreign socket's session exists once, in
`SocketBridge`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from gateway.app_keys import GATEWAY
from gateway.audio import Encoder, OutputFormat
from gateway.auth import AuthError
from gateway.protocol import AudioPackets, ErrorCode, Limits, ProtocolError, ServerMessage, load_json
from gateway.session import Session
from gateway.sockets import FirstMessageTimeout, Messages

if TYPE_CHECKING:  # gateway.server imports this package (its routes)
    from gateway.server import Gateway

log = logging.getLogger("voxgate.compat")


def native(kind: str, **fields: Any) -> str:
    """One native client message, as the session reads it."""
    return json.dumps({"type": kind, **fields}, ensure_ascii=False, separators=(",", ":"))


# native error code -> the HTTP status that says it; the client's mistakes otherwise: 400
_HTTP_STATUS: dict[str, int] = {
    ErrorCode.UNAUTHORIZED: 401, ErrorCode.RATE_LIMITED: 429, ErrorCode.TOO_MANY_CONTEXTS: 429,
    ErrorCode.IDLE_TIMEOUT: 408, ErrorCode.OVERLOADED: 503, ErrorCode.SERVER_SHUTDOWN: 503,
    ErrorCode.ENGINE_ERROR: 500, ErrorCode.INTERNAL_ERROR: 500, ErrorCode.SLOW_CONSUMER: 500,
    ErrorCode.STORE_UNAVAILABLE: 503}


def http_status(code: str) -> int:
    """The HTTP status for a native error code (protocols that report errors with one)."""
    return _HTTP_STATUS.get(code, 400)


def share_span(weights: list[int], start_ms: float, end_ms: float) -> list[float]:
    """Edges in seconds (one more than the weights) of consecutive pieces of a segment that share its audio span in
    proportion to their weights. VoxCPM gives no alignment: word and character timestamps are this estimate, from
    each segment's real span (known once the next one starts)."""
    total, edges, done = sum(weights), [round(start_ms / 1000.0, 3)], 0
    for weight in weights:
        done += weight
        edges.append(round((start_ms + (end_ms - start_ms) * done / total) / 1000.0, 3))
    return edges


def json_object(raw: str | bytes) -> dict[str, Any]:
    """A client message that must be one JSON object in a text frame, every string in it valid Unicode
    (`protocol.load_json`); ValueError saying what is wrong otherwise."""
    if isinstance(raw, bytes):
        raise ValueError("send JSON text messages, not binary")
    try:
        message = load_json(raw)
    except ProtocolError as e:
        raise ValueError(e.message) from None
    if not isinstance(message, dict):
        raise ValueError("a message must be a JSON object")
    return message


async def json_body(request: web.Request) -> dict[str, Any]:
    """An HTTP request's body as one JSON object (UTF-8 whatever charset the Content-Type claims, as JSON is);
    ValueError saying what is wrong otherwise."""
    try:
        text = (await request.read()).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"the body is not UTF-8 text: {e}") from None
    return json_object(text)


def check_api_key(gw: Gateway, key: str | None) -> str:
    """The identity for a raw API key (foreign protocols pass keys without `Bearer`); AuthError if refused."""
    if gw.auth.enabled and not key:
        raise AuthError("no API key")
    return gw.auth.check_key(f"Bearer {key}")


def gateway_of(request: web.Request) -> Gateway:
    return request.app[GATEWAY]


class Transcoder:
    """PCM s16le frames from a session -> one container stream (MP3, Ogg Opus, AAC, FLAC, WAV) through
    gateway.audio's Encoder at the same rate, so nothing is resampled twice. `pcm_s16le` passes through."""

    def __init__(self, fmt: OutputFormat):
        self.fmt = fmt
        self._encoder = None if fmt.format == "pcm_s16le" else Encoder(fmt, fmt.sample_rate)

    def write(self, pcm: bytes) -> bytes:
        if self._encoder is None:
            return pcm
        return b"".join(self._encoder.encode(np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767.0))

    def finish(self) -> bytes:
        return b"" if self._encoder is None else b"".join(self._encoder.finish())


class SocketBridge:
    """One foreign-protocol WebSocket over one native Session, from the first message to the release of everything.

    A subclass translates the client's messages (`handle`, which feeds the session through `to_session`) and is the
    session's EventSink: `message` receives each typed native message, `audio` each batch of audio frames. The session
    is opened by `start_session` once the adapter knows the key and the settings, and counts like a native one
    (server limits, readiness, the shutdown drain)."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse):
        self.request, self.ws = request, ws
        self.gw = gateway_of(request)
        self.key: str | None = None  # the authenticated key, once checked
        self.session: Session | None = None
        self.closing = False  # no more client messages are read
        self._tracking = contextlib.ExitStack()
        self._pending = contextlib.ExitStack()  # counted as a pending socket until the session starts
        self.pending = False  # counted by Gateway.pending_socket (for `Gateway.refusal(key, pending=...)`)
        self._tasks: set[asyncio.Task] = set()
        self.arrived_at: float | None = None  # when the message being handled came in (its turn's TTFB origin)

    async def on_open(self) -> None:
        """The socket is open (the first thing `serve` does): a protocol that knows its settings from the handshake
        starts its session here."""

    async def handle(self, raw: str | bytes) -> None:
        """One message from the client."""
        raise NotImplementedError

    async def message(self, msg: ServerMessage) -> None:
        """One message the session emits, to translate for the client."""
        raise NotImplementedError

    async def audio(self, packets: AudioPackets) -> None:
        """One batch of a turn's audio frames, to translate for the client."""
        raise NotImplementedError

    async def start_session(self, limits: Limits, **start: Any) -> None:
        """Open the native session under `limits` and send it `session.start` with these fields."""
        assert self.key is not None, "authenticate before starting the session"
        config = dataclasses.replace(self.gw.config.session, limits=limits)
        self.session = self.gw.session(self, self.key, config)
        self.session.open()
        self._pending.close()
        self.pending = False
        self._tracking.enter_context(self.gw.tracked(self.session, self.key))
        await self.to_session("session.start", **start)

    async def send_json(self, message: dict[str, Any]) -> None:
        """One JSON message to the client."""
        await self.ws.send_str(json.dumps(message, ensure_ascii=False))

    async def to_session(self, kind: str, **fields: Any) -> None:
        """Feed the session one native client message."""
        assert self.session is not None
        await self.session.receive(native(kind, **fields), self.arrived_at)

    async def close(self, code: int, reason: str) -> None:
        """Close the session (which closes the socket through this sink), or the socket alone."""
        self.closing = True
        if self.session is not None and not self.session.closed:
            await self.session.close(code, reason)  # comes back here through the transport
            return
        with contextlib.suppress(Exception):
            await self.ws.close(code=code, message=reason.encode()[:120])

    def abort(self) -> None:
        if self.request.transport is not None:
            self.request.transport.abort()

    def background(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a coroutine beside the message loop: a close from inside the session's own send would wait on itself.
        `release` waits for these."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def first_message_within(self) -> float | None:
        """Seconds the first message may take: a socket without a session holds a place it has not identified
        itself for (handshake_timeout_s while its key is unknown, the idle timeout after); None once a session
        runs (its idle timeout applies)."""
        if self.session is not None:
            return None
        return self.gw.config.handshake_timeout_s if self.key is None else self.gw.config.limits.idle_timeout_s

    async def first_message_late(self) -> None:
        """No first message in time: closed with 1008 (a protocol with an error message for it says so first)."""
        await self.close(1008, "no message in time")

    async def internal_error(self) -> None:
        """A bug met while serving the socket: the client gets the protocol's form of `internal_error`."""
        if self.session is not None and not self.session.closed:
            await self.session.fail(ProtocolError(ErrorCode.INTERNAL_ERROR, "internal error", fatal=True))
        else:
            await self.close(1011, "internal error")

    def stalled(self) -> None:
        """The client stopped reading (`sockets.Messages`' probe): dropped like any slow consumer."""
        if self.session is not None:
            self.session.drop_slow_consumer()
        else:
            self.abort()

    async def serve(self) -> None:
        """Read the client's messages until either side closes, then release everything. A socket without a session
        yet counts against max_sessions and has a deadline for its first message (`first_message_within`)."""
        if self.session is None:
            self._pending.enter_context(self.gw.pending_socket())
            self.pending = True
        try:
            await self.on_open()
            async with Messages(self.ws, stall_s=self.gw.config.limits.slow_consumer_timeout_s,
                                on_stall=self.stalled, first_within_s=self.first_message_within()) as messages:
                async for msg in messages:
                    self.arrived_at = messages.arrived_at
                    await self.handle(msg.data)
                    if self.closing or self.session is not None and self.session.closed:
                        break
        except FirstMessageTimeout:
            await self.first_message_late()
        except ConnectionError:  # the client went away while we answered it
            pass
        except Exception:  # a bug: logged once, the client hears of it, the server serves on
            log.exception("%s: internal error", type(self).__name__)
            await self.internal_error()
        finally:
            await self.release()

    async def release(self) -> None:
        """The socket is gone: stop the session (cancelling its turns) and give back its place."""
        await asyncio.gather(*self._tasks, return_exceptions=True)  # a close in progress keeps its code
        if self.session is not None:
            await self.session.close(1000, "")
        self._tracking.close()
        self._pending.close()


__all__ = ["register", "native", "json_object", "json_body", "http_status", "share_span", "check_api_key", "gateway_of",
           "Transcoder", "AuthError", "SocketBridge"]
