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


def test_chunks_pack_and_unpack_with_their_audio_latents_and_stamps():
    rng = np.random.default_rng(0)
    rows = [(f"r{i}", rng.standard_normal(640 + i).astype(np.float32), i, rng.standard_normal((4, 3)), i == 2,
             "stop" if i == 2 else None, 5, (1.0, 2.0) if i == 0 else None) for i in range(3)]
    [(_, [msg])] = wire.Reader().feed(wire.frame([wire.pack_chunks(rows)], 3.0))
    back = list(wire.unpack_chunks(msg))
    assert len(back) == 3
    for got, want in zip(back, rows, strict=True):
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[3], want[3])
        assert got[:1] + got[2:3] + got[4:] == want[:1] + want[2:3] + want[4:]
    assert list(wire.unpack_chunks(wire.pack_chunks([]))) == []


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


def test_a_front_process_never_imports_torch():
    """The front side (the app, the link, building requests) loads no torch: N fronts do not pay for it N times."""
    import subprocess
    import sys

    code = ("import sys, gateway.server, gateway.link, gateway.link.front, engine.specs, engine.request_check; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
