"""One request in flight as the caller sees it: a queue of chunks the pool fills, and the iterator that drains it."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from engine.api import AudioChunk

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.registries import LoRAEntry
    from engine.specs import RequestSpec
    from engine.worker_handle import WorkerHandle


class ChunkSink(Protocol):
    """Where a request's chunks go: a `ChunkQueue`, or a gateway front's relay (`gateway.link`)."""

    def put_nowait(self, item: AudioChunk | BaseException | None) -> None:
        """A chunk, the request's error, or None (cancelled)."""
        ...


_Item = AudioChunk | BaseException | None
FirstChunkHook = Callable[[AudioChunk], None]


class ChunkQueue:
    """A request's chunks (or its error, or None when cancelled) on their way to the one task that reads them: what
    `ChunkIterator` uses of `asyncio.Queue` (`put_nowait`, `get`), unbounded and with one reader. A chunk that comes
    while the reader waits is handed to it directly: one future and one wakeup a chunk, and no coroutine nor
    asyncio.Queue's bookkeeping for bounds, joins and many getters.

    `first_hook` (`ChunkIterator.on_next_chunk`) sees the next item put, if a chunk, synchronously in the engine's
    callback that delivers it (and so with the rest of its step's chunks), before its reader wakes; then it is
    dropped."""

    __slots__ = ("_items", "_waiter", "first_hook")

    def __init__(self) -> None:
        self._items: deque[_Item] = deque()
        self._waiter: asyncio.Future[_Item] | None = None
        self.first_hook: FirstChunkHook | None = None

    def put_nowait(self, item: _Item) -> None:
        hook = self.first_hook
        if hook is not None:
            self.first_hook = None
            if type(item) is AudioChunk:
                hook(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # done: its reader was cancelled
                waiter.set_result(item)
                return
        self._items.append(item)

    def get(self) -> asyncio.Future[_Item]:
        """The next item, to await: at once if one is here, else when it comes."""
        fut: asyncio.Future[_Item] = asyncio.get_running_loop().create_future()
        if self._items:
            fut.set_result(self._items.popleft())
        else:
            self._waiter = fut
        return fut

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)


@dataclass
class Stream:
    """The pool's side of a request: its worker, its adapter and the queue its chunks (or its error) go to;
    `None` on the queue means cancelled."""

    request_id: str
    worker: WorkerHandle
    queue: ChunkSink = field(default_factory=ChunkQueue)
    done: bool = False
    lora: LoRAEntry | None = None
    tenant: str | None = None  # the tenant whose queued prompt it counts as until its first audio (then None)


class ChunkIterator(AsyncIterator[AudioChunk]):
    """Drains one request's queue of chunks (`Generation`, and a gateway front's `RemoteGeneration`): None on the
    queue ends it (cancelled), an exception is raised; an error while waiting, closing it or dropping it cancels
    the request (`_cancel`). `_send_first` runs once before the first read while `_unsent` is set."""

    _finished = False
    _unsent = False

    def __aiter__(self) -> ChunkIterator:
        return self

    def _queue(self) -> ChunkQueue:
        raise NotImplementedError

    def on_next_chunk(self, hook: FirstChunkHook | None) -> bool:
        """Have `hook(chunk)` called with the request's next chunk as the engine delivers it, before this iterator's
        reader wakes (None: drop a hook set before). False (and no hook set): a chunk or the end is already here,
        so the next read does not wait."""
        queue = self._queue()
        if hook is not None and not queue.empty():
            return False
        queue.first_hook = hook
        return True

    async def _send_first(self) -> None:
        raise NotImplementedError

    def _cancel(self) -> None:
        raise NotImplementedError

    async def __anext__(self) -> AudioChunk:
        if self._finished:
            raise StopAsyncIteration
        try:
            if self._unsent:
                self._unsent = False
                await self._send_first()
            item = await self._queue().get()
        except BaseException:
            self._close()
            raise
        if item is None:  # cancelled
            self._finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        if item.is_last:
            self._finished = True
        return item

    async def aclose(self) -> None:
        """Cancel the request unless it already finished."""
        self._close()

    def _close(self) -> None:
        if not self._finished:
            self._finished = True
            self._cancel()


class Generation(ChunkIterator):
    """The async iterator `Engine.generate` returns (its request already sent, or sent on first use when audio must
    be encoded first or the worker is not up yet); closing it (or dropping it) cancels."""

    def __init__(self, engine: Engine, stream: Stream, spec: RequestSpec | None, args: dict | None,
                 audio: tuple[Any, Any, int | None], submitted: bool = False):
        self._engine, self._stream, self._spec, self._args, self._audio = engine, stream, spec, args, audio
        self._unsent = not submitted  # False: `Engine.generate` sent the request already

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    def _queue(self) -> ChunkQueue:
        return cast(ChunkQueue, self._stream.queue)

    async def _send_first(self) -> None:
        await self._engine._submit(self._stream, self._spec, self._args, self._audio)

    def _cancel(self) -> None:
        self._engine._cancel_nowait(self._stream.request_id, self._stream)

    def __del__(self) -> None:
        if not self._finished and not self._engine.loop.is_closed():
            self._engine.loop.call_soon_threadsafe(self._engine._cancel_nowait, self._stream.request_id, self._stream)
