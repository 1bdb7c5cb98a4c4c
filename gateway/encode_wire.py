"""The byte framing between the gateway and its encoder processes (`gateway.encode_procs`, `gateway.encode_child`).

A request is a fixed header and a payload (float32 samples for the encode calls, the pickled `OutputFormat` once per
turn at open); a response is a fixed header, then its packets' lengths and their bytes. Both sides read whatever the
socket holds and take every whole message out of it, so many turns' results come back in one read.

A chunk's samples travel in a slot of memory the two processes share (SLOTS of them, one per call in the process
while they last): copying 30 kB there costs the gateway's loop a few microseconds, pushing it through the socket several
times that. A payload larger than a slot, or sent when every slot is taken, goes inline, after its header.

A request carries its deadline (ms on `time.monotonic()`, a clock every process on the machine shares: CLOCK_MONOTONIC
on Linux), so the process serves the calls it holds earliest deadline first, whenever they were sent."""

from __future__ import annotations

import struct

# request: op, urgent (answer at once, not with the rest of a batch), slot (INLINE: the payload follows), call id,
# encoder id, two int args, payload bytes, deadline
REQUEST = struct.Struct("<BBbIIiiId")
INLINE = -1
SLOT_BYTES = 128 << 10  # a slot holds 1 s of float32 samples at 32 kHz (a 160 ms chunk at 48 kHz is 30 kB)
SLOTS = 16  # the window's calls and the urgent ones sent past it (`gateway.encode_procs`); 2 MiB mapped a process
# response: call id, packet count (ERROR: the payload is the failure's text), an int result, payload bytes
RESPONSE = struct.Struct("<IiiI")
ERROR = -1

# OPEN, CLOSE and COUNT are done as soon as they are read (cheap; what they change, the calls read after them need)
OPEN = 1  # a1: input rate; payload: pickled OutputFormat; no response
ENCODE = 2  # payload: float32 samples -> packets
HEAD = 3  # a1: frames, a2: step; payload: float32 samples -> packets, input samples used
DRAIN = 4  # -> packets, samples of silence added
FINISH = 5  # -> packets
CLOSE = 6  # no response
COUNT = 7  # -> the encoders open in the process (tests, leak checks)


def request(op: int, urgent: bool, call_id: int, encoder_id: int, a1: int = 0, a2: int = 0, size: int = 0,
            slot: int = INLINE, deadline: float = 0.0) -> bytes:
    """A request's header; its `size` payload bytes follow it, or are in shared slot `slot`."""
    return REQUEST.pack(op, urgent, slot, call_id, encoder_id, a1, a2, size, deadline)


def response(call_id: int, packets: list[bytes], value: int = 0) -> bytes:
    """A whole response: header, the packets' lengths, their bytes."""
    lengths = struct.pack(f"<{len(packets)}I", *map(len, packets))
    body = b"".join(packets)
    return RESPONSE.pack(call_id, len(packets), value, len(lengths) + len(body)) + lengths + body


def failure(call_id: int, message: str) -> bytes:
    """A whole response saying the call failed, and why."""
    text = message.encode("utf-8", "replace")
    return RESPONSE.pack(call_id, ERROR, 0, len(text)) + text


def packets_of(data: bytes, start: int, count: int) -> list[bytes]:
    """The `count` packets of a response body that starts at `start` in `data`."""
    lengths = struct.unpack_from(f"<{count}I", data, start)
    out = []
    pos = start + 4 * count
    for n in lengths:
        out.append(data[pos:pos + n])
        pos += n
    return out
