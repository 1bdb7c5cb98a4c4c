"""The front process's end of the link: `connect` to the engine host, and the `FrontLink` it returns.

The connection is an asyncio protocol (no reader task): each read hands its whole frames to the `RemoteEngine`
(chunks, refusals, pushed state) or to the call waiting for a reply. What the front sends in one pass of its event
loop (a burst of turns' requests, cancels, calls) leaves as one frame at the end of that pass; buffered-audio
reports alone wait a few milliseconds for company (`REPORT_DELAY_S`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.config import ModelConfig
from engine.errors import InvalidParameter
from engine.ipc import AudioRing
from engine.text import Tokenizer
from gateway.link import ring, wire
from gateway.link.host_store import HostStore
from gateway.link.remote_engine import RemoteEngine, RemoteStream

log = logging.getLogger("voxgate.link")

CONNECT_TIMEOUT_S = 30.0  # the host binds its socket before its fronts start; this covers a slow start
# A pass that queued only buffered-audio reports (advisory: the scheduler's deadline hint, sent every 100 ms per
# request) flushes this much later, with whatever else comes by then: a front's turns send their chunks in many
# passes (each as its encoding comes back), and a frame (a pickle and a socket write) per pass per report is most of
# the link's cost per chunk. Anything else posted meanwhile flushes them at the end of its own pass.
REPORT_DELAY_S = 0.005


class _HostConnection(asyncio.Protocol):
    """The socket to the host: frames out at the end of each loop pass, frames in dispatched as they arrive."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ring: AudioRing | None):
        self.loop = loop
        self.ring = ring  # the link's audio ring (`gateway.link.ring`); None: the host sends audio inline
        self.transport: asyncio.Transport | None = None
        self.reader = wire.Reader()
        self.out: list[Any] = []
        self.flush_at_pass_end = False  # a flush is queued for the end of this pass (`post`)
        self.report_timer: asyncio.TimerHandle | None = None  # a flush for buffered-audio reports alone
        self.stamps: list[RemoteStream] = []  # requests in `out`: their send time is set when it leaves
        self.calls: dict[int, asyncio.Future] = {}
        self.call_ids = itertools.count()
        self.welcome: asyncio.Future[wire.Welcome] = loop.create_future()
        self.engine: RemoteEngine | None = None
        self.early: list[Any] = []  # state pushed before the engine was made
        self.closing = False
        self.closed: asyncio.Future[None] = loop.create_future()
        self.on_lost: Callable[[], None] | None = None

    # ---- out -----------------------------------------------------------------------------------------------
    def post(self, msg: Any) -> None:
        self.out.append(msg)
        if self.flush_at_pass_end:
            return
        if type(msg) is wire.Buffered:
            if self.report_timer is None:
                self.report_timer = self.loop.call_later(REPORT_DELAY_S, self.flush)
            return
        self.flush_at_pass_end = True
        self.loop.call_soon(self.flush)

    def stamp(self, stream: RemoteStream) -> None:
        self.stamps.append(stream)

    def flush(self) -> None:
        self.flush_at_pass_end = False
        if self.report_timer is not None:
            self.report_timer.cancel()
            self.report_timer = None
        out, self.out = self.out, []
        if not out or self.transport is None or self.transport.is_closing():
            return
        now = time.monotonic()
        try:
            data = wire.frame(out, now)
        except Exception:  # a call whose arguments cannot travel fails; the rest goes
            out, bad = wire.sendable(out)
            for msg, error in bad:
                fut = self.calls.get(msg.call) if type(msg) is wire.Call else None
                if fut is not None and not fut.done():
                    fut.set_exception(InvalidParameter(f"cannot send {msg.op} to the engine host: {error}"))
                else:
                    log.error("cannot send %s to the engine host: %s", type(msg).__name__, error)
            data = wire.frame(out, now)
        for stream in self.stamps:
            stream.sent_at = now
        self.stamps.clear()
        self.transport.write(data)

    async def call(self, target: str, op: str, *args: Any, **kwargs: Any) -> Any:
        """Run `target.op(*args, **kwargs)` at the host; its value, or its error raised here."""
        if self.transport is None or self.transport.is_closing():
            raise wire.HostLost("the link to the engine host is closed")
        call = next(self.call_ids)
        fut = self.calls[call] = self.loop.create_future()
        self.post(wire.Call(call, target, op, args, kwargs))
        try:
            return await fut
        finally:
            self.calls.pop(call, None)

    # ---- in ------------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        for _sent_at, messages in self.reader.feed(data):
            for msg in messages:
                try:
                    self.dispatch(msg)
                except Exception:  # a bug must cost one message, not the link
                    log.exception("handling %s from the engine host failed", type(msg).__name__)

    def dispatch(self, msg: Any) -> None:
        engine = self.engine
        if type(msg) is wire.Chunks:  # the hot path first
            msg = wire.with_audio(msg, self.ring)  # always, so the host gets its ring space back
            if engine is not None:
                engine.on_chunks(msg)
        elif type(msg) is wire.Reply:
            fut = self.calls.get(msg.call)
            if fut is not None and not fut.done():
                if msg.ok:
                    fut.set_result(msg.value)
                else:
                    fut.set_exception(msg.value)
        elif type(msg) is wire.Welcome:
            if not self.welcome.done():
                self.welcome.set_result(msg)
        elif engine is None:
            self.early.append(msg)
        elif type(msg) is wire.Failed:
            engine.on_failed(msg)
        elif type(msg) is wire.Voices:
            engine.on_voices(msg)
        elif type(msg) is wire.Status:
            engine.on_status(msg)
        else:
            log.warning("ignoring an unknown message from the engine host: %s", type(msg).__name__)

    def attach(self, engine: RemoteEngine) -> None:
        self.engine = engine
        early, self.early = self.early, []
        for msg in early:
            self.dispatch(msg)
        if self.closed.done():  # the host went away while the front was loading its tokenizer
            engine.on_lost(wire.HostLost("the engine host went away"))

    def connection_lost(self, exc: Exception | None) -> None:
        why = "the link was closed" if self.closing else f"the engine host went away ({exc or 'link closed'})"
        error = wire.HostLost(why)
        if not self.welcome.done():
            self.welcome.set_exception(error)
        for fut in self.calls.values():
            if not fut.done():
                fut.set_exception(error)
        if self.engine is not None:
            self.engine.on_lost(error)
        if not self.closed.done():
            self.closed.set_result(None)
        ring, self.ring = self.ring, None
        if ring is not None:
            ring.close()
        if not self.closing:
            log.error("%s: this front's streams end", why)
            if self.on_lost is not None:
                self.on_lost()

    async def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.flush()  # cancels and buffer reports queued in this pass still reach the host
            self.transport.close()
            await self.closed


class FrontLink:
    """A front's link to the engine host: `engine` (a `RemoteEngine`) and `store` (a `HostStore`). `on_lost` (set
    it, or pass it to `connect`) is called once if the host closes the link or dies, not on `close`."""

    def __init__(self, conn: _HostConnection, engine: RemoteEngine, store: HostStore, front: int):
        self._conn = conn
        self.engine, self.store, self.front = engine, store, front

    @property
    def on_lost(self) -> Callable[[], None] | None:
        return self._conn.on_lost

    @on_lost.setter
    def on_lost(self, callback: Callable[[], None] | None) -> None:
        self._conn.on_lost = callback

    @property
    def connected(self) -> bool:
        return not self._conn.closed.done()

    async def close(self) -> None:
        """Close the link: this front's requests are cancelled at the host (the engine keeps running)."""
        await self._conn.close()


def _load_model(path: str) -> tuple[ModelConfig, Tokenizer]:
    return ModelConfig.from_file(Path(path) / "config.json"), Tokenizer.from_dir(Path(path))


async def _open(loop: asyncio.AbstractEventLoop, path: str, deadline: float) -> _HostConnection:
    """Connect, take the audio ring the host hands over on the raw socket, then give the socket to asyncio."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    audio_ring = None
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, path)
        audio_ring = await asyncio.wait_for(ring.receive(sock), max(0.1, deadline - time.monotonic()))
        _, conn = await loop.create_unix_connection(lambda: _HostConnection(loop, audio_ring), sock=sock)
    except BaseException:
        if audio_ring is not None:
            audio_ring.close()
        sock.close()
        raise
    return conn


async def connect(path: str | os.PathLike, front: int, *, on_lost: Callable[[], None] | None = None,
                  timeout_s: float = CONNECT_TIMEOUT_S) -> FrontLink:
    """In a front process: connect to the host at `path` (retrying while it starts, up to `timeout_s`; `HostLost`
    after), load the model config and tokenizer from the path it announces, and mirror its state."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = await _open(loop, os.fspath(path), deadline)
            break
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError) as e:
            if time.monotonic() >= deadline:
                raise wire.HostLost(f"no engine host at {os.fspath(path)!r} after {timeout_s:g} s: {e}") from None
            await asyncio.sleep(0.05)
    conn.on_lost = on_lost
    try:
        conn.post(wire.Hello(front, os.getpid()))
        welcome = await asyncio.wait_for(asyncio.shield(conn.welcome), max(0.1, deadline - time.monotonic()))
        config, tokenizer = await asyncio.to_thread(_load_model, welcome.model_path)
    except BaseException:
        with contextlib.suppress(Exception):
            await conn.close()
        raise
    engine = RemoteEngine(welcome, config, tokenizer, conn.post, conn.stamp, conn.call, conn.close)
    conn.attach(engine)
    log.debug("front %d linked to the engine host (link %d)", front, welcome.link)
    return FrontLink(conn, engine, HostStore(conn.call, welcome.store_description), front)
