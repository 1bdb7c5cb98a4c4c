"""One request in flight as the caller sees it: a queue of chunks the pool fills, and the iterator that drains it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from engine.api import AudioChunk

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.registries import LoRAEntry
    from engine.specs import RequestSpec
    from engine.worker_handle import WorkerHandle


class ChunkSink(Protocol):
    """Where a request's chunks go: an `asyncio.Queue`, or a gateway front's relay (`gateway.link`)."""

    def put_nowait(self, item: AudioChunk | BaseException | None) -> None:
        """A chunk, the request's error, or None (cancelled)."""
        ...


@dataclass
class Stream:
    """The pool's side of a request: its worker, its adapter and the queue its chunks (or its error) go to;
    `None` on the queue means cancelled."""

    request_id: str
    worker: WorkerHandle
    queue: ChunkSink = field(default_factory=asyncio.Queue)
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

    def _queue(self) -> asyncio.Queue:
        raise NotImplementedError

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

    def _queue(self) -> asyncio.Queue:
        return cast(asyncio.Queue, self._stream.queue)

    async def _send_first(self) -> None:
        await self._engine._submit(self._stream, self._spec, self._args, self._audio)

    def _cancel(self) -> None:
        self._engine._cancel_nowait(self._stream.request_id, self._stream)

    def __del__(self) -> None:
        if not self._finished and not self._engine.loop.is_closed():
            self._engine.loop.call_soon_threadsafe(self._engine._cancel_nowait, self._stream.request_id, self._stream)
