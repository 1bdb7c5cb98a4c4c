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
from gateway.text.segmenter import Segmenter

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
        assert [e for e in events.log if e[0] == "submit"] == [("submit", "a"), ("submit", "b")], events.log
        for cid in ("a", "b"):
            sink.done.setdefault(cid, asyncio.Event())
            await asyncio.wait_for(sink.done[cid].wait(), 60)
        await session.close()
    log = events.log
    # turn a's request was out before turn b's message was handled, and both before either context.started: that
    # waits for the loop's low-priority lane (`gateway.loop_lanes`), in the turns' order
    assert log.index(("submit", "a")) < log.index(("submit", "b")) < log.index(("context.started", "a")) \
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


class Said(Sink):
    """The session's EventSink: also each segment.started's text and each text.flushed, in order, per turn."""

    def __init__(self, events: Events):
        super().__init__(events)
        self.said: dict[str, list[str]] = {}
        self.cancelled: dict[str, p.ContextCancelled] = {}

    async def message(self, msg: p.ServerMessage) -> None:
        if isinstance(msg, p.SegmentStarted):
            self.said.setdefault(msg.context_id, []).append(msg.text)
        elif isinstance(msg, p.TextFlushed):
            self.said.setdefault(msg.context_id, []).append(f"<flushed {msg.flush_id}>")
        elif isinstance(msg, p.ContextCancelled):
            self.cancelled[msg.context_id] = msg
        await super().message(msg)


PARAGRAPH = ("Sure thing, the quickest way is to restart the router first. Unplug it and wait about thirty seconds "
             "before you plug it back in. Once the lights settle you can connect again.")


async def test_a_new_turns_later_segments_are_cut_after_the_handlers_ready_now_in_order(engine):
    events = Events()
    recorded = Recorded(engine)
    sink = Said(events)
    session = Session(recorded, sink)
    session.open()
    await session.receive(json.dumps({"type": "session.start", "output": {"format": "pcm_s16le"},
                                      "generation": {"max_length": 2}}))
    # a burst: two new turns' paragraphs and ends, handled back to back (no callback runs in between)
    for cid in ("a", "b"):
        await session.receive(json.dumps({"type": "text.append", "context_id": cid, "text": PARAGRAPH}))
        await session.receive(json.dumps({"type": "context.end", "context_id": cid}))
    # each handler cut and started its turn's first segment only
    assert len(recorded.streams) == 2
    assert [len(session.turns[cid].segmenter.segments) for cid in ("a", "b")] == [1, 1]
    # the held-back cuts, then the ends queued behind them: soon after (the lane runs them on the loop's next turns)
    for _ in range(20):
        if all(session.turns[cid].segmenter.ended for cid in ("a", "b")):
            break
        await asyncio.sleep(0)
    assert all(session.turns[cid].segmenter.ended for cid in ("a", "b"))
    for cid in ("a", "b"):
        sink.done.setdefault(cid, asyncio.Event())
        await asyncio.wait_for(sink.done[cid].wait(), 60)
    await session.close()
    # every segment spoken once, in order: the whole paragraph, as one push would have cut it
    whole = Segmenter(normalize="auto")
    expected = [s.speak() for s in whole.push(PARAGRAPH) + whole.end()]
    assert len(expected) > 2 and sink.said == {"a": expected, "b": expected}


async def test_a_turn_stopped_before_its_held_back_cuts_releases_nothing_more(engine):
    events = Events()
    recorded = Recorded(engine)
    sink = Said(events)
    session = Session(recorded, sink)
    session.open()
    await session.receive(json.dumps({"type": "session.start", "output": {"format": "pcm_s16le"}}))
    more = " Then call us back."
    for message in ({"type": "text.append", "context_id": "a", "text": PARAGRAPH},
                    {"type": "text.append", "context_id": "a", "text": more},  # queued behind the held-back cuts
                    {"type": "context.cancel", "context_id": "a"}):
        await session.receive(json.dumps(message))
    await asyncio.sleep(0)  # where the held-back cuts would have run
    await asyncio.sleep(0.05)
    cancelled = session.finished["a"]
    # nothing more released or requested: the first segment's stream closed, the rest cut in the segmenter alone
    assert cancelled.segments.empty() and len(recorded.streams) == 1 and recorded.streams[0].closed
    assert engine.stats().in_flight == 0 and ("context.done", "a") not in events.log
    whole = Segmenter(normalize="auto")
    assert [s.text for s in cancelled.segmenter.segments] == [s.text for s in whole.push(PARAGRAPH) + whole.push(more)]
    # and the cancel reports all of the turn's text as not heard, both appends
    assert sink.cancelled["a"].text_spoken == ""
    assert sink.cancelled["a"].text_remaining == " ".join(s.text for s in whole.segments) + " " + whole.pending_text
    await session.close()


async def test_messages_behind_held_back_cuts_keep_their_order(engine):
    events = Events()
    sink = Said(events)
    session = Session(engine, sink)
    session.open()
    await session.receive(json.dumps({"type": "session.start", "output": {"format": "pcm_s16le"},
                                      "generation": {"max_length": 2, "normalize": "off"}}))
    # all in one pass: the first text's later cuts are held back, the flush, the next text and the end wait for them
    for message in ({"type": "text.append", "context_id": "a", "text": "One two three, four five six, seven eight "},
                    {"type": "text.flush", "context_id": "a", "flush_id": "f1"},
                    {"type": "text.append", "context_id": "a", "text": "nine ten, and eleven."},
                    {"type": "context.end", "context_id": "a"}):
        await session.receive(json.dumps(message))
    sink.done.setdefault("a", asyncio.Event())
    await asyncio.wait_for(sink.done["a"].wait(), 60)
    await session.close()
    assert sink.said["a"] == ["One two three,", "four five six,", "seven eight", "<flushed f1>", "nine ten,",
                              "and eleven."]


async def test_a_failure_while_cutting_held_back_text_ends_the_turn_with_an_error(engine):
    events = Events()
    recorded = Recorded(engine)
    session = Session(recorded, Said(events))
    session.open()
    await session.receive(json.dumps({"type": "session.start", "output": {"format": "pcm_s16le"}}))
    await session.receive(json.dumps({"type": "text.append", "context_id": "a", "text": PARAGRAPH}))

    def broken() -> list:
        raise RuntimeError("a bug in the segmenter")

    session.turns["a"].segmenter.release = broken  # the held-back cuts fail when they run
    for _ in range(50):
        if ("error", "a") in events.log:
            break
        await asyncio.sleep(0.01)
    # the client hears of it (an internal error naming the context), and nothing of the turn is left running
    assert ("error", "a") in events.log and "a" not in session.turns
    assert recorded.streams[0].closed and engine.stats().in_flight == 0
    await session.close()
