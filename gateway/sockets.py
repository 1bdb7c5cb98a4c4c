"""What every WebSocket endpoint (native, compat, Twilio) needs besides its protocol: a close after an oversized
message that the client actually receives, pings answered, a read-lag probe that finds clients that stopped reading,
and a deadline for the first message of a socket that identifies itself with it. No protocol knowledge here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from aiohttp import WSCloseCode, WSMessage, WSMsgType, web

from gateway.loop_lanes import Lane, lane

log = logging.getLogger("voxgate.sockets")

# after close 1009 the client is often still sending the rest of its oversized message: the server keeps reading (and
# discarding) until the client closes or this passes, so closing never resets the connection under the close frame
LINGER_S = 2.0
PROBE_INTERVAL_S = 5.0  # at most this long between read-lag pings (shorter for short stall times)


class FirstMessageTimeout(TimeoutError):
    """The socket's first message did not come within its deadline."""


class ClientSocket(web.WebSocketResponse):
    """aiohttp's server WebSocket, whose close 1009 (a message over max_msg_size) reaches the client.

    aiohttp closes the TCP connection right after its close frame; a client still sending the oversized message then
    gets a reset, and a reset discards the close frame in the client's receive buffer. Here the close frame is
    followed by a half-close (FIN) and the connection stays open, its input discarded (aiohttp's reader has stopped
    parsing), until the client closes or LINGER_S passes.

    `data_at`: when bytes last came in from the client (time.monotonic), stamped as the connection reads them, before
    any handler runs: under a burst, a message read now may wait for other sessions' handlers before its own runs.
    `lane`: the loop's lane (`gateway.loop_lanes`), told when bytes come in and when the handler asks for the next
    message, while a `Messages` reads the socket."""

    data_at: float | None = None
    lane: Lane | None = None

    def _post_start(self, request: web.BaseRequest, protocol: str | None, writer: Any) -> None:
        super()._post_start(request, protocol, writer)
        handler = request.protocol
        # aiohttp (3.12+) calls this hook from data_received, before parsing; it sets one only for its own heartbeat
        # (these sockets have none: `Messages` pings). Without the hook data_at stays None: handler time is used.
        if handler is not None and hasattr(handler, "_data_received_cb") and handler._data_received_cb is None:
            handler._data_received_cb = self._data_received

    def _data_received(self) -> None:
        self.data_at = time.monotonic()
        if self.lane is not None:
            self.lane.read(self)

    def has_message(self) -> bool:
        """A message read off the socket waits for its handler (parsed, not yet taken)."""
        return bool(getattr(self._reader, "_buffer", None))

    def handled(self) -> None:
        """The handler asks for the next message: unless one is parsed already, none waits."""
        if self.lane is not None and not self.has_message():
            self.lane.handled(self)

    def detach_lane(self) -> None:
        """The socket's reading ends."""
        if self.lane is not None:
            self.lane.handled(self)
        self.lane = None

    async def close(self, *, code: int = WSCloseCode.OK, message: bytes = b"", drain: bool = True) -> bool:
        request = self._req
        transport = request.transport if request is not None else None
        if code != WSCloseCode.MESSAGE_TOO_BIG or self.closed or transport is None or self._writer is None:
            return await super().close(code=code, message=message, drain=drain)
        self._set_closed()
        self._close_code = WSCloseCode.MESSAGE_TOO_BIG
        with contextlib.suppress(Exception):
            await self._writer.close(code, message)
            if transport.can_write_eof():
                transport.write_eof()
            loop = asyncio.get_running_loop()
            end = loop.time() + LINGER_S
            while not transport.is_closing() and loop.time() < end:
                await asyncio.sleep(0.02)
        transport.close()
        return True


async def open_socket(request: web.Request, max_msg_size: int, send_buffer: int | None = None,
                      **kwargs: Any) -> ClientSocket:
    """The upgraded WebSocket of an endpoint (pings are answered by `Messages`, which also sends its own);
    `send_buffer`: the socket's SO_SNDBUF (None: the kernel's default)."""
    ws = ClientSocket(max_msg_size=max_msg_size, compress=False, autoping=False, **kwargs)
    await ws.prepare(request)
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if send_buffer and sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    return ws


class Messages:
    """A socket's text and binary messages, as `async with Messages(...) as messages: async for msg in messages`.

    Besides: the client's pings are answered; a ping of our own goes out every few seconds behind whatever audio is
    queued, and if its pong has not come back after `stall_s` the client has not read for that long, wherever the
    unread bytes sit (our buffers, the kernel's, the client's), so `on_stall` drops it. `first_within_s`: the first
    message must come within that many seconds (FirstMessageTimeout otherwise). `arrived_at`: when the last message
    given out came in (time.monotonic of the socket's newest read: the one that delivered it or a later one, so never
    earlier than the truth), or None where unknown."""

    def __init__(self, ws: web.WebSocketResponse, *, stall_s: float, on_stall: Callable[[], None],
                 first_within_s: float | None = None):
        self.ws, self.stall_s, self.on_stall = ws, stall_s, on_stall
        loop = asyncio.get_running_loop()
        self._deadline = None if first_within_s is None else loop.time() + first_within_s
        self._ping: tuple[bytes, float] | None = None  # (payload, when sent) of the ping waiting for its pong
        self._pings = 0
        self._probe: asyncio.Task | None = None
        self._sends: set[asyncio.Task] = set()
        self.arrived_at: float | None = None

    async def __aenter__(self) -> Messages:
        self._probe = asyncio.create_task(self._watch())
        if isinstance(self.ws, ClientSocket):  # its reads tell the loop's lane that a message waits
            self.ws.lane = lane()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._probe is not None:
            self._probe.cancel()
        if isinstance(self.ws, ClientSocket):
            self.ws.detach_lane()
        # control frames still being sent end with the connection (held in _sends until then)

    def __aiter__(self) -> Messages:
        return self

    async def __anext__(self) -> WSMessage:
        while True:
            timeout = None
            if self._deadline is not None:
                timeout = self._deadline - asyncio.get_running_loop().time()
                if timeout <= 0:
                    raise FirstMessageTimeout
            if isinstance(self.ws, ClientSocket):
                self.ws.handled()  # the previous message's handler is done
            try:
                msg = await self.ws.receive(timeout=timeout)
            except TimeoutError:
                raise FirstMessageTimeout from None
            if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                self._deadline = None
                # the newest read: this message's own, or (when it was queued behind others) a later one
                self.arrived_at = getattr(self.ws, "data_at", None)
                return msg
            if msg.type == WSMsgType.PING:
                self._send(self.ws.pong(msg.data))
            elif msg.type == WSMsgType.PONG:
                if self._ping is not None and msg.data == self._ping[0]:
                    self._ping = None
            else:  # CLOSE, CLOSING, CLOSED, ERROR (aiohttp has closed the socket with its code)
                raise StopAsyncIteration

    def _send(self, coro: Any) -> None:
        """A control frame, not awaited here: behind a client that stopped reading it may wait for the socket."""
        task = asyncio.create_task(_quietly(coro))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        interval = min(PROBE_INTERVAL_S, self.stall_s / 4)
        while not self.ws.closed:
            await asyncio.sleep(interval)
            if self._ping is None:
                self._pings += 1
                payload = str(self._pings).encode()
                self._ping = (payload, loop.time())
                self._send(self.ws.ping(payload))
            elif loop.time() - self._ping[1] >= self.stall_s:
                log.info("a client has not read for %.3g s (no pong): dropping it", self.stall_s)
                self.on_stall()
                return


async def _quietly(coro: Any) -> None:
    with contextlib.suppress(ConnectionError, RuntimeError):
        await coro


def abort(request: web.Request) -> None:
    """Drop the connection now, unsent bytes and all."""
    if request.transport is not None:
        request.transport.abort()
