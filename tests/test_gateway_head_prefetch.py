"""A new turn's first frame's encode call goes out as the engine delivers its first chunk (the first-chunk hook of
`engine.generation.ChunkQueue`, `gateway.turn.TurnPipeline._head_now`), in the callback that delivers the step's
chunks, before any turn's task runs; the frames are those of one call per chunk. Where the sink can write at once
(`audio_now`), the first frame goes out where its answer is read, before any task step (`_head_answered`). A turn
stopped between the delivery and its task's step leaves no call and no encoder behind, and no frame is written for it.
A task takes an answer already in its encoder's socket without waiting for the loop's next look at it. Real encoder
processes, real sessions; the engine is a stand-in whose streams are the engine's own `ChunkIterator` over a
`ChunkQueue`, a step's chunks all handed over in one callback."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import time

import numpy as np
import pytest

from engine.api import AudioChunk
from engine.generation import ChunkIterator, ChunkQueue
from gateway.encode_procs import EncoderProcessLost, ProcEncoder, close_shared, shared_procs
from gateway.protocol import AudioPackets
from gateway.session import Session
from tests import test_gateway_encode_split as split
from tests.test_gateway_encode_split import CHUNK, RATE, SOURCE, Sink, check_frames, open_turn, until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def two_encoder_processes(monkeypatch):
    """Opus in two encoder processes; the head coded as the rest, so the bytes are one call per chunk's."""
    monkeypatch.setenv("VOXGATE_ENCODE_PROCS", "2")
    monkeypatch.setenv("VOXGATE_OPUS_HEAD_COMPLEXITY", "10")


class NowSink(Sink):
    """A sink that writes at once while `ready` (as the native one does while the socket takes it)."""

    def __init__(self, name: str, log: list[tuple]):
        super().__init__(name, log)
        self.ready = True

    def audio_now(self, packets: AudioPackets) -> bool:
        if not self.ready:
            return False
        self.log.append(("now", self.name, len(packets.payloads)))
        self.frames += packets.frames()
        return True


class TickStream(ChunkIterator):
    def __init__(self, engine: TickEngine, request_id: str):
        self.engine, self.request_id = engine, request_id
        self.queue = ChunkQueue()
        self.index = 0

    def _queue(self) -> ChunkQueue:
        return self.queue

    def _cancel(self) -> None:
        self.engine.cancelled.append(self.request_id)


class TickEngine(split.TickEngine):
    """Each `tick()` hands every running request its next 160 ms chunk in one go, as one engine step does, through
    the engine's own `ChunkIterator` over a `ChunkQueue`."""

    def __init__(self, chunks: int):
        super().__init__(chunks)
        self.streams: list[TickStream] = []

    def generate(self, text: str, **kwargs: object) -> TickStream:
        stream = TickStream(self, str(kwargs["request_id"]))
        self.streams.append(stream)
        return stream

    def tick(self) -> None:
        pcm = SOURCE[self.ticks * CHUNK:(self.ticks + 1) * CHUNK]
        self.ticks += 1
        for s in self.streams:
            if s.index < self.chunks and not s._finished:
                last = s.index == self.chunks - 1
                s.queue.put_nowait(AudioChunk(pcm, RATE, s.index, np.zeros((4, 64), np.float32), last, None,
                                              s.request_id))
                s.index += 1


async def finish(engine: TickEngine, sessions: list[Session], sinks: list[Sink]) -> None:
    """The turns' last two chunks, their ends, and each turn's frames checked: the bytes of one call per chunk, in
    order."""
    for _ in range(2):
        engine.tick()
    await until(lambda: all(sink.got("context.done") for sink in sinks))
    for session in sessions:
        await session.close()
    for sink in sinks:
        check_frames(sink.frames, 3)


def encoders(sessions: list[Session]) -> list[ProcEncoder]:
    out = [s.turns["t"].encoder for s in sessions]
    assert all(isinstance(e, ProcEncoder) for e in out)
    return out  # type: ignore[return-value]


async def test_a_bursts_first_frames_are_in_the_encoder_processes_before_any_task_runs():
    engine = TickEngine(chunks=3)
    log: list[tuple] = []
    sinks = [Sink(str(i), log) for i in range(6)]
    sessions = [await open_turn(engine, sink) for sink in sinks]
    host = shared_procs(2)
    try:
        turns = [s.turns["t"] for s in sessions]
        encs = encoders(sessions)
        engine.tick()  # every turn's first chunk in one callback; nothing has run since
        assert all(t.engine_ttfb_ms is None for t in turns)  # no task has taken its chunk yet
        assert all(t.head is not None and t.head.future is e._out for t, e in zip(turns, encs, strict=True))
        # written to the processes already (urgent calls), all six, across both processes
        in_processes = sum(len(e._process.sent) for e in {id(e._process): e for e in encs}.values())
        assert in_processes == len(turns)
        assert len({id(e._process) for e in encs}) == 2
        await until(lambda: all(sink.frames for sink in sinks))
        assert all(t.head is None for t in turns)  # each task took its call
        assert all(t.first_encode_ms is not None and t.first_encode_ms >= 0 for t in turns)
        await finish(engine, sessions, sinks)
        assert await host.open_counts() == [0, 0]
    finally:
        close_shared()


@pytest.fixture
async def one_turn():
    """A session whose turn waits for its first chunk (of 3), its encoder in an encoder process; the processes are
    stopped at the end."""
    engine = TickEngine(chunks=3)
    sink = Sink("a", [])
    session = await open_turn(engine, sink)
    try:
        yield engine, sink, session
    finally:
        close_shared()
        await asyncio.sleep(0)


async def test_a_later_chunk_is_not_encoded_early(one_turn):
    engine, sink, session = one_turn
    turn = session.turns["t"]
    engine.tick()
    assert turn.head is not None
    await until(lambda: len(sink.frames) == 7)  # the first chunk's frames, but the held-back one
    engine.tick()
    assert turn.head is None  # the hook is for the first chunk only
    engine.tick()
    await until(lambda: sink.got("context.done"))
    await session.close()
    check_frames(sink.frames, 3)


@pytest.mark.parametrize("how", ["context.cancel", "disconnect"])
async def test_a_turn_stopped_between_delivery_and_its_task_leaves_no_call_nor_encoder(one_turn, how):
    engine, sink, session = one_turn
    host = shared_procs(2)
    turn = session.turns["t"]
    (encoder,) = encoders([session])
    engine.tick()
    head = turn.head
    assert head is not None and not head.future.done()
    if how == "context.cancel":
        await session.receive(json.dumps({"type": "context.cancel", "context_id": "t"}))
        assert sink.got("context.cancelled")
    else:
        await session.close()
    assert turn.engine_ttfb_ms is None  # its task never took the chunk
    await until(lambda: encoder._closed)
    assert head.future.cancelled() and turn.head is None
    process = encoder._process
    await until(lambda: not process.sent)  # the head's answer came back and freed its slot
    assert process.encoders == 0  # closed once
    assert await host.open_counts() == [0, 0]
    assert sink.frames == []
    if how == "context.cancel":
        await session.close()


async def test_an_encoder_process_lost_after_the_early_call_ends_the_turn_as_before(one_turn):
    engine, sink, session = one_turn
    turn = session.turns["t"]
    (encoder,) = encoders([session])
    os.kill(encoder._process.pid, signal.SIGSTOP)  # the call waits in its socket
    engine.tick()
    assert turn.head is not None
    encoder._process.lost("killed by the test")  # its calls fail: the early head with them
    await until(lambda: sink.got("error"))
    error = next(m for m in sink.messages if m.TYPE == "error")
    assert error.code == EncoderProcessLost("x").code and "killed by the test" in error.message
    assert sink.frames == [] and turn.head is None
    await session.close()


async def test_answers_already_in_the_socket_are_taken_by_the_tasks_in_the_same_loop_iteration():
    engine = TickEngine(chunks=3)
    log: list[tuple] = []
    sinks = [Sink(str(i), log) for i in range(4)]
    sessions = [await open_turn(engine, sink) for sink in sinks]
    try:
        engine.tick()
        time.sleep(1.0)  # the loop is busy: the processes answer every head meanwhile, and nothing reads them
        await asyncio.sleep(0)  # one loop iteration: every turn's task takes its chunk
        # each task found its head answered (`ProcEncoder.collect`) and sent it, without waiting for another iteration
        assert all(len(sink.frames) == 1 for sink in sinks)
        await finish(engine, sessions, sinks)
    finally:
        close_shared()


@pytest.mark.parametrize("head", [True, False], ids=["opus-head-early", "pcm"])
async def test_the_engine_ttfb_ends_where_the_engine_delivered_the_first_chunk(head):
    """The time between the engine's delivery and the turn's task taking the chunk (a burst's other tasks ahead of
    it) is the gateway's share, not the engine's: `engine_ttfb_ms` is stamped at delivery."""
    now = [100.0]
    engine = TickEngine(chunks=1)
    sink = Sink("a", [])
    session = await open_turn(engine, sink, output=None if head else {"format": "pcm_s16le"}, clock=lambda: now[0])
    try:
        now[0] += 0.040
        engine.tick()  # delivered at +40 ms
        now[0] += 0.300  # the loop is busy elsewhere for 300 ms before the task runs
        await until(lambda: sink.got("context.done"))
        metrics = next(m for m in sink.messages if m.TYPE == "context.done").metrics
        assert metrics["engine_ttfb_ms"] == pytest.approx(40.0, abs=0.1)
        assert metrics["chunk_queued_ms"] == pytest.approx(300.0, abs=0.1)
        assert metrics["ttfb_ms"] == pytest.approx(340.0, abs=0.1)
        await session.close()
    finally:
        close_shared()


async def test_the_turns_of_one_delivery_share_its_stamp(monkeypatch):
    """The first-frame calls made for the turns handed over earlier in a delivery count as the gateway's share of a
    later turn, not as the engine's: every turn of one delivery has the delivery's start as its engine TTFB's end."""
    now = [100.0]
    head_now = ProcEncoder.head_now

    def slow_head_now(self, *args):
        now[0] += 0.005  # each call takes 5 ms
        return head_now(self, *args)

    monkeypatch.setattr(ProcEncoder, "head_now", slow_head_now)
    engine = TickEngine(chunks=1)
    sinks = [Sink(str(i), []) for i in range(3)]
    clock = functools.partial(now.__getitem__, 0)  # one clock for all, as time.monotonic is
    sessions = [await open_turn(engine, sink, clock=clock) for sink in sinks]
    try:
        now[0] += 0.040
        engine.tick()  # delivered at +40 ms: the three calls take 15 ms in all
        assert now[0] == pytest.approx(100.055)
        await until(lambda: all(sink.got("context.done") for sink in sinks))
        for sink in sinks:
            metrics = next(m for m in sink.messages if m.TYPE == "context.done").metrics
            assert metrics["engine_ttfb_ms"] == pytest.approx(40.0, abs=0.1)
            assert metrics["chunk_queued_ms"] == pytest.approx(15.0, abs=0.1)  # each task takes its chunk after all
            assert metrics["ttfb_ms"] == pytest.approx(55.0, abs=0.1)
        for session in sessions:
            await session.close()
    finally:
        close_shared()


async def test_first_frames_go_out_where_their_answers_are_read_before_any_task_runs():
    engine = TickEngine(chunks=3)
    log: list[tuple] = []
    sinks = [NowSink(str(i), log) for i in range(6)]
    sessions = [await open_turn(engine, sink) for sink in sinks]
    try:
        turns = [s.turns["t"] for s in sessions]
        encs = encoders(sessions)
        engine.tick()
        time.sleep(1.0)  # the loop is busy: the processes answer every head meanwhile
        by_process = {id(e._process): e for e in encs}
        assert len(by_process) == 2
        for encoder in by_process.values():
            encoder.collect()  # what a task's step or the loop's reader does: read the answers
        # no task has run since the delivery, and every turn's first frame is out
        assert all(t.engine_ttfb_ms is None for t in turns)
        assert sorted(log) == sorted(("now", sink.name, 1) for sink in sinks)
        assert all(t.head is not None and t.head.written for t in turns)
        assert all(t.first_encode_ms is not None and t.first_encode_ms >= 1000.0 for t in turns)
        await finish(engine, sessions, sinks)  # then the rest of each chunk, in order: the bytes of one call each
        assert all(t.head is None for t in turns)
    finally:
        close_shared()


async def test_a_first_frame_the_sink_cannot_take_at_once_goes_out_from_the_task():
    engine = TickEngine(chunks=3)
    log: list[tuple] = []
    sinks = [NowSink(str(i), log) for i in range(2)]
    sinks[0].ready = False
    sessions = [await open_turn(engine, sink) for sink in sinks]
    try:
        turns = [s.turns["t"] for s in sessions]
        engine.tick()
        await until(lambda: all(sink.frames for sink in sinks))
        # the first frame of the turn whose sink was not ready went out from its task, the other's at its answer
        assert ("send", "0", 1) in log and ("now", "0", 1) not in log
        assert ("now", "1", 1) in log
        assert all(t.first_encode_ms is not None for t in turns)
        await finish(engine, sessions, sinks)
    finally:
        close_shared()


@pytest.mark.parametrize("how", ["context.cancel", "disconnect"])
async def test_no_first_frame_is_written_for_a_turn_stopped_before_its_answer_is_read(how):
    engine = TickEngine(chunks=3)
    sink = NowSink("a", [])
    session = await open_turn(engine, sink)
    try:
        turn = session.turns["t"]
        (encoder,) = encoders([session])
        engine.tick()
        head = turn.head
        assert head is not None
        time.sleep(0.5)  # answered, not read
        if how == "context.cancel":
            await session.receive(json.dumps({"type": "context.cancel", "context_id": "t"}))
            assert sink.got("context.cancelled")
        else:
            await session.close()
        encoder.collect()
        assert head.future.cancelled() and not head.written
        assert sink.frames == [] and sink.log == []
        await until(lambda: not encoder._process.sent)  # the call, and its hook with it, gone
        await session.close()
    finally:
        close_shared()


async def test_a_first_frame_written_at_its_answer_counts_its_time_from_the_delivery():
    now = [100.0]
    engine = TickEngine(chunks=1)
    sink = NowSink("a", [])
    session = await open_turn(engine, sink, clock=lambda: now[0])
    try:
        (encoder,) = encoders([session])
        now[0] += 0.040
        engine.tick()  # delivered at +40 ms
        time.sleep(0.5)
        now[0] += 0.003
        encoder.collect()  # read at +43 ms: written there
        now[0] += 0.300  # the loop is busy elsewhere for 300 ms before the task runs
        await until(lambda: sink.got("context.done"))
        metrics = next(m for m in sink.messages if m.TYPE == "context.done").metrics
        assert metrics["engine_ttfb_ms"] == pytest.approx(40.0, abs=0.1)
        assert metrics["first_encode_ms"] == pytest.approx(3.0, abs=0.1)
        assert metrics["ttfb_ms"] == pytest.approx(43.0, abs=0.1)
        assert metrics["chunk_queued_ms"] == pytest.approx(303.0, abs=0.1)  # off the first frame's path now
        await session.close()
        check_frames(sink.frames, 1)
    finally:
        close_shared()
