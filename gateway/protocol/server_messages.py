"""Server -> client messages of the native protocol: typed dataclasses the session core emits (to an `EventSink`),
serialised to JSON only by the native transport (`encode`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, ClassVar

PROTOCOL_VERSION = 1

# one encoder for every message: json.dumps with options builds a JSONEncoder per call
_encode_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class ServerMessage:
    """A message from the server; each subclass is one `type` of PROTOCOL.md."""

    TYPE: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        """The message as the JSON object the protocol defines."""
        cls = type(self)
        names = _NAMES.get(cls) or _field_names(cls)
        out: dict[str, Any] = {"type": self.TYPE}
        for name in names:
            out[name] = getattr(self, name)
        return out

    def encode(self) -> str:
        """The message as one compact JSON text frame (the native sink's wire form)."""
        return _encode_json(self.to_dict())


# each message class's field names, in order: `dataclasses.fields` per message is a third of its encoding
_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type[ServerMessage]) -> tuple[str, ...]:
    names = _NAMES[cls] = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]
    return names


@dataclass(frozen=True)
class SessionStarted(ServerMessage):
    TYPE: ClassVar[str] = "session.started"
    session_id: str
    output: dict[str, Any]
    chunking: dict[str, Any]
    generation: dict[str, Any]
    voice: str | None
    model: dict[str, Any]
    limits: dict[str, Any]
    protocol_version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class SessionUpdated(ServerMessage):
    TYPE: ClassVar[str] = "session.updated"
    output: dict[str, Any]
    chunking: dict[str, Any]
    generation: dict[str, Any]
    voice: str | None


@dataclass(frozen=True)
class ContextStarted(ServerMessage):
    TYPE: ClassVar[str] = "context.started"
    context_id: str
    index: int
    output: dict[str, Any]


@dataclass(frozen=True)
class SegmentStarted(ServerMessage):
    TYPE: ClassVar[str] = "segment.started"
    context_id: str
    segment: int
    text: str
    pts_ms: float


@dataclass(frozen=True)
class TextFlushed(ServerMessage):
    TYPE: ClassVar[str] = "text.flushed"
    context_id: str
    flush_id: str | None
    audio_ms: float


@dataclass(frozen=True)
class ContextDone(ServerMessage):
    TYPE: ClassVar[str] = "context.done"
    context_id: str
    audio_ms: float
    metrics: dict[str, float | None]


@dataclass(frozen=True)
class ContextCancelled(ServerMessage):
    TYPE: ClassVar[str] = "context.cancelled"
    context_id: str
    audio_sent_ms: float
    audio_played_ms: float
    played_source: str  # "client" (from playback.position) or "estimate" (from send times)
    text_spoken: str
    text_remaining: str


@dataclass(frozen=True)
class Error(ServerMessage):
    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    context_id: str | None = None
    fatal: bool = False


@dataclass(frozen=True)
class Pong(ServerMessage):
    TYPE: ClassVar[str] = "pong"
    id: str | int | None = None
