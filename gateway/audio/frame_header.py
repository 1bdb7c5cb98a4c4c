"""The 14-byte header in front of every binary audio frame of the native protocol (PROTOCOL.md)."""

from __future__ import annotations

import struct

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
    frame_ms`; `last` flags the final one. The bytes of pack_frame_header per frame without its per-field checks
    (this runs for every frame the gateway sends): kind comes from OutputFormat, the counters wrap."""
    head, index, final = _HEADER.pack, index & 0xFFFF, len(payloads) - 1 if last else -1
    return [head(FRAME_MAGIC, FRAME_VERSION, kind, FLAG_LAST if i == final else 0, index, (seq + i) & 0xFFFFFFFF,
                 int(pts_ms + i * frame_ms) & 0xFFFFFFFF) + payload for i, payload in enumerate(payloads)]


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
