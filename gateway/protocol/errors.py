"""The native protocol's error codes, `ProtocolError` (how every refusal reaches the client) and the per-session
`Limits` a session reports in `session.started`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from gateway.protocol.server_messages import Error


class ErrorCode(StrEnum):
    BAD_JSON = "bad_json"
    BAD_MESSAGE = "bad_message"  # not an object, or no string `type`
    UNKNOWN_FIELD = "unknown_field"
    MISSING_FIELD = "missing_field"
    INVALID_VALUE = "invalid_value"
    UNSUPPORTED_FRAME = "unsupported_frame"  # a binary frame from the client
    MESSAGE_TOO_LARGE = "message_too_large"
    NOT_STARTED = "not_started"
    ALREADY_STARTED = "already_started"
    UNKNOWN_CONTEXT = "unknown_context"
    CONTEXT_CLOSED = "context_closed"  # text for a turn after its context.end
    TOO_MANY_CONTEXTS = "too_many_contexts"
    TEXT_TOO_LONG = "text_too_long"
    BUFFER_FULL = "buffer_full"
    UNKNOWN_VOICE = "unknown_voice"
    UNKNOWN_LORA = "unknown_lora"
    UNKNOWN_PRONUNCIATION = "unknown_pronunciation"
    RATE_LIMITED = "rate_limited"
    OVERLOADED = "overloaded"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"  # a shared voice or adapter that only its owner or an operator key may change
    STORE_UNAVAILABLE = "store_unavailable"  # the shared store (Redis) cannot be reached
    IDLE_TIMEOUT = "idle_timeout"
    SLOW_CONSUMER = "slow_consumer"
    ENGINE_ERROR = "engine_error"
    SERVER_SHUTDOWN = "server_shutdown"
    INTERNAL_ERROR = "internal_error"


class ProtocolError(Exception):
    """A client mistake or a session-ending condition, reported to the client as an `error` message."""

    def __init__(self, code: ErrorCode, message: str, *, fatal: bool = False, context_id: str | None = None):
        super().__init__(f"{code}: {message}")
        self.code = ErrorCode(code)
        self.message = message
        self.fatal = fatal
        self.context_id = context_id

    def to_message(self) -> Error:
        return Error(code=str(self.code), message=self.message, context_id=self.context_id, fatal=self.fatal)


@dataclass(frozen=True)
class Limits:
    """Per-session limits; all configurable on the server, all reported in `session.started`."""

    max_message_bytes: int = 1 << 20
    max_text_chars: int = 2000  # per text.append
    max_buffered_chars: int = 8000  # text received but not yet spoken, per turn
    max_contexts: int = 4  # concurrent turns per session
    idle_timeout_s: float = 60.0
    slow_consumer_timeout_s: float = 30.0
    max_id_chars: int = 128  # context_id, flush_id

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def ws_max_msg_size(self) -> int:
        """aiohttp's cap on one WebSocket message: above it aiohttp drops the connection with close code 1009; from
        max_message_bytes up to it, the session answers with a clear message_too_large error and carries on."""
        return 2 * self.max_message_bytes + 65536
