"""A chunk's encode served a slice of frames at a time (`Encoder.encode_slices`, `gateway.encode_child`): the slices'
packets are one uninterrupted encode's, in every format, across calls; and in an encoder process a turn's first frame
asked for while a long encode is in progress is answered before that encode ends, whose packets stay byte-identical."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from gateway import encode_wire as w
from gateway.audio import Encoder, OutputFormat
from gateway.audio.formats import FORMATS
from gateway.encode_child import Call, Pending
from gateway.encode_procs import EncodeProcs
from tests.test_gateway_encode_procs import RATE, speech
from tests.test_gateway_encode_procs_order import FRAME, piece, warm

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("name", [f for f in FORMATS if f not in ("mp3", "flac", "aac")])
@pytest.mark.parametrize("rate", [48000, 16000])
def test_the_slices_of_an_encode_are_its_bytes(name: str, rate: int) -> None:
    fmt = OutputFormat.from_dict({"format": name}, model_rate=rate)
    pcm = speech(1.0, rate)
    whole, sliced = Encoder(fmt, rate), Encoder(fmt, rate)
    want: list[bytes] = []
    got: list[bytes] = []
    chunk = rate * 160 // 1000 + 7  # remainders carried across calls
    for i, start in enumerate(range(0, len(pcm), chunk)):
        part = pcm[start:start + chunk]
        want += whole.encode(part)
        frames = 1 + i % 3
        slices = list(sliced.encode_slices(part, frames))
        assert [more for _, more in slices] == [True] * (len(slices) - 1) + [False]
        packets = [p for out, _ in slices for p in out]
        if fmt.kind:  # a packet per frame: cut between frames
            assert [len(out) for out, _ in slices[:-1]] == [frames] * (len(slices) - 1)
            assert len(slices) == max(1, -(-len(packets) // frames))
        else:  # a container: one slice, a page or chunk per call
            assert len(slices) == 1
        got += packets
    assert list(sliced.encode_slices(np.zeros(0, dtype=np.float32), 2)) == [(whole.encode(np.zeros(0)), False)]
    assert got + sliced.finish() == want + whole.finish()


def test_a_call_served_in_part_keeps_its_place_before_its_encoders_next_call() -> None:
    """Between two slices, another encoder's call with an earlier deadline goes first; a later call of the same encoder
    never does, whatever its deadline (an encoder is a stream)."""
    pending = Pending()
    empty = memoryview(b"")
    pending.push(100.0, Call(w.ENCODE, False, 1, 7, 0, 0, empty))
    key, long_call = pending.pop()  # being served: a slice done
    pending.push(0.0, Call(w.HEAD, True, 2, 7, 1, 960, empty))  # same encoder, earlier deadline
    pending.push(50.0, Call(w.HEAD, True, 3, 8, 1, 960, empty))  # another encoder, earlier deadline
    pending.requeue(key, long_call)
    order = []
    while pending:
        _, call = pending.pop()
        order.append(call.call_id)
        pending.done(call)
    assert order == [3, 1, 2]


async def test_a_first_frame_asked_for_mid_encode_is_answered_before_that_encode_ends():
    """The long call is served a frame at a time and the socket read between two: the head goes after the frame in
    progress, its answer out at once, while the long call has most of its frames to go (served whole, its answer
    would come in the same write as the head's); the long call's packets are one uninterrupted encode's."""
    host = EncodeProcs(1, nice=0)
    try:
        long_turn, new_turn = await warm(host, 2)
        long_pcm = speech(60.0, RATE, seed=3)  # 3,000 frames: ~0.4 s of libopus on the 2-core VM
        answered: dict[str, float] = {}
        long_call = asyncio.ensure_future(long_turn.encode(long_pcm, 10_000.0))  # its deadline after the head's
        long_call.add_done_callback(lambda _: answered.setdefault("long", time.perf_counter()))
        await asyncio.sleep(0.01)  # sent: inline (larger than a slot), what the socket does not take yet waits here
        while long_turn._process.unsent:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)  # its last bytes read, and being encoded
        assert not long_call.done()
        head = await new_turn.encode_head(piece(1), 1, FRAME, 0.0)
        answered["head"] = time.perf_counter()
        packets = await long_call
    finally:
        host.close()
    # the long call's frames after the head's answer: ~1,500 or more (~200 ms); whole, the gap would be ~0
    assert answered["long"] - answered["head"] > 0.05, answered
    local_long, local_new = Encoder(OutputFormat(), RATE), Encoder(OutputFormat(), RATE)
    local_long.encode(piece(0))
    local_new.encode(piece(0))
    assert packets == local_long.encode(long_pcm)  # byte-identical, another encoder's call between its slices
    assert head == local_new.encode_head(piece(1), 1, FRAME)
