"""The order an encoder process serves its calls in (`gateway.encode_procs`, `gateway.encode_child`), through the real
child process and socket: an urgent call (a turn's first frame) reaches the process past a full window and goes before
the chunks already there, even while one is being encoded; one encoder's calls keep their order; an open and the first
frame read together work; closing an encoder with a call in the process frees the call's place; more urgent calls than
shared slots go inline."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from gateway import encode_wire as w
from gateway.audio import Encoder, OutputFormat
from gateway.encode_procs import WINDOW, EncodeFailed, EncodeProcs, ProcEncoder
from tests.test_gateway_encode_procs import CHUNK, RATE, speech

pytestmark = pytest.mark.timeout(60)

SOURCE = speech(1.0, RATE)
FRAME = RATE * 20 // 1000  # one Opus frame's time in samples: `encode_head`'s step


def piece(k: int) -> np.ndarray:
    return SOURCE[k * CHUNK:(k + 1) * CHUNK]


def samples(pcm: np.ndarray) -> memoryview:
    """A call's payload, as `ProcEncoder` makes it."""
    return memoryview(np.ascontiguousarray(pcm, dtype=np.float32)).cast("B")


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process is stopped inside the block: what is sent to it meanwhile waits in its socket, read all at once."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def tracked(awaitable: Any, name: str, done: list[str]) -> asyncio.Future:
    fut = asyncio.ensure_future(awaitable)
    fut.add_done_callback(lambda _: done.append(name))
    return fut


async def warm(host: EncodeProcs, count: int) -> list[ProcEncoder]:
    """`count` encoders in the host's one process, each past its first chunk (process started, encoders made)."""
    encoders = [host.open(OutputFormat(), RATE) for _ in range(count)]
    await asyncio.gather(*(e.encode(piece(0), 1000.0) for e in encoders))
    assert all(isinstance(e, ProcEncoder) for e in encoders)
    return encoders


async def test_a_first_frame_goes_past_a_full_window_and_before_the_chunks_in_the_process():
    host = EncodeProcs(1, nice=0)
    try:
        encoders = await warm(host, 2 * WINDOW + 1)
        done: list[str] = []
        with stopped(host.pids[0]):
            chunks = [tracked(e.encode(piece(1), 1000.0 + i), f"chunk{i}", done)
                      for i, e in enumerate(encoders[:-1])]
            await asyncio.sleep(0.05)  # WINDOW of them are in the process, the others wait here
            process = encoders[0]._process
            assert len(process.sent) == WINDOW and len(process.queue) == WINDOW
            head = tracked(encoders[-1].encode_head(piece(1), 1, FRAME, 0.0), "head", done)
            await asyncio.sleep(0.05)
            assert len(process.sent) == WINDOW + 1  # in the process already, the window full
        await asyncio.gather(head, *chunks)
    finally:
        host.close()
    # the first frame first, then the chunks earliest deadline first
    assert done == ["head", *(f"chunk{i}" for i in range(2 * WINDOW))]


async def test_a_first_frame_asked_for_mid_encode_waits_only_for_that_encode():
    """The process reads its socket between calls: a head that comes while a long call is being encoded goes next,
    before the chunks that were in the process before it, and its answer goes ahead of the long call's (held to go
    with the others): the gateway hands answers over in the order they come."""
    host = EncodeProcs(1, nice=0)
    try:
        long_turn, *encoders, new_turn = await warm(host, WINDOW + 1)
        done: list[str] = []
        long_call = tracked(long_turn.encode(speech(12.0, RATE, seed=2), 300.0), "long", done)  # ~30-70 ms of libopus
        chunks = [tracked(e.encode(piece(1), 1000.0 + i), f"chunk{i}", done) for i, e in enumerate(encoders)]
        await asyncio.sleep(0.02)  # the window's calls are in the process, the long one being encoded
        assert not done
        head = tracked(new_turn.encode_head(piece(1), 1, FRAME, 0.0), "head", done)
        await asyncio.gather(long_call, head, *chunks)
    finally:
        host.close()
    assert done[:2] == ["head", "long"] and sorted(done[2:]) == [f"chunk{i}" for i in range(len(encoders))]


async def test_one_encoders_calls_keep_their_order_while_anothers_overtake_them():
    host = EncodeProcs(1, nice=0)
    try:
        first, second = await warm(host, 2)
        local_first, local_second = Encoder(OutputFormat(), RATE), Encoder(OutputFormat(), RATE)
        local_first.encode(piece(0))
        local_second.encode(piece(0))
        process = first._process
        done: list[str] = []
        with stopped(host.pids[0]):  # all three read at once: the process chooses among them
            # both urgent, so both go straight out, in this order; the second's deadline is the earlier
            a = tracked(process.submit(w.ENCODE, first._id, 0, 0, samples(piece(1)), 150.0), "a", done)
            b = tracked(process.submit(w.ENCODE, first._id, 0, 0, samples(piece(2)), 0.0), "b", done)
            c = tracked(process.submit(w.ENCODE, second._id, 0, 0, samples(piece(1)), 50.0), "c", done)
            await asyncio.sleep(0.05)
        await asyncio.gather(a, b, c)
        assert done == ["c", "a", "b"]  # the other encoder's call overtakes a; b never overtakes a
        assert a.result()[0] == local_first.encode(piece(1)) and b.result()[0] == local_first.encode(piece(2))
        assert c.result()[0] == local_second.encode(piece(1))
        # a turn awaits each call: a second call while one is out is a mistake, said at once
        out = asyncio.ensure_future(first.encode(piece(3), 1000.0))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one call at a time"):
            await first.encode(piece(4), 0.0)
        assert await out == local_first.encode(piece(3))
        first.close()
        second.close()
    finally:
        host.close()


async def test_an_open_and_the_first_frame_read_together_work():
    host = EncodeProcs(1, nice=0)
    try:
        (spare,) = await warm(host, 1)
        with stopped(host.pids[0]):
            encoder = host.open(OutputFormat(), RATE)
            head = asyncio.ensure_future(encoder.encode_head(piece(1), 1, FRAME, 0.0))
            await asyncio.sleep(0.05)  # both in the socket: one read brings them
        local = Encoder(OutputFormat(), RATE)
        assert await head == local.encode_head(piece(1), 1, FRAME)
        assert await encoder.finish(0.0) == local.finish()
        encoder.close()
        spare.close()
        assert await host.open_counts() == [0]
    finally:
        host.close()


async def test_closing_an_encoder_with_a_call_in_the_process_drops_the_call_and_frees_its_place():
    host = EncodeProcs(1, nice=0)
    try:
        closing, cancelled, going_on = await warm(host, 3)
        process = closing._process
        with stopped(host.pids[0]):
            dropped = process.submit(w.ENCODE, closing._id, 0, 0, samples(piece(1)), 1000.0)
            turn_call = asyncio.ensure_future(cancelled.encode(piece(1), 1000.0))
            other = asyncio.ensure_future(going_on.encode(piece(1), 1000.0))
            await asyncio.sleep(0.05)
            assert process.windowed == 3  # all three in the process
            closing.close()  # a turn ended while its call was in the process
            turn_call.cancel()  # a turn cancelled mid-call: its call goes on in the process, then it closes
            await asyncio.sleep(0)
            cancelled.close()
        with pytest.raises(EncodeFailed, match="closed"):  # not encoded: the encoder was gone when its turn came
            await dropped
        local = Encoder(OutputFormat(), RATE)
        local.encode(piece(0))
        assert await other == local.encode(piece(1))  # the other turn goes on, byte for byte
        assert await host.open_counts() == [1]
        going_on.close()
        assert await host.open_counts() == [0]
        assert not process.sent and process.windowed == 0 and sorted(process.free_slots) == list(range(w.SLOTS))
    finally:
        host.close()


async def test_more_urgent_calls_than_slots_go_inline():
    host = EncodeProcs(1, nice=0)
    try:
        count = w.SLOTS + 3
        encoders = await warm(host, count)
        process = encoders[0]._process
        with stopped(host.pids[0]):
            heads = [asyncio.ensure_future(e.encode_head(piece(1), 1, FRAME, 0.0)) for e in encoders]
            await asyncio.sleep(0.05)
            assert sum(slot == w.INLINE for _, slot, *_ in process.sent.values()) == count - w.SLOTS
        got = await asyncio.gather(*heads)
        for head in got:
            local = Encoder(OutputFormat(), RATE)
            local.encode(piece(0))
            assert head == local.encode_head(piece(1), 1, FRAME)
        assert sorted(process.free_slots) == list(range(w.SLOTS))
        for e in encoders:
            e.close()
    finally:
        host.close()
