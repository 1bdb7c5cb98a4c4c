"""The sans-I/O protocol core: every client message parsed and validated, every error code, server messages, frames."""

import json

import pytest

from gateway import protocol as p
from gateway.protocol import ErrorCode, Limits, ProtocolError, parse_client_message


def parse(msg: dict | str, limits: Limits = Limits()) -> p.ClientMessage:
    return parse_client_message(msg if isinstance(msg, str) else json.dumps(msg), limits)


def error_of(msg: dict | str | bytes, limits: Limits = Limits()) -> ProtocolError:
    with pytest.raises(ProtocolError) as e:
        parse_client_message(msg if isinstance(msg, str | bytes) else json.dumps(msg), limits)
    return e.value


def test_every_client_message_parses_to_its_dataclass():
    assert parse({"type": "session.start"}) == p.SessionStart()
    start = parse({"type": "session.start", "voice": "v1", "output": {"format": "mulaw"},
                   "chunking": {"first_chars": 10}, "generation": {"cfg_value": 1.5, "seed": 7}})
    assert start == p.SessionStart("v1", {"format": "mulaw"}, {"first_chars": 10}, {"cfg_value": 1.5, "seed": 7})
    assert parse({"type": "text.append", "context_id": "c", "text": "Hi."}) == p.TextAppend("c", "Hi.")
    assert parse({"type": "text.flush", "context_id": "c", "flush_id": "f1"}) == p.TextFlush("c", "f1")
    assert parse({"type": "text.flush", "context_id": "c"}) == p.TextFlush("c", None)
    assert parse({"type": "context.end", "context_id": "c"}) == p.ContextEnd("c")
    assert parse({"type": "context.cancel", "context_id": "c"}) == p.ContextCancel("c")
    assert parse({"type": "playback.position", "context_id": "c", "played_ms": 120}) == p.PlaybackPosition("c", 120.0)
    assert parse({"type": "ping", "id": 3}) == p.Ping(3)
    assert parse({"type": "session.end"}) == p.SessionEnd()


def test_session_update_tells_null_voice_from_absent_voice():
    assert parse({"type": "session.update", "voice": None}).has_voice
    update = parse({"type": "session.update", "generation": {"temperature": 0.5}})
    assert not update.has_voice and update.generation == {"temperature": 0.5} and update.output is None


def test_unknown_type_is_ignored_not_an_error():
    assert parse({"type": "future.feature", "anything": [1, 2]}) == p.Unknown("future.feature")


@pytest.mark.parametrize("raw, code", [
    ("{not json", ErrorCode.BAD_JSON),
    ("", ErrorCode.BAD_JSON),
    ("[1, 2]", ErrorCode.BAD_MESSAGE),
    ('{"text": "no type"}', ErrorCode.BAD_MESSAGE),
    ('{"type": 5}', ErrorCode.BAD_MESSAGE),
    ('{"type": "text.append", "context_id": "c"}', ErrorCode.MISSING_FIELD),
    ('{"type": "text.append", "text": "hi"}', ErrorCode.MISSING_FIELD),
    ('{"type": "playback.position", "context_id": "c"}', ErrorCode.MISSING_FIELD),
    ('{"type": "text.append", "context_id": "c", "text": "hi", "colour": "red"}', ErrorCode.UNKNOWN_FIELD),
    ('{"type": "session.start", "speed": 2}', ErrorCode.UNKNOWN_FIELD),
    ('{"type": "session.start", "generation": {"top_k": 5}}', ErrorCode.UNKNOWN_FIELD),
    ('{"type": "session.end", "now": true}', ErrorCode.UNKNOWN_FIELD),
    ('{"type": "text.append", "context_id": 7, "text": "hi"}', ErrorCode.INVALID_VALUE),
    ('{"type": "text.append", "context_id": "c", "text": null}', ErrorCode.INVALID_VALUE),
    ('{"type": "text.append", "context_id": "", "text": "hi"}', ErrorCode.INVALID_VALUE),
    ('{"type": "playback.position", "context_id": "c", "played_ms": "10"}', ErrorCode.INVALID_VALUE),
    ('{"type": "playback.position", "context_id": "c", "played_ms": true}', ErrorCode.INVALID_VALUE),
    ('{"type": "playback.position", "context_id": "c", "played_ms": -1}', ErrorCode.INVALID_VALUE),
    ('{"type": "playback.position", "context_id": "c", "played_ms": NaN}', ErrorCode.INVALID_VALUE),
    ('{"type": "session.start", "output": "opus"}', ErrorCode.INVALID_VALUE),
    ('{"type": "session.start", "voice": 3}', ErrorCode.INVALID_VALUE),
    ('{"type": "session.start", "generation": {"cfg_value": [1]}}', ErrorCode.INVALID_VALUE),
    ('{"type": "session.start", "generation": {"temperature": "hot"}}', ErrorCode.INVALID_VALUE),
    ('{"type": "session.start", "generation": {"seed": 1.5}}', ErrorCode.INVALID_VALUE),
    ('{"type": "session.start", "generation": {"timesteps": 2.5}}', ErrorCode.INVALID_VALUE),
    ('{"type": "session.start", "generation": {"continuation": 1}}', ErrorCode.INVALID_VALUE),
])
def test_malformed_messages_get_their_error_code(raw, code):
    err = error_of(raw)
    assert err.code == code
    assert not err.fatal  # a bad message is dropped; the session carries on
    assert err.message


def test_errors_name_the_context_when_one_was_given():
    err = error_of({"type": "text.append", "context_id": "ctx-9", "text": "x", "bogus": 1})
    assert err.context_id == "ctx-9" and "bogus" in err.message


def test_text_too_long_per_message():
    limits = Limits(max_text_chars=10)
    assert parse({"type": "text.append", "context_id": "c", "text": "x" * 10}, limits) == p.TextAppend("c", "x" * 10)
    err = error_of({"type": "text.append", "context_id": "c", "text": "x" * 11}, limits)
    assert err.code == ErrorCode.TEXT_TOO_LONG and err.context_id == "c"


def test_message_too_large_counts_utf8_bytes():
    limits = Limits(max_message_bytes=100)
    # 40 three-byte characters: 40 characters but 120 bytes of UTF-8
    err = error_of(json.dumps({"type": "text.append", "context_id": "c", "text": "€" * 40}, ensure_ascii=False),
                   limits)
    assert err.code == ErrorCode.MESSAGE_TOO_LARGE


def test_binary_frames_from_the_client_are_refused():
    assert error_of(b"\x00\x01").code == ErrorCode.UNSUPPORTED_FRAME


def test_ids_longer_than_the_limit_are_refused():
    err = error_of({"type": "context.end", "context_id": "x" * 200}, Limits(max_id_chars=128))
    assert err.code == ErrorCode.INVALID_VALUE


def test_generation_settings_merge_keeps_unchanged_values():
    g = p.GenerationSettings().merged({"seed": 5})
    assert g.seed == 5 and g.cfg_value == p.GenerationSettings().cfg_value


@pytest.mark.parametrize("generation, served", [
    ({"timesteps": 13}, False), ({"timesteps": 12}, True), ({"timesteps": None}, True), ({"cfg_value": 10.5}, False),
    ({"cfg_value": 1}, True), ({"temperature": 2.01}, False), ({"temperature": 0}, True),
    ({"cfg_value": 10**400}, False),
])
def test_sampling_settings_are_checked_against_the_engines_ranges(generation, served):
    """With the engine's `SamplingRanges` (the session passes its engine's), the sampling settings get the engine
    guard's ranges and words: one definition for both."""
    from engine.guards import SamplingRanges

    ranges = SamplingRanges(max_timesteps=12)
    if served:
        assert p.check_generation(generation, ranges=ranges) == generation
        return
    with pytest.raises(ProtocolError) as e:
        p.check_generation(generation, ranges=ranges)
    name = next(iter(generation))
    assert e.value.code == ErrorCode.INVALID_VALUE and ranges.describe(name) in e.value.message


def test_server_messages_serialise_with_their_type():
    done = json.loads(p.ContextDone("c", 320.0, {"ttfb_ms": 12.5, "engine_ttfb_ms": 8.0, "rtf": 0.2,
                                                "max_gap_ms": 0.0}).encode())
    assert done == {"type": "context.done", "context_id": "c", "audio_ms": 320.0,
                    "metrics": {"ttfb_ms": 12.5, "engine_ttfb_ms": 8.0, "rtf": 0.2, "max_gap_ms": 0.0}}
    err = ProtocolError(ErrorCode.SLOW_CONSUMER, "stopped reading", fatal=True, context_id=None)
    assert json.loads(err.to_message().encode()) == {"type": "error", "code": "slow_consumer",
                                                     "message": "stopped reading", "context_id": None, "fatal": True}
    assert json.loads(p.Pong(4).encode()) == {"type": "pong", "id": 4}
    assert json.loads(p.TextFlushed("c", "f", 40.0).encode())["type"] == "text.flushed"
    cancelled = json.loads(p.ContextCancelled("c", 500.0, 200.0, "client", "Hello", "world").encode())
    assert cancelled["text_spoken"] == "Hello" and cancelled["played_source"] == "client"


def test_every_error_code_is_a_distinct_stable_string():
    values = [c.value for c in ErrorCode]
    assert len(values) == len(set(values))
    assert all(v == v.lower() and " " not in v for v in values)
    for code in ErrorCode:  # each one travels as an error message
        assert json.loads(ProtocolError(code, "m").to_message().encode())["code"] == code.value


@pytest.mark.parametrize("kind, flags, index, seq, pts", [(1, 0, 0, 0, 0), (2, p.FLAG_LAST, 65535, 2**32 - 1, 123456),
                                                          (4, 0, 7, 1, 20)])
def test_audio_frame_round_trip(kind, flags, index, seq, pts):
    data = p.pack_frame(kind, flags, index, seq, pts, b"payload")
    # magic u8, version u8, kind u8, flags u8, index u16, seq u32, pts_ms u32: 14 bytes, big-endian
    assert len(data) == p.HEADER_SIZE + len(b"payload") and p.HEADER_SIZE == 14
    assert data[0] == 0x56 and data[1] == 1  # magic 'V', version 1
    assert int.from_bytes(data[10:14], "big") == pts
    assert p.unpack_frame(data) == p.AudioFrame(kind, flags, index, seq, pts, b"payload")


def test_frame_index_and_seq_wrap_instead_of_failing():
    frame = p.unpack_frame(p.pack_frame(1, 0, 65536 + 3, 2**32 + 5, 10.7, b""))
    assert (frame.index, frame.seq, frame.pts_ms) == (3, 5, 10)


@pytest.mark.parametrize("last", [False, True])
def test_pack_frames_is_pack_frame_per_frame(last):
    payloads = [b"a", b"bb", b"", b"dddd"]
    index, seq, pts = 65536 + 9, 2**32 - 2, 1000.0  # index and seq wrap, as pack_frame wraps them
    frames = p.pack_frames(1, index, seq, pts, 20, payloads, last=last)
    assert frames == [p.pack_frame(1, p.FLAG_LAST if last and i == len(payloads) - 1 else 0, index, seq + i,
                                   pts + 20 * i, payload) for i, payload in enumerate(payloads)]


def test_unpack_rejects_what_is_not_a_frame():
    with pytest.raises(ValueError):
        p.unpack_frame(b"short")
    with pytest.raises(ValueError):
        p.unpack_frame(b"X" * 12)


# the 14-byte header itself (moved here from gateway.audio with the header)

def test_frame_header_round_trip():
    for values in ((1, 0, 0, 0, 0), (4, 1, 65535, 2**32 - 1, 2**32 - 1), (2, 0x80, 7, 123456, 98765)):
        header = p.pack_frame_header(*values)
        # PROTOCOL.md's field list (4 bytes + u16 + u32 + u32) adds up to 14, not the "12" its text says
        assert len(header) == p.HEADER_SIZE == 14
        assert header[0] == 0x56 and header[1] == 1
        assert p.unpack_frame_header(header + b"payload") == values


@pytest.mark.parametrize("field,values", [
    ("kind", (-1, 256, 1.5)), ("flags", (256,)), ("index", (65536, -1)), ("seq", (2**32,)), ("pts_ms", (-5, "0")),
])
def test_frame_header_rejects_bad_values(field, values):
    good = {"kind": 1, "flags": 0, "index": 0, "seq": 0, "pts_ms": 0}
    for value in values:
        with pytest.raises(ValueError, match=field):
            p.pack_frame_header(**{**good, field: value})


def test_unpack_frame_header_rejects_garbage():
    with pytest.raises(ValueError, match="header"):
        p.unpack_frame_header(b"V\x01")
    with pytest.raises(ValueError, match="magic"):
        p.unpack_frame_header(b"X" + p.pack_frame_header(1, 0, 0, 0, 0)[1:])
    with pytest.raises(ValueError, match="version"):
        p.unpack_frame_header(b"V\x09" + p.pack_frame_header(1, 0, 0, 0, 0)[2:])


@pytest.mark.parametrize("last", [False, True])
def test_audio_packets_carry_what_the_header_carries(last):
    """A batch's typed frames are what the native wire's header says of each (the bytes the native sink writes)."""
    payloads = [b"a", b"bb", b"ccc"]
    packets = p.AudioPackets("ctx", 65536 + 2, 2, 2**32 - 1, 39.5, 20.0, payloads, last)
    assert packets.end_ms == 39.5 + 3 * 20.0
    wire = [p.unpack_frame(data) for data in packets.encode()]
    assert packets.frames() == wire
    assert [f.seq for f in wire] == [2**32 - 1, 0, 1] and {f.index for f in wire} == {2}
    assert [f.pts_ms for f in wire] == [39, 59, 79]
    assert [f.flags for f in wire] == [0, 0, p.FLAG_LAST if last else 0]
    assert [f.payload for f in wire] == payloads
