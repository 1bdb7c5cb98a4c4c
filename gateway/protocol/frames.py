"""Audio out of the session core, typed: `AudioPackets` (a batch of one turn's consecutive frames, what the core emits
to its `EventSink`) and `AudioFrame` (one frame); and the native protocol's 14-byte binary header in front of every
frame on the native WebSocket (PROTOCOL.md), which only the native transport writes (`AudioPackets.encode`)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

# magic u8 'V', version u8, kind u8, flags u8, index u16, seq u32, pts_ms u32: 14 bytes (PROTOCOL.md's "12-byte"
# disagrees with its own field list), network byte order (big-endian: DataView's default in the browser).

FRAME_MAGIC = 0x56  # 'V'
FRAME_VERSION = 1
_HEADER = struct.Struct("!BBBBHII")
HEADER_SIZE = _HEADER.size
FLAG_LAST = 0x01  # last frame of the turn


def pack_frame_header(kind: int, flags: int, index: int, seq: int, pts_ms: int) -> bytes:
    """The 14-byte header in front of every binary audio frame."""
    for name, value, top in (("kind", kind, 0xFF), ("flags", flags, 0xFF), ("index", index, 0xFFFF),
                             ("seq", seq, 0xFFFFFFFF), ("pts_ms", pts_ms, 0xFFFFFFFF)):
        if type(value) is not int or not 0 <= value <= top:
            raise ValueError(f"{name}: {value!r} is not an integer in 0..{top}")
    return _HEADER.pack(FRAME_MAGIC, FRAME_VERSION, kind, flags, index, seq, pts_ms)


def pack_frames(kind: int, index: int, seq: int, pts_ms: float, frame_ms: float, payloads: list[bytes],
                last: bool = False) -> list[bytes]:
    """Consecutive frames of one turn, header + payload each: `payloads[i]` gets seq `seq + i` and pts `pts_ms + i *
    frame_ms`; `last` flags the final one."""
    return [head + payload for head, payload in zip(frame_headers(kind, index, seq, pts_ms, frame_ms, len(payloads),
                                                                  last), payloads, strict=True)]


def frame_headers(kind: int, index: int, seq: int, pts_ms: float, frame_ms: float, count: int,
                  last: bool = False) -> list[bytes]:
    """The headers of `pack_frames`, alone (a writer that gathers its parts copies each payload once). The bytes of
    pack_frame_header per frame without its per-field checks (this runs for every frame the gateway sends): kind
    comes from OutputFormat, the counters wrap."""
    head, index, final = _HEADER.pack, index & 0xFFFF, count - 1 if last else -1
    return [head(FRAME_MAGIC, FRAME_VERSION, kind, FLAG_LAST if i == final else 0, index, (seq + i) & 0xFFFFFFFF,
                 int(pts_ms + i * frame_ms) & 0xFFFFFFFF) for i in range(count)]


def unpack_frame_header(data: bytes) -> tuple[int, int, int, int, int]:
    """(kind, flags, index, seq, pts_ms) from the first HEADER_SIZE bytes of a binary frame."""
    if len(data) < HEADER_SIZE:
        raise ValueError(f"header: {len(data)} bytes, need {HEADER_SIZE}")
    magic, version, kind, flags, index, seq, pts_ms = _HEADER.unpack_from(data)
    if magic != FRAME_MAGIC:
        raise ValueError(f"magic: 0x{magic:02x}, expected 0x{FRAME_MAGIC:02x}")
    if version != FRAME_VERSION:
        raise ValueError(f"version: {version} is not supported (expected {FRAME_VERSION})")
    return kind, flags, index, seq, pts_ms


@dataclass(frozen=True)
class AudioFrame:
    """One audio frame: its header's fields and its payload."""

    kind: int  # 1 opus, 2 pcm_s16le, 3 mulaw, 4 alaw
    flags: int  # FLAG_LAST on the turn's last frame
    index: int  # the context's index from context.started
    seq: int  # per context, from 0
    pts_ms: int  # where this frame starts in the turn's audio
    payload: bytes


@dataclass(frozen=True, slots=True)
class AudioPackets:
    """Consecutive frames of one turn, as the session sends them in one write: frame i has seq `seq + i` and starts at
    `pts_ms + i * frame_ms`; `last`: the batch ends with the turn's last frame. One object per batch, not per frame
    (this is the gateway's hottest path); `frames()` gives them one by one."""

    context_id: str
    index: int  # the context's index from context.started
    kind: int  # the format's header kind (gateway.audio.KINDS)
    seq: int
    pts_ms: float
    frame_ms: float
    payloads: list[bytes]
    last: bool = False

    @property
    def end_ms(self) -> float:
        """Where the batch's audio ends in the turn."""
        return self.pts_ms + len(self.payloads) * self.frame_ms

    def frames(self) -> list[AudioFrame]:
        """Each frame with the fields its header carries (index, seq and pts wrapped as the header does)."""
        final = len(self.payloads) - 1 if self.last else -1
        return [AudioFrame(self.kind, FLAG_LAST if i == final else 0, self.index & 0xFFFF,
                           (self.seq + i) & 0xFFFFFFFF, int(self.pts_ms + i * self.frame_ms) & 0xFFFFFFFF, payload)
                for i, payload in enumerate(self.payloads)]

    def encode(self) -> list[bytes]:
        """The native WebSocket's binary messages: header + payload per frame."""
        return pack_frames(self.kind, self.index, self.seq, self.pts_ms, self.frame_ms, self.payloads, self.last)

    def headers(self) -> list[bytes]:
        """Each frame's header, in order (`encode` without the payloads)."""
        return frame_headers(self.kind, self.index, self.seq, self.pts_ms, self.frame_ms, len(self.payloads),
                             self.last)


def pack_frame(kind: int, flags: int, index: int, seq: int, pts_ms: float, payload: bytes) -> bytes:
    """Header + payload of one binary audio message (index and seq wrap, as the header is fixed-width)."""
    return pack_frame_header(kind, flags, index & 0xFFFF, seq & 0xFFFFFFFF, int(pts_ms) & 0xFFFFFFFF) + payload


def unpack_frame(data: bytes) -> AudioFrame:
    """Parse one binary audio message; ValueError if it is not one."""
    kind, flags, index, seq, pts_ms = unpack_frame_header(data)
    return AudioFrame(kind, flags, index, seq, pts_ms, bytes(data[HEADER_SIZE:]))
