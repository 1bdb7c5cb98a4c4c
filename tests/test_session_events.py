"""The session core, sans I/O: driven with client messages, it emits typed events to a recording `EventSink` (protocol
dataclasses and audio packets, never JSON or header bytes), on the real engine with a tiny random checkpoint."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from gateway import protocol as p
from gateway.session import Session, SessionConfig

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

START = {"type": "session.start", "output": {"format": "pcm_s16le", "sample_rate": 16000},
         "generation": {"seed": 5, "max_length": 12}}


class RecordingSink:
    """Every event the session emits, in order; `stall_audio` makes audio sends never complete (a client that stopped
    reading)."""

    def __init__(self, stall_audio: bool = False) -> None:
        self.events: list[p.ServerMessage | p.AudioPackets] = []
        self.closed: tuple[int, str] | None = None
        self.aborted = False
        self.stall_audio = stall_audio

    async def message(self, msg: p.ServerMessage) -> None:
        self.events.append(msg)

    async def audio(self, packets: p.AudioPackets) -> None:
        if self.stall_audio:
            await asyncio.Event().wait()
        self.events.append(packets)

    async def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)

    def abort(self) -> None:
        self.aborted = True

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    async def until(self, kind: type, timeout: float = 60.0) -> Any:
        async with asyncio.timeout(timeout):
            while not self.of(kind):
                await asyncio.sleep(0.01)
        return self.of(kind)[0]


async def started(engine: Any, sink: RecordingSink, config: SessionConfig = SessionConfig()) -> Session:
    session = Session(engine, sink, config)
    session.open()
    await session.receive(json.dumps(START))
    return session


async def test_a_turn_is_typed_messages_and_audio_packets_in_order(engine):
    sink = RecordingSink()
    session = await started(engine, sink)
    await session.receive(json.dumps({"type": "text.append", "context_id": "c", "text": "Hello there, how are you?"}))
    await session.receive(json.dumps({"type": "context.end", "context_id": "c"}))
    done = await sink.until(p.ContextDone)
    await session.close()

    assert all(isinstance(e, p.ServerMessage | p.AudioPackets) for e in sink.events)
    hello = sink.events[0]
    assert isinstance(hello, p.SessionStarted) and hello.session_id == session.id
    assert hello.output["format"] == "pcm_s16le" and hello.generation["seed"] == 5
    ctx = sink.events[1]
    assert isinstance(ctx, p.ContextStarted) and ctx.context_id == "c"
    assert isinstance(sink.events[2], p.SegmentStarted) and sink.events[2].pts_ms == 0.0
    assert sink.events[-1] is done and done.context_id == "c"

    batches = sink.of(p.AudioPackets)
    assert batches, "the turn sent audio"
    frames = [f for b in batches for f in b.frames()]
    assert {(b.context_id, b.index, b.kind, b.frame_ms) for b in batches} == {("c", ctx.index, 2, 20)}
    # batches continue each other: seq and pts run on, and only the turn's very last frame is flagged
    assert [f.seq for f in frames] == list(range(len(frames)))
    assert all(b.pts_ms == a.end_ms for a, b in zip(batches, batches[1:], strict=False))
    assert [f.flags for f in frames] == [0] * (len(frames) - 1) + [p.FLAG_LAST]
    assert all(len(f.payload) == 16000 * 20 // 1000 * 2 for f in frames)  # whole 20 ms frames of s16
    assert done.audio_ms == pytest.approx(batches[-1].end_ms, abs=0.1)


async def test_refusals_and_replies_are_typed(engine):
    sink = RecordingSink()
    session = await started(engine, sink)
    await session.receive(json.dumps({"type": "ping", "id": 7}))
    await session.receive(json.dumps({"type": "context.end", "context_id": "nope"}))
    await session.receive("{not json")
    pong, unknown, bad = sink.events[1:]
    assert pong == p.Pong(7)
    assert isinstance(unknown, p.Error) and unknown.code == p.ErrorCode.UNKNOWN_CONTEXT
    assert unknown.context_id == "nope" and not unknown.fatal
    assert isinstance(bad, p.Error) and bad.code == p.ErrorCode.BAD_JSON
    assert not session.closed
    await session.close()
    assert sink.closed == (1000, "")


async def test_a_cancelled_turn_reports_what_was_sent(engine):
    sink = RecordingSink()
    session = await started(engine, sink)
    await session.receive(json.dumps({"type": "text.append", "context_id": "c", "text": "Hello there, how are you?"}))
    await session.receive(json.dumps({"type": "context.cancel", "context_id": "c"}))
    cancelled = sink.of(p.ContextCancelled)[0]
    sent_ms = sum(len(b.payloads) * b.frame_ms for b in sink.of(p.AudioPackets))
    assert cancelled.context_id == "c" and cancelled.audio_sent_ms == pytest.approx(sent_ms, abs=0.1)
    assert not session.turns and not sink.of(p.ContextDone)
    await session.close()


async def test_a_sink_that_stops_taking_audio_drops_the_session(engine):
    """The stall timeout guards the sink's audio sends: the connection is aborted and the session closed."""
    limits = dataclasses.replace(p.Limits(), slow_consumer_timeout_s=0.3)
    sink = RecordingSink(stall_audio=True)
    session = await started(engine, sink, SessionConfig(limits=limits))
    await session.receive(json.dumps({"type": "text.append", "context_id": "c", "text": "Hello there, how are you?"}))
    await session.receive(json.dumps({"type": "context.end", "context_id": "c"}))
    async with asyncio.timeout(60):
        while sink.closed is None:
            await asyncio.sleep(0.01)
    assert sink.aborted and sink.closed == (1008, str(p.ErrorCode.SLOW_CONSUMER))
    assert session.closed and not session.turns
