"""The native streaming protocol, sans I/O (docs/PROTOCOL.md is the reference), by job: `client_messages` (client
frames parsed and validated into dataclasses), `server_messages` (what the session core emits, serialised only by the
native transport), `frames` (typed audio packets and the 14-byte binary header), `errors` (error codes,
`ProtocolError`, `Limits`) and `sink` (`EventSink`, where a session's typed output goes). Every public name is
importable from here (`from gateway import protocol as p`)."""

from gateway.protocol.client_messages import (
    MAX_INSTRUCTION_CHARS,
    MAX_PRONUNCIATIONS,
    SAMPLING_SETTINGS,
    ClientMessage,
    ContextCancel,
    ContextEnd,
    GenerationSettings,
    Ping,
    PlaybackPosition,
    SessionEnd,
    SessionStart,
    SessionUpdate,
    TextAppend,
    TextFlush,
    Unknown,
    check_generation,
    load_json,
    parse_client_message,
)
from gateway.protocol.errors import ErrorCode, Limits, ProtocolError
from gateway.protocol.frames import (
    FLAG_LAST,
    FRAME_MAGIC,
    FRAME_VERSION,
    HEADER_SIZE,
    AudioFrame,
    AudioPackets,
    pack_frame,
    pack_frame_header,
    pack_frames,
    unpack_frame,
    unpack_frame_header,
)
from gateway.protocol.server_messages import (
    PROTOCOL_VERSION,
    ContextCancelled,
    ContextDone,
    ContextStarted,
    Error,
    Pong,
    SegmentStarted,
    ServerMessage,
    SessionStarted,
    SessionUpdated,
    TextFlushed,
)
from gateway.protocol.sink import EventSink

__all__ = [
    "MAX_INSTRUCTION_CHARS", "MAX_PRONUNCIATIONS", "SAMPLING_SETTINGS", "ClientMessage", "ContextCancel", "ContextEnd",
    "GenerationSettings", "PlaybackPosition", "Ping", "SessionEnd", "SessionStart", "SessionUpdate", "TextAppend",
    "TextFlush", "Unknown", "check_generation", "load_json", "parse_client_message", "ErrorCode", "Limits",
    "ProtocolError", "FLAG_LAST", "FRAME_MAGIC", "FRAME_VERSION", "HEADER_SIZE", "AudioFrame", "AudioPackets",
    "pack_frame", "pack_frame_header", "pack_frames", "unpack_frame", "unpack_frame_header", "PROTOCOL_VERSION",
    "ContextCancelled", "ContextDone", "ContextStarted", "Error", "Pong", "SegmentStarted", "ServerMessage",
    "SessionStarted", "SessionUpdated", "TextFlushed", "EventSink",
]
