"""A released segment's engine request leaves from the handler of the message that released it, not from the turn's
synthesis task: through a task it waited behind every other ready callback, which in a burst of new turns is every
other session's message handling (~6 ms of the gateway's TTFB share at 64 sessions). `StartedNow` takes an
awaitable's first step on the spot and lets one task await the rest."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gateway.session import Session, StartedNow

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


class Events:
    """One ordered log for the engine (submissions) and the transport (messages sent)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []


class SubmitLog:
    """The real engine; the first read of each stream (which is what submits its request) is logged."""

    def __init__(self, engine: Any, events: Events):
        self._engine, self._events = engine, events

    def generate(self, text: str, **kwargs: Any) -> Any:
        return _LoggedStream(self._engine.generate(text, **kwargs), kwargs["request_id"], self._events)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class _LoggedStream:
    def __init__(self, stream: Any, request_id: str, events: Events):
        self._stream, self._rid, self._events, self._first = stream, request_id, events, True

    def __aiter__(self) -> _LoggedStream:
        return self

    async def __anext__(self) -> Any:
        if self._first:
            self._first = False
            self._events.log.append(("submit", self._rid.split(":")[1]))  # the context id
        return await self._stream.__anext__()

    async def aclose(self) -> None:
        await self._stream.aclose()


class Transport:
    def __init__(self, events: Events):
        self.events = events
        self.done: dict[str, asyncio.Event] = {}

    async def send_text(self, data: str) -> None:
        msg = json.loads(data)
        self.events.log.append((msg["type"], msg.get("context_id", "")))
        if msg["type"] == "context.done":
            self.done.setdefault(msg["context_id"], asyncio.Event()).set()

    async def send_bytes(self, data: bytes) -> None:
        pass

    async def close(self, code: int, reason: str) -> None:
        pass

    def abort(self) -> None:
        pass


async def test_each_turn_is_submitted_before_the_next_message_is_handled(engine):
    events = Events()
    transport = Transport(events)
    session = Session(SubmitLog(engine, events), transport)
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
        transport.done.setdefault(cid, asyncio.Event())
        await asyncio.wait_for(transport.done[cid].wait(), 60)
    await session.close()
    # turn a's request was out before turn b's message was handled (b's context.started is sent by its handler),
    # and each turn's request went out before its own context.started
    assert log.index(("submit", "a")) < log.index(("context.started", "a")) < log.index(("submit", "b")) \
        < log.index(("context.started", "b")), log


async def test_started_now_takes_the_first_step_on_the_spot():
    steps: list[str] = []
    gate = asyncio.Event()

    async def work() -> str:
        steps.append("first")
        await gate.wait()
        steps.append("rest")
        return "done"

    started = StartedNow(work())
    assert steps == ["first"]  # before any task ran
    waiter = asyncio.create_task(_await(started))
    await asyncio.sleep(0)
    assert steps == ["first"] and not waiter.done()
    gate.set()
    assert await waiter == "done" and steps == ["first", "rest"]


async def test_started_now_that_finished_or_failed_on_the_spot():
    async def value() -> int:
        return 7

    async def empty() -> None:
        raise StopAsyncIteration

    assert await StartedNow(value()) == 7
    with pytest.raises(StopAsyncIteration):
        await StartedNow(empty())


async def test_started_now_passes_cancellation_and_close_to_the_awaitable():
    seen: list[str] = []

    async def work() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        except GeneratorExit:
            seen.append("closed")
            raise

    waiter = asyncio.create_task(_await(StartedNow(work())))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    abandoned = StartedNow(work())
    abandoned.close()
    assert seen == ["cancelled", "closed"]


async def _await(awaitable: Any) -> Any:
    return await awaitable
