"""First frame first: a turn's first Opus chunk is encoded as two pool calls, its first frame (sent as soon as it is
encoded) then the rest; in a burst every new turn's first frame goes before anyone's rest. The bytes are those of
one call per chunk (with the head coded at the format's complexity: `tests/test_opus_head_complexity.py` covers the
cheaper head); later chunks are one call each."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np
import pytest

from engine.api import AudioChunk, ModelInfo
from gateway import encode_site
from gateway.audio import Encoder, OutputFormat, float_to_int16
from gateway.offload import OffloadPool
from gateway.protocol import FLAG_LAST, AudioFrame, AudioPackets, ServerMessage
from gateway.session import Session

pytestmark = pytest.mark.timeout(60)

RATE = 48000  # VoxCPM2's, and Opus's default: no resampling in the session tests
CHUNK = RATE * 160 // 1000  # one 160 ms patch


@pytest.fixture(autouse=True)
def head_as_the_rest(monkeypatch):
    """The split and its order are what is tested here: a head coded as the rest makes the bytes one call's."""
    monkeypatch.setenv("VOXGATE_OPUS_HEAD_COMPLEXITY", "10")


def speech(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """Something Opus has to work on: a modulated tone in noise."""
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * 140 * t) * (1 + np.sin(2 * np.pi * 3 * t))
    return (tone + 0.05 * np.random.default_rng(seed).standard_normal(len(t))).astype(np.float32)


SOURCE = speech(2.0, RATE)


@pytest.mark.parametrize("model_rate, output", [
    (48000, {"format": "opus"}),
    (16000, {"format": "opus"}),  # VoxCPM v1's rate: soxr's output comes in blocks
    (44100, {"format": "opus"}),  # VoxCPM1.5's
    (48000, {"format": "opus", "sample_rate": 24000, "frame_ms": 40}),
    (48000, {"format": "opus", "sample_rate": 16000, "frame_ms": 10}),
])
def test_a_chunk_split_into_head_and_rest_encodes_to_the_same_bytes(model_rate: int, output: dict) -> None:
    fmt = OutputFormat.from_dict(output, model_rate)
    pcm = speech(1.6, model_rate)
    chunk, step = model_rate * 160 // 1000, model_rate * fmt.frame_ms // 1000
    whole, split = Encoder(fmt, model_rate), Encoder(fmt, model_rate)
    want: list[bytes] = []
    got: list[bytes] = []
    for i, start in enumerate(range(0, len(pcm), chunk)):
        piece = pcm[start:start + chunk]
        want += whole.encode(piece)
        frames = (1, 3, 2, 1)[i % 4]
        head, used = split.encode_head(piece, frames, step)
        assert len(head) >= frames or used == len(piece)
        got += head + split.encode(piece[used:])
    assert got + split.finish() == want + whole.finish()


# ---------------------------------------------------------------------------------------------- through a session

class TickEngine:
    """Each `tick()` hands every running request its next 160 ms chunk, all in one go, as one engine step does."""

    def __init__(self, chunks: int):
        self.chunks = chunks
        self.queues: list[asyncio.Queue] = []
        self.ticks = 0
        self.cancelled: list[str] = []

    def model_info(self) -> ModelInfo:
        return ModelInfo("tick", "stand-in", RATE, CHUNK, 160.0, 4096, True, "float32", "cpu")

    def list_voices(self) -> list[str]:
        return []

    def update_buffered(self, request_id: str, buffered_ms: float) -> None:
        pass

    async def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def generate(self, text: str, **kwargs: Any) -> AsyncIterator[AudioChunk]:
        self.queues.append(asyncio.Queue())
        return self._stream(self.queues[-1], kwargs["request_id"])

    async def _stream(self, queue: asyncio.Queue, request_id: str) -> AsyncIterator[AudioChunk]:
        for i in range(self.chunks):
            pcm = await queue.get()
            yield AudioChunk(pcm, RATE, i, np.zeros((4, 64), np.float32), i == self.chunks - 1, None, request_id)

    def tick(self) -> None:
        pcm = SOURCE[self.ticks * CHUNK:(self.ticks + 1) * CHUNK]
        self.ticks += 1
        for queue in self.queues:
            queue.put_nowait(pcm)


class Sink:
    """The session's EventSink: messages and frames one session emitted; audio batches also go to the shared log."""

    def __init__(self, name: str, log: list[tuple]):
        self.name, self.log = name, log
        self.messages: list[ServerMessage] = []
        self.frames: list[AudioFrame] = []

    async def message(self, msg: ServerMessage) -> None:
        self.messages.append(msg)

    async def audio(self, packets: AudioPackets) -> None:
        self.log.append(("send", self.name, len(packets.payloads)))
        self.frames += packets.frames()

    def send_ready(self) -> bool:
        return True

    async def close(self, code: int, reason: str) -> None:
        pass

    def abort(self) -> None:
        pass

    def got(self, kind: str) -> bool:
        return any(kind == m.TYPE for m in self.messages)


class LoggedPool(OffloadPool):
    """One worker thread; each call logged as it runs: (call, urgency, encoder). Heads wait for `gate` if set."""

    def __init__(self, log: list[tuple], gate: threading.Event | None = None):
        super().__init__(threads=1)
        self.log, self.gate = log, gate
        self.head_running = threading.Event()

    async def run(self, fn: Callable[..., Any], *args: Any, urgency: float = 0.0) -> Any:
        name = fn.__name__
        encoder = fn.__self__

        def logged(*a: Any) -> Any:
            if name == "encode_head" and self.gate is not None:
                self.head_running.set()
                self.gate.wait(10)
            self.log.append((name, urgency, encoder))
            return fn(*a)

        return await super().run(logged, *args, urgency=urgency)


@pytest.fixture
def pool(monkeypatch) -> Iterator[LoggedPool]:
    """The sessions' encode pool: one thread, each call logged in `pool.log` (sinks log their sends there too)."""
    logged = LoggedPool([])
    monkeypatch.setenv("VOXGATE_ENCODE_PROCS", "0")  # the thread pool, whatever the environment says
    monkeypatch.setattr(encode_site, "shared_pool", lambda: logged)
    yield logged
    if logged.gate is not None:
        logged.gate.set()
    logged.shutdown()


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.002)


async def open_turn(engine: TickEngine, sink: Sink, output: dict | None = None,
                    clock: Callable[[], float] | None = None) -> Session:
    session = Session(engine, sink, **({"clock": clock} if clock else {}))
    session.open()
    await session.receive(json.dumps({"type": "session.start", "output": output or {"format": "opus"}}))
    await session.receive(json.dumps({"type": "text.append", "context_id": "t", "text": "Hello there."}))
    await session.receive(json.dumps({"type": "context.end", "context_id": "t"}))
    turn = session.turns["t"]
    await until(lambda: bool(turn.segment_log))  # the synthesis task waits for the engine's first chunk
    return session


def reference(chunks: int) -> list[bytes]:
    encoder = Encoder(OutputFormat(), RATE)
    out = [p for i in range(chunks) for p in encoder.encode(SOURCE[i * CHUNK:(i + 1) * CHUNK])]
    return out + encoder.finish()


def check_frames(frames: list[AudioFrame], chunks: int) -> None:
    assert [f.payload for f in frames] == reference(chunks)
    assert [f.seq for f in frames] == list(range(len(frames)))
    assert [f.flags & FLAG_LAST for f in frames] == [0] * (len(frames) - 1) + [FLAG_LAST]


async def test_new_turns_first_frames_go_out_before_anyones_rest(pool):
    log = pool.log
    engine = TickEngine(chunks=3)
    sinks = {name: Sink(name, log) for name in "ab"}
    sessions = {name: await open_turn(engine, t) for name, t in sinks.items()}
    who = {id(s.turns["t"].encoder.encoder): name for name, s in sessions.items()}
    engine.tick()  # both turns' first chunk, at once: nothing buffered for either listener
    await until(lambda: sum(e[0] == "encode" for e in log) == 2)
    calls = [(e[0], who[id(e[2])], e[1]) for e in log if e[0] != "send"]
    # both heads (one frame, sent at once: the rest follows, so it cannot be the turn's last) before either rest,
    # which waits for the head's frame to be sent
    assert sorted(calls[:2]) == [("encode_head", "a", 0.0), ("encode_head", "b", 0.0)]
    assert sorted(calls[2:]) == [("encode", "a", 20.0), ("encode", "b", 20.0)]
    for name in "ab":
        rest = next(i for i, e in enumerate(log) if e[0] == "encode" and who[id(e[2])] == name)
        assert ("send", name, 1) in log[:rest]
    for _ in range(2):
        engine.tick()
    await until(lambda: all(t.got("context.done") for t in sinks.values()))
    for session in sessions.values():
        await session.close()
    for t in sinks.values():
        check_frames(t.frames, 3)


async def test_only_a_turns_first_chunk_is_split(pool):
    log = pool.log
    engine = TickEngine(chunks=5)
    sink = Sink("a", log)
    # the clock stands still: the listener plays nothing, so the urgencies are what was sent
    session = await open_turn(engine, sink, clock=lambda: 1000.0)
    for k in range(1, 5):
        engine.tick()
        await until(lambda k=k: len(sink.frames) == 8 * k - 1)  # the newest frame is held back
    engine.tick()  # the last chunk
    await until(lambda: sink.got("context.done"))
    await session.close()
    calls = [(e[0], e[1]) for e in log if e[0] != "send"]
    assert calls == [
        ("encode_head", 0.0), ("encode", 20.0),  # the first chunk: its head frame leaves at once
        ("encode", 160.0), ("encode", 320.0), ("encode", 480.0), ("encode", 640.0),  # then one call per chunk
        ("finish", 800.0),
    ]
    # frames per write: the head's goes out at once, then the rest of the first chunk with its newest held back, then
    # each chunk's with the previous held frame; the end releases the last held frame with the tail
    assert [e[2] for e in log if e[0] == "send"] == [1, 6, 8, 8, 8, 8, 2]
    check_frames(sink.frames, 5)


async def test_formats_encoded_on_the_loop_make_no_pool_calls(pool):
    log = pool.log
    engine = TickEngine(chunks=2)
    sink = Sink("a", log)
    session = await open_turn(engine, sink, output={"format": "pcm_s16le", "sample_rate": RATE})
    engine.tick()
    engine.tick()
    await until(lambda: sink.got("context.done"))
    await session.close()
    assert [e for e in log if e[0] != "send"] == []
    assert b"".join(f.payload for f in sink.frames) == float_to_int16(SOURCE[:2 * CHUNK]).astype("<i2").tobytes()


async def test_cancel_while_the_head_is_encoding_stops_the_turn_and_encodes_no_rest(pool):
    log = pool.log
    pool.gate = threading.Event()
    engine = TickEngine(chunks=3)
    sink = Sink("a", log)
    session = await open_turn(engine, sink)
    engine.tick()
    await until(pool.head_running.is_set)
    await session.receive(json.dumps({"type": "context.cancel", "context_id": "t"}))
    assert sink.got("context.cancelled") and not session.turns
    assert engine.cancelled == [f"{session.id}:t:0"]
    pool.gate.set()
    await session.close()
    await until(lambda: any(e[0] == "encode_head" for e in log))  # the head's encode ran
    await asyncio.sleep(0.05)  # its result (for nobody) delivered
    assert [e[0] for e in log if e[0] != "send"] == ["encode_head"]
    assert sink.frames == []


@pytest.mark.parametrize("listener_dry", [True, False])
async def test_a_later_segment_splits_its_first_chunk_only_when_the_listener_has_run_dry(pool, listener_dry):
    log = pool.log
    engine = TickEngine(chunks=2)
    sink = Sink("a", log)
    now = [1000.0]
    session = Session(engine, sink, clock=lambda: now[0])
    session.open()
    await session.receive(json.dumps({"type": "session.start", "output": {"format": "opus"}}))
    text = "Hello there, this is the first sentence of the turn. And here is a second one to follow it."
    await session.receive(json.dumps({"type": "text.append", "context_id": "t", "text": text}))
    await session.receive(json.dumps({"type": "context.end", "context_id": "t"}))
    for _ in range(2):  # the first segment's two chunks
        await until(lambda: len(engine.queues) == 1)
        engine.tick()
    await until(lambda: len(engine.queues) == 2)  # the second segment's request is out
    await until(lambda: len(sink.frames) == 15)  # the first segment's frames sent, but the held-back one
    if listener_dry:
        now[0] += 10.0  # the listener has played everything sent: only the held-back frame is left
    engine.tick()
    await until(lambda: len(sink.frames) >= 23)
    calls = [(e[0], e[1]) for e in log if e[0] != "send"]
    # the first segment: its first chunk split (head, rest), its second one call
    assert calls[:3] == [("encode_head", 0.0), ("encode", 20.0), ("encode", 160.0)]
    if listener_dry:  # the second segment's first frame goes out alone, then the rest of its chunk
        assert calls[3:] == [("encode_head", 20.0), ("encode", 40.0)]
    else:  # 300 ms sent and not played, the held frame: the chunk is one call
        assert calls[3:] == [("encode", 320.0)]
    # the bytes of one encoder call per chunk, the split in the middle of the turn included
    assert [f.payload for f in sink.frames] == reference(3)[:len(sink.frames)]
    await session.close()
