"""The link's framing and messages without sockets (`gateway.link.wire`)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import EngineError, EngineOverloaded, InvalidParameter, TenantOverloaded, UnknownLoRA
from engine.request import RequestSpec
from engine.sampling import SamplingParams
from gateway.link import wire
from gateway.store.base import StoreUnavailable


def spec() -> RequestSpec:
    patches = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
    return RequestSpec("r1", [1, 2, 3, 4], [0, 1, 1, 0], (4, 3), SamplingParams(seed=7), audio=[(1, patches)],
                       tenant="k")


def test_frames_round_trip_whole_split_and_joined():
    msgs = [wire.Submit(spec()), wire.Cancel("r2"), wire.Buffered("r3", 120.5)]
    data = wire.frame(msgs, 12.5) + wire.frame([wire.Cancel("r4")], 13.0)
    reader = wire.Reader()
    got = []
    for i in range(0, len(data), 7):  # every split point a socket might produce
        got += reader.feed(data[i:i + 7])
    assert reader.pending == 0
    assert [t for t, _ in got] == [12.5, 13.0]
    first = got[0][1]
    assert first[1:] == msgs[1:] and got[1][1] == [wire.Cancel("r4")]
    back = first[0].spec
    assert back.token_ids == [1, 2, 3, 4] and back.params.seed == 7 and back.tenant == "k"
    np.testing.assert_array_equal(back.audio[0][1], msgs[0].spec.audio[0][1])
    assert reader.feed(b"") == []


def test_chunks_carry_audio_and_first_chunk_stamps():
    audio = np.random.default_rng(0).standard_normal(640).astype(np.float32)
    chunk = ("r1", audio, 0, np.ones((4, 3), np.float32), False, None, 5, (1.0, 2.0))
    [(_, [msg])] = wire.Reader().feed(wire.frame([wire.Chunks([chunk])], 3.0))
    rid, a, index, latents, is_last, reason, step, first = msg.chunks[0]
    np.testing.assert_array_equal(a, audio)
    assert (rid, index, is_last, reason, step, first) == ("r1", 0, False, None, 5, (1.0, 2.0))


@pytest.mark.parametrize("error", [EngineOverloaded("full"), TenantOverloaded("key full"), UnknownLoRA("x"),
                                   InvalidParameter("bad"), StoreUnavailable("redis down")])
def test_typed_errors_travel_as_themselves(error):
    [(_, [msg])] = wire.Reader().feed(wire.frame([wire.Failed("r", wire.portable(error))], 0.0))
    assert type(msg.error) is type(error) and str(msg.error) == str(error)


def test_an_error_that_cannot_travel_becomes_an_engine_error():
    class Local(Exception):  # not importable by the other side
        pass

    out = wire.portable(Local("boom"))
    assert type(out) is EngineError and "Local: boom" in str(out)


def test_frame_too_large_is_typed(monkeypatch):
    monkeypatch.setattr(wire, "MAX_FRAME", 100)
    with pytest.raises(wire.FrameTooLarge):
        wire.frame([wire.Reply(1, True, b"x" * 200)], 0.0)


def test_sendable_sets_apart_what_cannot_be_pickled():
    good, bad = wire.Cancel("a"), wire.Reply(1, True, lambda: 0)
    ok, failed = wire.sendable([good, bad, good])
    assert ok == [good, good] and [m for m, _ in failed] == [bad]
