"""A released segment's engine request leaves from the handler of the message that released it, not from the turn's
synthesis task: through a task it waited behind every other ready callback, which in a burst of new turns is every
other session's message handling (~6 ms of the gateway's TTFB share at 64 sessions). `Engine.generate` sends it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest

from engine import ipc
from gateway import protocol as p
from gateway.session import Session

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


class Events:
    """One ordered log for the engine (submissions) and the sink (messages sent)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []


@contextlib.contextmanager
def submits_logged(engine: Any, events: Events) -> Iterator[None]:
    """The real engine, its submissions (the `ipc.Add` messages `generate` posts for its worker) logged."""
    post = engine._post

    def logged(worker: Any, msg: ipc.Command) -> None:
        if isinstance(msg, ipc.Add):
            events.log.append(("submit", msg.spec.request_id.split(":")[1]))  # the context id
        post(worker, msg)

    engine._post = logged
    try:
        yield
    finally:
        del engine._post  # the class's method again


class Sink:
    """The session's EventSink: the messages it emits go to the shared log."""

    def __init__(self, events: Events):
        self.events = events
        self.done: dict[str, asyncio.Event] = {}

    async def message(self, msg: p.ServerMessage) -> None:
        self.events.log.append((msg.TYPE, getattr(msg, "context_id", "")))
        if isinstance(msg, p.ContextDone):
            self.done.setdefault(msg.context_id, asyncio.Event()).set()

    async def audio(self, packets: p.AudioPackets) -> None:
        pass

    async def close(self, code: int, reason: str) -> None:
        pass

    def abort(self) -> None:
        pass


async def test_each_turn_is_submitted_before_the_next_message_is_handled(engine):
    events = Events()
    sink = Sink(events)
    with submits_logged(engine, events):
        session = Session(engine, sink)
        session.open()
        await session.receive(json.dumps({"type": "session.start", "output": {"format": "pcm_s16le"},
                                          "generation": {"seed": 3}}))
        # two new turns handled back to back, as a burst of messages is: no task runs in between. The text's first
        # clause is a segment as soon as it arrives (the next word follows its comma).
        for cid in ("a", "b"):
            await session.receive(json.dumps({"type": "text.append", "context_id": cid,
                                              "text": "Hello there, how are you today?"}))
            await session.receive(json.dumps({"type": "context.end", "context_id": cid}))
        log = list(events.log)
        for cid in ("a", "b"):
            sink.done.setdefault(cid, asyncio.Event())
            await asyncio.wait_for(sink.done[cid].wait(), 60)
        await session.close()
    # turn a's request was out before turn b's message was handled (b's context.started is sent by its handler),
    # and each turn's request went out before its own context.started
    assert log.index(("submit", "a")) < log.index(("context.started", "a")) < log.index(("submit", "b")) \
        < log.index(("context.started", "b")), log


class Recorded:
    """The real engine; the streams `generate` returned are kept, and whether each was closed."""

    def __init__(self, engine: Any):
        self._engine = engine
        self.streams: list[_Closable] = []

    def generate(self, text: str, **kwargs: Any) -> Any:
        self.streams.append(_Closable(self._engine.generate(text, **kwargs)))
        return self.streams[-1]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class _Closable:
    def __init__(self, stream: Any):
        self._stream, self.closed = stream, False

    def __aiter__(self) -> _Closable:
        return self

    async def __anext__(self) -> Any:
        return await self._stream.__anext__()

    async def aclose(self) -> None:
        self.closed = True
        await self._stream.aclose()


async def test_a_request_started_by_a_handler_is_closed_when_its_turn_stops_unread(engine):
    events = Events()
    recorded = Recorded(engine)
    session = Session(recorded, Sink(events))
    session.open()
    await session.receive(json.dumps({"type": "session.start", "output": {"format": "pcm_s16le"}}))
    await session.receive(json.dumps({"type": "text.append", "context_id": "a",
                                      "text": "Hello there, how are you today?"}))
    assert len(recorded.streams) == 1  # out from the handler; the turn's synthesis task has not run yet
    await session.receive(json.dumps({"type": "context.cancel", "context_id": "a"}))
    assert recorded.streams[0].closed and engine.stats().in_flight == 0
    assert ("context.cancelled", "a") in events.log
    await session.close()
    for _ in range(200):  # the worker drops what it admitted
        if not engine.stats().running and not engine.stats().waiting:
            break
        await asyncio.sleep(0.02)
    assert (engine.stats().running, engine.stats().waiting) == (0, 0)
