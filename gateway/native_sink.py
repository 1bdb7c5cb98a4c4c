"""The native WebSocket's `EventSink`: the one place a session's typed output becomes the native wire (JSON text frames,
binary frames behind the 14-byte header), written in as few socket writes as the client's reading allows."""

from __future__ import annotations

import struct

from aiohttp import web

from gateway.protocol import HEADER_SIZE, AudioFrame, AudioPackets, ServerMessage, pack_frame

RAW_WRITE_LIMIT = 64 << 10  # bytes queued in the transport above which sends go through aiohttp (and wait)
# below this, no send can make aiohttp wait for the socket to drain (it waits only once asyncio's transport pauses
# writing, at its high-water mark of 64 KiB), so the session needs no stall timer for it
SEND_READY_LIMIT = 16 << 10
_WS_LEN7 = struct.Struct("!BB")
_WS_LEN16 = struct.Struct("!BBH")
_WS_LEN64 = struct.Struct("!BBQ")


def ws_audio(packets: AudioPackets) -> bytes:
    """A batch's frames as consecutive binary WebSocket messages, one buffer for one socket write (one syscall per
    engine chunk rather than per 20 ms frame), each payload copied once. Server frames are unmasked, so framing them
    is the RFC 6455 header alone; aiohttp writes its own frames to the same transport synchronously, so order is
    kept. `NativeSink.audio` writes it while the client keeps up; once bytes pile up in the transport, aiohttp's own
    send path takes over: it waits for the socket to drain, which is what the session's stall timeout watches."""
    parts: list[bytes] = []
    small = _WS_SMALL
    for head, payload in zip(packets.headers(), packets.payloads, strict=True):
        n = HEADER_SIZE + len(payload)
        parts += (small[n] if n < 126 else _ws_binary_header(n), head, payload)
    return b"".join(parts)


def _ws_binary_header(n: int) -> bytes:
    """RFC 6455 header of one unmasked, final binary frame of n bytes."""
    if n < 126:
        return _WS_LEN7.pack(0x82, n)
    if n < 1 << 16:
        return _WS_LEN16.pack(0x82, 126, n)
    return _WS_LEN64.pack(0x82, 127, n)


# the headers of frames under 126 bytes, made once: a 20 ms Opus frame at the default 32 kb/s (~80 bytes) and its
# 14-byte header are
_WS_SMALL = [_ws_binary_header(n) for n in range(126)]


class NativeSink:
    """The native protocol's `EventSink`: the one place a session's messages become JSON text frames and its audio
    packets binary frames behind the 14-byte header."""

    def __init__(self, ws: web.WebSocketResponse, request: web.Request):
        self.ws, self.request = ws, request

    async def message(self, msg: ServerMessage) -> None:
        await self.ws.send_str(msg.encode())

    async def audio(self, packets: AudioPackets) -> None:
        transport = self.request.transport
        if transport is None or self.ws.closed or transport.get_write_buffer_size() > RAW_WRITE_LIMIT:
            for data in packets.encode():
                await self.ws.send_bytes(data)
            return
        if transport.is_closing():
            raise ConnectionResetError("the connection is closing")
        transport.write(ws_audio(packets))

    def audio_now(self, packets: AudioPackets) -> bool:
        """`audio` done synchronously if the socket takes it without waiting (True); else nothing is written."""
        transport = self.request.transport
        if not self.send_ready() or self.ws.closed or transport.is_closing():
            return False
        transport.write(ws_audio(packets))
        return True

    async def frame(self, frame: AudioFrame) -> None:
        """One binary frame outside a turn's batches (a Twilio call's caller audio on its control socket); index, seq
        and pts wrap as the header's fields do."""
        await self.ws.send_bytes(pack_frame(frame.kind, frame.flags, frame.index, frame.seq, frame.pts_ms,
                                            frame.payload))

    def send_ready(self) -> bool:
        """Little is queued for the socket, so a send completes without waiting for the client."""
        transport = self.request.transport
        return transport is not None and transport.get_write_buffer_size() < SEND_READY_LIMIT


    async def close(self, code: int, reason: str) -> None:
        await self.ws.close(code=code, message=reason.encode()[:120])

    def abort(self) -> None:
        if self.request.transport is not None:
            self.request.transport.abort()
