"""A small async client for the native protocol (the `websockets` library), for tests, benchmarks and voice agents.

    async with await VoxgateClient.connect("ws://127.0.0.1:8080/v1/stream") as c:
        await c.start(output={"format": "pcm_s16le", "sample_rate": 24000})
        await c.append("Hello there. ", "t1")
        await c.end("t1")
        async for event in c:
            ...  # dict (JSON messages) or AudioFrame (binary audio)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from gateway.protocol import AudioFrame, unpack_frame


class ServerError(Exception):
    """An `error` message from the server."""

    def __init__(self, event: dict[str, Any]):
        super().__init__(f"{event.get('code')}: {event.get('message')}")
        self.code: str = event.get("code", "")
        self.event = event


@dataclass
class Utterance:
    """Everything one turn produced, as collected by `VoxgateClient.speak`."""

    context_id: str
    frames: list[AudioFrame] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    done: dict[str, Any] | None = None
    ttfb_ms: float | None = None  # client side: first append sent -> first audio frame received

    @property
    def payloads(self) -> list[bytes]:
        return [f.payload for f in self.frames]


class VoxgateClient:
    def __init__(self, ws: ClientConnection):
        self.ws = ws
        self.session: dict[str, Any] | None = None
        self.indexes: dict[int, str] = {}  # binary frame index -> context_id

    @classmethod
    async def connect(cls, url: str, *, api_key: str | None = None, token: str | None = None,
                      open_timeout: float = 10.0, **kwargs: Any) -> VoxgateClient:
        """Open the WebSocket (no compression: audio does not compress, and it costs latency)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        if token:
            url += ("&" if "?" in url else "?") + f"token={token}"
        ws = await connect(url, additional_headers=headers, compression=None, open_timeout=open_timeout,
                           max_size=None, **kwargs)
        return cls(ws)

    async def __aenter__(self) -> VoxgateClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ------------------------------------------------------------------------------------------------ sending

    async def send(self, message: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(message))

    async def start(self, *, voice: str | None = None, output: dict | None = None, chunking: dict | None = None,
                    generation: dict | None = None, timeout: float = 10.0) -> dict[str, Any]:
        """session.start; returns session.started (ServerError on error)."""
        msg: dict[str, Any] = {"type": "session.start"}
        for name, value in (("output", output), ("chunking", chunking), ("generation", generation)):
            if value is not None:
                msg[name] = value
        if voice is not None:
            msg["voice"] = voice
        await self.send(msg)
        self.session = await self.expect("session.started", timeout=timeout)
        return self.session

    async def append(self, text: str, context_id: str = "0") -> None:
        await self.send({"type": "text.append", "context_id": context_id, "text": text})

    async def flush(self, context_id: str = "0", flush_id: str | None = None) -> None:
        msg = {"type": "text.flush", "context_id": context_id}
        if flush_id is not None:
            msg["flush_id"] = flush_id
        await self.send(msg)

    async def end(self, context_id: str = "0") -> None:
        await self.send({"type": "context.end", "context_id": context_id})

    async def cancel(self, context_id: str = "0") -> None:
        await self.send({"type": "context.cancel", "context_id": context_id})

    async def position(self, context_id: str, played_ms: float) -> None:
        await self.send({"type": "playback.position", "context_id": context_id, "played_ms": played_ms})

    async def update(self, **settings: Any) -> None:
        await self.send({"type": "session.update", **settings})

    async def ping(self, ping_id: str | int | None = None) -> None:
        await self.send({"type": "ping", "id": ping_id})

    async def close(self) -> None:
        """session.end, then close the socket."""
        with contextlib.suppress(ConnectionClosed):
            await self.send({"type": "session.end"})
        await self.ws.close()

    # ------------------------------------------------------------------------------------------------ receiving

    async def recv(self, timeout: float | None = None) -> dict[str, Any] | AudioFrame:
        """The next message: a dict for JSON, an AudioFrame for binary audio. ConnectionClosed at the end."""
        if timeout is None:
            data = await self.ws.recv()
        else:
            async with asyncio.timeout(timeout):
                data = await self.ws.recv()
        if isinstance(data, bytes):
            return unpack_frame(data)
        event = json.loads(data)
        if event.get("type") == "context.started":
            self.indexes[event["index"]] = event["context_id"]
        return event

    def __aiter__(self) -> VoxgateClient:
        return self

    async def __anext__(self) -> dict[str, Any] | AudioFrame:
        try:
            return await self.recv()
        except ConnectionClosed:
            raise StopAsyncIteration from None

    async def expect(self, kind: str, timeout: float = 10.0) -> dict[str, Any]:
        """Skip to the next JSON message of this type; raises ServerError on an `error` message."""
        while True:
            event = await self.recv(timeout)
            if isinstance(event, dict):
                if event.get("type") == kind:
                    return event
                if event.get("type") == "error" and kind != "error":
                    raise ServerError(event)

    async def collect(self, context_id: str, timeout: float = 60.0, started_at: float | None = None) -> Utterance:
        """Frames and events of one turn until its context.done (ServerError on an error for it or the session).

        `started_at` (time.perf_counter()) is when its text went out: it gives the client-side time to first audio."""
        utt = Utterance(context_id)
        while utt.done is None:
            event = await self.recv(timeout)
            if isinstance(event, AudioFrame):
                if self.indexes.get(event.index) == context_id:
                    if utt.ttfb_ms is None and started_at is not None:
                        utt.ttfb_ms = (time.perf_counter() - started_at) * 1000.0
                    utt.frames.append(event)
                continue
            if event.get("context_id") not in (context_id, None):
                continue
            utt.events.append(event)
            if event["type"] == "error":
                raise ServerError(event)
            if event["type"] == "context.done":
                utt.done = event
        return utt

    async def speak(self, text: str, context_id: str = "0", timeout: float = 60.0) -> Utterance:
        """One whole turn: append, end, collect."""
        started_at = time.perf_counter()
        await self.append(text, context_id)
        await self.end(context_id)
        return await self.collect(context_id, timeout, started_at)
