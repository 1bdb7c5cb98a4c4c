"""`EngineHost`: one started `Engine` and one `Store` served to gateway front processes over a unix socket.

A front sends `RequestSpec`s it built itself (`gateway.link.remote_engine`); the host admits each into the pool
(`Engine.submit_spec`: the pool still picks the worker and counts tenants' queued prompts and adapter users) with a
relay as its chunk sink. There is no task per request: the pool hands the relay each chunk of a worker step in one
callback, the relay appends it to its front's pending `Chunks` (a dict lookup, done by the pool, and an append), and
each front's pending messages leave as one frame at the end of that pass of the loop; the step's audio goes into
the front's shared-memory ring (`gateway.link.ring`), so the frame carries its span, not ~1 MB of samples. The
host stamps when it got each request and each first chunk, so a front can tell the link's share of its time to
first audio.

Stored voices and adapters are changed here for every front: adding a voice id (or registering an adapter name)
again with the same content is a no-op, serialised per id, so fronts that load the same stored item at once do not
fail or store it twice. Every change is pushed to every front before the call that made it returns, and the
engine's stats every `STATUS_S`. A voice being created (added while the store has no record of it) is pushed to its
creator's front alone until its record is stored: to another front an engine voice that no record names would be an
operator's, shared with every key (`gateway.voices`). Should its creator go away first, it leaves the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import stat
import time
from collections.abc import AsyncIterator
from typing import Any

from engine.api import AudioChunk
from engine.engine import Engine
from engine.errors import EngineError
from engine.generation import Stream
from engine.ipc import AudioRing
from engine.registries import Voice
from gateway.link import ring, wire
from gateway.link.same_content import content_digest, same_voice
from gateway.store.base import Item, Store, StoreUnavailable
from gateway.voices import VOICE

log = logging.getLogger("voxgate.link")

STATUS_S = 0.1  # how often every front gets the engine's stats (its /readyz and /metrics read them)
# a front that reads nothing of what is queued for it this long is wedged: its link is cut (its requests freed) so
# the host does not queue its audio without bound (a healthy front takes even a 1 GiB blob in a second or two)
STALL_S = 30.0


class _Relay:
    """The chunk sink of one front's request: chunks to its front's pending `Chunks`, an error as `Failed`."""

    __slots__ = ("front", "request_id", "got_at")

    def __init__(self, front: _FrontConnection, request_id: str, got_at: float):
        self.front, self.request_id, self.got_at = front, request_id, got_at

    def put_nowait(self, item: AudioChunk | BaseException | None) -> None:
        front = self.front
        if type(item) is AudioChunk:
            batch = front.chunks if front.chunks is not None else front.new_chunks()
            first = None
            if self.got_at:  # the request's first chunk: when the host got it, and when it got the request
                first, self.got_at = (self.got_at, time.monotonic()), 0.0
            batch.append((self.request_id, item.audio, item.index, item.latents, item.is_last, item.stop_reason,
                          item.step, first))
            if item.is_last:
                front.requests.pop(self.request_id, None)
        elif item is None:  # cancelled (by the front, or by the host's close)
            front.requests.pop(self.request_id, None)
        else:
            front.requests.pop(self.request_id, None)
            front.post(wire.Failed(self.request_id, wire.portable(item)))


class _FrontConnection(asyncio.Protocol):
    """One front's socket at the host, and the requests it holds."""

    def __init__(self, host: EngineHost, number: int, ring: AudioRing | None):
        self.host, self.number = host, number
        self.ring = ring  # the front's audio ring (`gateway.link.ring`); None: its audio travels inline
        self.prefix = f"{number}/"  # request ids are the front's own; the pool's are namespaced per link
        self.front: int | None = None  # the number the front gave in its hello
        self.transport: asyncio.Transport | None = None
        self.reader = wire.Reader()
        self.out: list[Any] = []
        self.chunks: list[wire.ChunkRow] | None = None  # this pass's chunks, in `out` (packed when it leaves)
        self.requests: dict[str, Stream] = {}  # the front's request id -> its stream in the pool
        self.paused_at: float | None = None  # since when the socket's buffer is over its high-water mark
        self.mirrored: dict[str, Voice] = {}  # the stored voices this front mirrors now

    def post(self, msg: Any) -> None:
        if not self.out:
            self.host.loop.call_soon(self.flush)
        self.out.append(msg)

    def new_chunks(self) -> list[wire.ChunkRow]:
        self.chunks = []
        self.post(self.chunks)
        return self.chunks

    def flush(self) -> None:
        out, self.out, chunks, self.chunks = self.out, [], self.chunks, None
        if not out or self.transport is None or self.transport.is_closing():
            return
        if chunks is not None:
            out = [wire.pack_chunks(chunks, self.ring) if m is chunks else m for m in out]
        try:
            data = wire.frame(out, time.monotonic())
        except Exception:  # a reply that cannot travel (too large, not picklable): its call fails, the rest goes
            out, bad = wire.sendable(out)
            for msg, error in bad:
                log.error("link %d: cannot send %s: %s", self.number, type(msg).__name__, error)
                if type(msg) is wire.Reply:
                    out.append(wire.Reply(msg.call, False, EngineError(f"the answer cannot be sent: {error}")))
            data = wire.frame(out, time.monotonic())
        self.transport.write(data)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.host._links[self.number] = self

    def data_received(self, data: bytes) -> None:
        got_at = time.monotonic()
        for _sent_at, messages in self.reader.feed(data):
            for msg in messages:
                try:
                    self.host._on_message(self, msg, got_at)
                except Exception:  # a bug must cost one message, not every turn of the front
                    log.exception("link %d: %s failed", self.number, type(msg).__name__)
                    if type(msg) is wire.Submit:
                        self.post(wire.Failed(msg.spec.request_id.removeprefix(self.prefix),
                                              EngineError("the engine host could not take the request")))

    def pause_writing(self) -> None:
        self.paused_at = time.monotonic()

    def resume_writing(self) -> None:
        self.paused_at = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.host._drop(self)
        self.close_ring()

    def close_ring(self) -> None:
        ring, self.ring = self.ring, None
        if ring is not None:
            ring.close()


class EngineHost:
    """In the host process: serves one started `Engine` and one `Store` to front processes over a unix socket."""

    def __init__(self, engine: Engine, store: Store, path: str | os.PathLike, *, fronts: int = 1,
                 ring_s: float = ring.RING_S):
        """`fronts`: how many fronts will share the engine (sizes each one's audio ring); `ring_s`: seconds of
        audio per stream a ring holds (0: no rings, every step's audio travels inline)."""
        self.engine, self.store, self.path = engine, store, os.fspath(path)
        self._ring_floats = ring.ring_floats(engine.config.sample_rate, engine.max_num_seqs, fronts, ring_s)
        self.loop = asyncio.get_running_loop()
        self._links: dict[int, _FrontConnection] = {}  # every connection; a front's once it said hello
        self._numbers = itertools.count(1)
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task | None = None
        self._ticker: asyncio.Task | None = None
        self._calls: set[asyncio.Task] = set()
        self._revision = -1
        self._creating: dict[str, int] = {}  # voice id -> the link creating it, until its record is stored
        self._locks: dict[tuple[str, str], tuple[asyncio.Lock, list[int]]] = {}  # the lock, its users
        self._registered: dict[str, bytes] = {}  # adapter name -> the digest of what it was registered with here

    async def start(self) -> None:
        """Listen on the socket (mode 0600; its directory should be private to the service too)."""
        self._sync()
        with contextlib.suppress(FileNotFoundError):  # a socket left by a host that died
            if stat.S_ISSOCK(os.stat(self.path).st_mode):
                os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.path)
            os.chmod(self.path, 0o600)
            listener.listen(socket.SOMAXCONN)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._acceptor = asyncio.create_task(self._accept(listener))
        self._ticker = asyncio.create_task(self._tick())

    async def _accept(self, listener: socket.socket) -> None:
        """Take each front's connection: hand it its audio ring on the raw socket, then to asyncio."""
        while True:
            sock, _ = await self.loop.sock_accept(listener)
            audio_ring = None
            try:
                audio_ring = ring.offer(sock, self._ring_floats)
                await self.loop.connect_accepted_socket(
                    lambda r=audio_ring: _FrontConnection(self, next(self._numbers), r), sock)
            except Exception as e:  # the front went away at once; the next one is still accepted
                log.log(logging.DEBUG if isinstance(e, OSError) else logging.ERROR,
                        "a front's connection failed before it linked: %s", e)
                if audio_ring is not None:
                    audio_ring.close()
                sock.close()

    def fronts(self) -> int:
        """Fronts connected now (that said hello)."""
        return len(self._fronts())

    async def close(self) -> None:
        """Cancel every request the fronts hold, close their links, stop listening and remove the socket."""
        if self._ticker is not None:
            self._ticker.cancel()
        if self._acceptor is not None:
            self._acceptor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._acceptor
        if self._listener is not None:
            self._listener.close()
        for conn in list(self._links.values()):
            self._drop(conn)
            if conn.transport is not None:
                conn.flush()
                conn.transport.close()
            conn.close_ring()
        for task in list(self._calls):
            task.cancel()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    # ---- messages ------------------------------------------------------------------------------------------
    def _on_message(self, conn: _FrontConnection, msg: Any, got_at: float) -> None:
        t = type(msg)
        if t is wire.Submit:
            self._submit(conn, msg.spec, got_at)
        elif t is wire.Buffered:
            stream = conn.requests.get(msg.request_id)
            if stream is not None:
                self.engine.update_buffered(stream.request_id, msg.audio_ms)
        elif t is wire.Cancel:
            stream = conn.requests.pop(msg.request_id, None)
            if stream is not None:
                self.engine.release(stream)
        elif t is wire.Call:
            task = asyncio.create_task(self._call(conn, msg))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)
        elif t is wire.Hello:
            self._sync()  # pushed to the other fronts; this one gets the whole state with its welcome
            conn.front = msg.front
            conn.mirrored = self._visible(self.engine.stored_voices(), conn)
            conn.post(wire.Welcome(conn.number, str(self.engine.path), str(self.engine.name),
                                   self.engine.default_timesteps, self.engine.sampling_ranges,
                                   self.store.description, self._status(),
                                   [_mirror(v) for v in conn.mirrored.values()]))
            log.info("front %d linked (pid %d)", msg.front, msg.pid)
        else:
            log.warning("link %d: ignoring an unknown message %s", conn.number, t.__name__)

    def _submit(self, conn: _FrontConnection, spec: Any, got_at: float) -> None:
        request_id = spec.request_id
        spec.request_id = conn.prefix + request_id
        try:
            stream = self.engine.submit_spec(spec, _Relay(conn, request_id, got_at))
        except EngineError as e:
            conn.post(wire.Failed(request_id, wire.portable(e)))
            return
        conn.requests[request_id] = stream

    def _drop(self, conn: _FrontConnection) -> None:
        """The front went away (or the host closes): free everything it held in the pool."""
        if self._links.pop(conn.number, None) is not None and conn.front is not None:
            log.info("front %d unlinked", conn.front)
        requests, conn.requests = conn.requests, {}
        for stream in requests.values():
            self.engine.release(stream)
        abandoned = [voice_id for voice_id, link in self._creating.items() if link == conn.number]
        if abandoned:
            task = asyncio.create_task(self._abandon(abandoned, conn.number))
            self._calls.add(task)  # (cancelled by `close`)
            task.add_done_callback(self._calls.discard)

    # ---- calls ---------------------------------------------------------------------------------------------
    async def _call(self, conn: _FrontConnection, msg: wire.Call) -> None:
        try:
            if msg.target == "engine" and msg.op in wire.ENGINE_CALLS:
                value = await self._engine_call(conn, msg.op, msg.args, msg.kwargs)
            elif msg.target == "store" and msg.op in wire.STORE_CALLS:
                value = await getattr(self.store, msg.op)(*msg.args, **msg.kwargs)
                if msg.op == "put":
                    self._stored(msg.args[0])
            else:
                raise EngineError(f"no link call {msg.target}.{msg.op}")
            ok = True
        except Exception as e:
            ok, value = False, wire.portable(e)
        if msg.target == "engine":
            self._sync()  # every front sees the change before the caller's call returns
        conn.post(wire.Reply(msg.call, ok, value))

    async def _engine_call(self, conn: _FrontConnection, op: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        if op == "add_voice" and kwargs.get("voice_id") is not None:
            return await self._add_voice(conn, kwargs)
        if op == "register_lora":
            return await self._register_lora(*args, **kwargs)
        value = await getattr(self.engine, op)(*args, **kwargs)
        if op == "unregister_lora":
            self._registered.pop(args[0], None)
        elif op == "remove_voice":
            self._creating.pop(args[0], None)
        return value

    async def _add_voice(self, conn: _FrontConnection, kwargs: dict[str, Any]) -> str:
        """`Engine.add_voice`, one at a time per voice id; a no-op when the engine already has that voice with the
        same patches, text and adapter (two fronts loading one stored voice at once). A voice new to the engine that
        the store has no record of is being created: `conn`'s alone until its record is stored (`_stored`)."""
        voice_id = kwargs["voice_id"]
        async with self._lock((VOICE, voice_id)):
            v = self.engine.stored_voices().get(voice_id)
            if self._creating.get(voice_id, conn.number) != conn.number:
                # another front loads it, so it read its record (the store could not say when the voice came here)
                del self._creating[voice_id]
                self._sync(force=True)
            if v is not None and kwargs.get("audio") is None and same_voice(v, kwargs):
                return voice_id
            if v is None and not await self._recorded(voice_id):
                self._creating[voice_id] = conn.number  # before the engine has it: no push may show it to others
            try:
                return await self.engine.add_voice(**kwargs)
            except BaseException:
                if voice_id not in self.engine.stored_voices():
                    self._creating.pop(voice_id, None)
                raise

    async def _recorded(self, voice_id: str) -> bool:
        """Whether the store holds a record of the voice (when it cannot say: no, so a new voice stays private)."""
        try:
            return await self.store.get(VOICE, voice_id) is not None
        except StoreUnavailable:
            return False

    def _stored(self, item: Item) -> None:
        """A record was stored: a voice being created under its id is every front's now (pushed before the put's
        reply, so its creator's call returns with every front mirroring the voice)."""
        if item.kind == VOICE and self._creating.pop(item.id, None) is not None:
            self._sync(force=True)

    async def _abandon(self, voice_ids: list[str], link: int) -> None:
        """The link creating these voices went away before storing their records: one the store has no record of
        leaves the engine (no key may use it); one whose record was stored meanwhile is every front's."""
        for voice_id in voice_ids:
            async with self._lock((VOICE, voice_id)):
                if self._creating.get(voice_id) != link:
                    continue
                try:
                    if not await self._recorded(voice_id) and voice_id in self.engine.stored_voices():
                        await self.engine.remove_voice(voice_id)  # (a record stored after all loads it again)
                        log.info("voice %s left the engine: its creator went away before storing it", voice_id)
                except EngineError as e:
                    log.error("cannot remove the abandoned voice %s: %s", voice_id, e)
                finally:
                    self._creating.pop(voice_id, None)
        self._sync(force=True)

    async def _register_lora(self, name: str, source: Any, config: dict[str, Any] | None = None) -> Any:
        """`Engine.register_lora`, one at a time per name; a no-op when the host registered that name with the same
        weights and config (two fronts loading one stored adapter at once)."""
        digest = await asyncio.to_thread(content_digest, (source, config))
        async with self._lock(("lora", name)):
            info = next((i for i in self.engine.list_loras() if i.name == name), None)
            if info is not None and self._registered.get(name) == digest:
                return info
            info = await self.engine.register_lora(name, source, config)
            self._registered[name] = digest
            return info

    @contextlib.asynccontextmanager
    async def _lock(self, key: tuple[str, str]) -> AsyncIterator[None]:
        """One change at a time per voice id or adapter name (the lock goes when nobody holds or waits for it)."""
        entry = self._locks.setdefault(key, (asyncio.Lock(), [0]))
        entry[1][0] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1][0] -= 1
            if not entry[1][0]:
                del self._locks[key]

    # ---- pushed state --------------------------------------------------------------------------------------
    def _status(self) -> wire.Status:
        e = self.engine
        return wire.Status(e.model_info(), e.stats(), e.health(), e.list_loras(), e.kv_positions())

    def _sync(self, force: bool = False) -> None:
        """Push what changed in the stored voices and adapters since the last push to every front (`force`: also
        when only who sees a voice changed)."""
        if self.engine.revision == self._revision and not force:
            return
        self._revision = self.engine.revision
        now = self.engine.stored_voices()
        status = self._status()
        for conn in self._fronts():
            seen = self._visible(now, conn)
            put = [_mirror(v) for vid, v in seen.items() if conn.mirrored.get(vid) is not v]
            gone = [vid for vid in conn.mirrored if vid not in seen]
            conn.mirrored = seen
            conn.post(wire.Voices(put, gone))
            conn.post(status)

    def _visible(self, voices: dict[str, Voice], conn: _FrontConnection) -> dict[str, Voice]:
        """The stored voices `conn`'s front mirrors: all but those another front is creating."""
        if not self._creating:
            return voices
        return {vid: v for vid, v in voices.items() if self._creating.get(vid, conn.number) == conn.number}

    def _fronts(self) -> list[_FrontConnection]:
        return [c for c in self._links.values() if c.front is not None]

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(STATUS_S)
            if not self._links:
                continue
            now = time.monotonic()
            for conn in list(self._links.values()):
                if conn.paused_at is not None and now - conn.paused_at > STALL_S and conn.transport is not None:
                    log.error("link %d (front %s) read nothing for %.0f s: cutting it", conn.number, conn.front,
                              now - conn.paused_at)
                    conn.transport.abort()
            try:
                self._sync()  # voices or adapters changed in this process directly (the start-up restore)
                status = self._status()
            except Exception:  # a stopped engine: the fronts keep the last status
                log.debug("engine status unavailable", exc_info=True)
                continue
            for conn in self._fronts():
                conn.post(status)


def _mirror(v: Voice) -> wire.MirrorVoice:
    return wire.MirrorVoice(v.info, v.latents, v.text, v.shared_prefix)
