"""A turn's start and its text, at the session core (sans I/O, the real tiny engine): time-based segment release by
the turn's loop timer, the quick path for valid text messages (the same result as the full parser), and a front's
link batching buffered-audio reports (a real socket pair)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import pytest

from gateway import protocol as p
from gateway.link import front, wire
from gateway.protocol import client_messages
from gateway.session import Session

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

START = {"type": "session.start", "output": {"format": "pcm_s16le", "sample_rate": 16000},
         "generation": {"seed": 5, "max_length": 4},
         "chunking": {"first_chars": 200, "max_delay_ms": 150, "min_chars": 1}}
NO_CLAUSE = "hello there my good friend"  # no boundary before first_chars: only time releases it


class Sink:
    """Every event the session emits, in order, with when it came."""

    def __init__(self) -> None:
        self.events: list[tuple[float, Any]] = []

    async def message(self, msg: p.ServerMessage) -> None:
        self.events.append((time.monotonic(), msg))

    async def audio(self, packets: p.AudioPackets) -> None:
        self.events.append((time.monotonic(), packets))

    async def close(self, code: int, reason: str) -> None:
        pass

    def abort(self) -> None:
        pass

    def of(self, kind: type) -> list[tuple[float, Any]]:
        return [(t, e) for t, e in self.events if isinstance(e, kind)]

    async def until(self, kind: type, timeout: float = 60.0) -> tuple[float, Any]:
        async with asyncio.timeout(timeout):
            while not self.of(kind):
                await asyncio.sleep(0.005)
        return self.of(kind)[0]


async def started(engine: Any, sink: Sink) -> Session:
    session = Session(engine, sink)
    session.open()
    await session.receive(json.dumps(START))
    return session


async def test_text_without_a_boundary_leaves_after_max_delay_and_an_ended_turn_has_no_timer(engine):
    sink = Sink()
    session = await started(engine, sink)
    sent_at = time.monotonic()
    await session.receive(json.dumps({"type": "text.append", "context_id": "c", "text": NO_CLAUSE}))
    turn = session.turns["c"]
    await asyncio.sleep(0)  # the held-back cuts (`_cut_deferred`) re-arm it
    assert turn.timer is not None and not sink.of(p.SegmentStarted)
    at, seg = await sink.until(p.SegmentStarted)
    # released by time, not by the text (its last word stays back: it may not be whole yet)
    assert seg.text and NO_CLAUSE.startswith(seg.text) and at - sent_at >= 0.15 - 0.01
    await session.receive(json.dumps({"type": "text.append", "context_id": "c", "text": " and more words"}))
    assert turn.timer is not None  # new text without a boundary: a new deadline
    await session.receive(json.dumps({"type": "context.end", "context_id": "c"}))
    assert turn.timer is None  # ended: the rest leaves with the end, nothing waits on time
    await sink.until(p.ContextDone)
    assert " ".join(e.text for _, e in sink.of(p.SegmentStarted)) == NO_CLAUSE + " and more words"
    await session.close()


async def test_a_cancelled_turn_releases_nothing_after_its_cancel(engine):
    sink = Sink()
    session = await started(engine, sink)
    await session.receive(json.dumps({"type": "text.append", "context_id": "c", "text": NO_CLAUSE}))
    await asyncio.sleep(0)
    turn = session.turns["c"]
    assert turn.timer is not None
    await session.receive(json.dumps({"type": "context.cancel", "context_id": "c"}))
    assert turn.timer is None
    await asyncio.sleep(0.3)  # past the deadline the timer had
    assert not sink.of(p.SegmentStarted) and sink.of(p.ContextCancelled)
    await session.close()


@pytest.mark.parametrize("message", [
    {"type": "text.append", "context_id": "c", "text": "Hello."},
    {"type": "text.append", "context_id": "c", "text": ""},
    {"type": "text.append", "context_id": "c", "text": "x" * 2000},
    {"type": "text.append", "context_id": "c", "text": "x" * 2001},
    {"type": "text.append", "context_id": "", "text": "Hello."},
    {"type": "text.append", "context_id": "c" * 129, "text": "Hello."},
    {"type": "text.append", "context_id": 5, "text": "Hello."},
    {"type": "text.append", "context_id": "c", "text": 5},
    {"type": "text.append", "context_id": "c", "text": None},
    {"type": "text.append", "context_id": "c"},
    {"type": "text.append", "context_id": "c", "txt": "Hello."},
    {"type": "text.append", "context_id": "c", "text": "Hello.", "extra": 1},
    {"type": "context.end", "context_id": "c"},
    {"type": "context.end", "context_id": "c", "text": "Hello."},
    {"type": "context.end"},
    {"type": "context.end", "context_id": True},
    {"type": "context.cancel", "context_id": "c"},
])
async def test_the_quick_path_for_text_messages_answers_as_the_full_parser(message):
    limits = p.Limits()
    kind = message["type"]
    try:
        want: Any = client_messages._PARSERS[kind](client_messages._Fields(kind, dict(message), limits))
    except p.ProtocolError as e:
        want = (e.code, e.message, e.context_id)
    try:
        got: Any = p.parse_client_message(json.dumps(message), limits)
    except p.ProtocolError as e:
        got = (e.code, e.message, e.context_id)
    assert got == want


async def test_a_fronts_buffer_reports_wait_for_company_and_keep_their_order():
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    conn = front._HostConnection(loop, None)
    await loop.create_unix_connection(lambda: conn, sock=ours)
    theirs.setblocking(False)
    reader = wire.Reader()

    async def frames(wait_s: float) -> list[list[Any]]:
        await asyncio.sleep(wait_s)
        try:
            data = theirs.recv(1 << 20)
        except BlockingIOError:
            return []
        return [messages for _, messages in reader.feed(data)]

    try:
        conn.post(wire.Buffered("a", 100.0))
        conn.post(wire.Buffered("b", 200.0))
        await asyncio.sleep(0)
        assert await frames(0.0) == []  # reports alone wait
        assert await frames(front.REPORT_DELAY_S + 0.05) == [[wire.Buffered("a", 100.0), wire.Buffered("b", 200.0)]]
        conn.post(wire.Buffered("a", 50.0))
        conn.post(wire.Cancel("b"))  # anything else goes at the end of this pass, and takes the report along
        assert await frames(0.01) == [[wire.Buffered("a", 50.0), wire.Cancel("b")]]
        assert await frames(front.REPORT_DELAY_S + 0.05) == []  # the report's own flush found nothing left
    finally:
        conn.transport.close()
        theirs.close()


async def test_the_native_sinks_write_is_each_frame_as_one_binary_message():
    from gateway.native_sink import ws_audio

    payloads = [bytes([i]) * n for i, n in enumerate((1, 111, 112, 200, 70000))]  # 7-bit, 16-bit, 64-bit lengths
    packets = p.AudioPackets("c", 3, 1, 41, 820.0, 20.0, payloads, last=True)
    data, messages = ws_audio(packets), []
    pos = 0
    while pos < len(data):
        assert data[pos] == 0x82  # final, binary, unmasked
        n, pos = data[pos + 1], pos + 2
        if n == 126:
            n, pos = int.from_bytes(data[pos:pos + 2], "big"), pos + 2
        elif n == 127:
            n, pos = int.from_bytes(data[pos:pos + 8], "big"), pos + 8
        messages.append(data[pos:pos + n])
        pos += n
    assert messages == packets.encode()
    assert [p.unpack_frame(m) for m in messages] == packets.frames()
