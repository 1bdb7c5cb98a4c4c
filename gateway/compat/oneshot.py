"""One HTTP request that speaks one text (OpenAI speech, Cartesia bytes, Deepgram's REST speak): a native session
with one turn, for the length of the request.

An HTTP client buffers what it downloads, so the session runs with no lead limit: audio leaves as fast as the engine
makes it, and a client that stops reading still holds the session back through the bounded inbox. The caller asks for
s16 PCM at the rate of its container and wraps it (`compat.Transcoder`); it answers a `NativeError` in its own
protocol's form, with an HTTP status while no byte of the body has gone out."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from gateway import protocol as p
from gateway.compat import Transcoder, gateway_of, native
from gateway.protocol import ErrorCode
from gateway.session import Session

log = logging.getLogger("voxgate.compat")

INBOX_SIZE = 64  # session messages waiting for the HTTP writer: beyond this the session waits (backpressure)
CONTEXT = "speech"  # the request's one turn
# what the response writer waits for: an audio payload, or the message that says what comes next
Event = bytes | p.SessionStarted | p.SegmentStarted | p.ContextDone
Spoken = bytes | p.ContextDone  # a turn's next audio payload, or its end


class NativeError(Exception):
    """The session's `error` message (or its unexpected close), for the adapter to answer in its own form."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = str(code), message


class Inbox:
    """The session's EventSink for one HTTP request: what the session emits, queued for the response writer."""

    def __init__(self, request: web.Request, size: int = INBOX_SIZE):
        self.request = request
        self.queue: asyncio.Queue[p.ServerMessage | bytes | None] = asyncio.Queue(size)
        self.closed = False

    async def message(self, msg: p.ServerMessage) -> None:
        await self.queue.put(msg)

    async def audio(self, packets: p.AudioPackets) -> None:
        for payload in packets.payloads:  # one turn per request: only the payloads say anything new
            await self.queue.put(payload)

    async def close(self, code: int, reason: str) -> None:
        self.closed = True
        with contextlib.suppress(asyncio.QueueFull):  # a full queue: next() sees `closed` once it is drained
            self.queue.put_nowait(None)

    def abort(self) -> None:
        """The client stopped reading (the session's stall timeout): drop the connection, so a blocked write ends."""
        self.closed = True
        if self.request.transport is not None:
            self.request.transport.abort()

    async def next(self) -> Event:
        """The next audio payload, session.started, segment.started or context.done; NativeError for an error or the
        session closing."""
        while True:
            item = None if self.closed and self.queue.empty() else await self.queue.get()
            if item is None:
                raise NativeError(ErrorCode.INTERNAL_ERROR, "the synthesis session closed unexpectedly")
            if isinstance(item, bytes | p.SessionStarted | p.SegmentStarted | p.ContextDone):
                return item
            if isinstance(item, p.Error):
                raise NativeError(item.code, item.message)


class OneTurn:
    """The session of one request. `start` it (a refused voice or setting raises NativeError), then `say` the text,
    which returns the first audio (or context.done, or raises), before the response's headers are sent."""

    def __init__(self, session: Session, inbox: Inbox):
        self.session, self.inbox = session, inbox
        self.segments: list[tuple[float, str]] = []  # (pts_ms, text) of each segment started so far

    async def _next(self) -> Spoken:
        """Audio or context.done; the segments that start on the way are recorded."""
        while True:
            item = await self.inbox.next()
            if isinstance(item, p.SegmentStarted):
                self.segments.append((float(item.pts_ms), item.text))
            elif isinstance(item, bytes | p.ContextDone):
                return item

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, request: web.Request, key: str) -> AsyncIterator[OneTurn]:
        """A session counted like a native one (limits, readiness, shutdown drain) for the block; closed after it,
        which cancels its engine request when the client went away."""
        gw = gateway_of(request)
        inbox = Inbox(request)
        config = dataclasses.replace(gw.config.session, max_lead_ms=math.inf, max_lead_ms_telephony=math.inf)
        session = gw.session(inbox, key, config)
        session.open()
        with gw.tracked(session, key):
            try:
                yield cls(session, inbox)
            finally:
                await session.close()

    async def start(self, *, voice: str | None, sample_rate: int, generation: dict[str, Any] | None = None) -> None:
        """session.start asking for s16 PCM at `sample_rate`; waits for session.started."""
        await self.session.receive(native("session.start", voice=voice, generation=generation or {},
                                          output={"format": "pcm_s16le", "sample_rate": sample_rate}))
        await self.inbox.next()

    async def say(self, text: str) -> Spoken:
        """The whole text as the turn's input (in pieces of the session's message limit), then its end."""
        step = self.session.limits.max_text_chars
        for i in range(0, len(text), step):
            await self.session.receive(native("text.append", context_id=CONTEXT, text=text[i:i + step]))
        await self.session.receive(native("context.end", context_id=CONTEXT))
        return await self._next()

    async def speak(self, text: str, *, voice: str | None, sample_rate: int,
                    generation: dict[str, Any] | None = None) -> Spoken:
        """`start`, then `say`: the first audio (or context.done); NativeError if either is refused."""
        await self.start(voice=voice, sample_rate=sample_rate, generation=generation)
        return await self.say(text)

    async def collect(self, first: Spoken, transcoder: Transcoder) -> tuple[bytes, p.ContextDone]:
        """All of the turn's audio, from `first` on, through the transcoder, and context.done: for an answer sent
        whole. NativeError if the turn fails."""
        parts, item = [], first
        while isinstance(item, bytes):
            parts.append(transcoder.write(item))
            item = await self._next()
        parts.append(transcoder.finish())
        return b"".join(parts), item

    async def respond(self, request: web.Request, first: Spoken, transcoder: Transcoder,
                      headers: dict[str, str], frame: Callable[[bytes], bytes] | None = None,
                      trailer: Callable[[p.ContextDone], bytes] | None = None,
                      segment_done: Callable[[int, float], bytes] | None = None) -> web.StreamResponse:
        """The turn's audio, from `first` on, through the transcoder as the chunked body of a 200 response (`frame`
        wraps each piece; `trailer` makes a last piece from context.done; `segment_done(k, end_ms)` one for each
        segment but the last as soon as the next starts). A failure midway cuts the body short: its status has gone
        out already."""
        response = web.StreamResponse(headers={"Cache-Control": "no-cache", **headers})
        response.enable_chunked_encoding()
        await response.prepare(request)

        async def write(data: bytes) -> None:
            if data:
                await response.write(frame(data) if frame is not None else data)

        try:
            item, reported = first, 1  # segments whose start has been reported (the first ends no other)
            while isinstance(item, bytes):
                await write(transcoder.write(item))
                item = await self._next()
                while segment_done is not None and reported < len(self.segments):
                    await response.write(segment_done(reported - 1, self.segments[reported][0]))
                    reported += 1
            await write(transcoder.finish())
            if trailer is not None:
                await response.write(trailer(item))
            await response.write_eof()
        except NativeError as e:
            log.info("%s %s ended early: %s", request.method, request.path, e.message)
        except ConnectionError:  # the client went away; closing the session cancels the engine request
            pass
        return response
