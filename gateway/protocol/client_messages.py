"""Client -> server messages of the native protocol, sans I/O: each frame parsed and validated into a dataclass
(every malformed one a typed `ProtocolError`), the generation settings and their rules, and `load_json`, the one
way client JSON is read. docs/PROTOCOL.md is the reference."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from gateway.protocol.errors import ErrorCode, Limits, ProtocolError
from gateway.text.normalize import MODES as NORMALIZE_MODES
from gateway.text.unicode_text import first_invalid, is_text

MAX_INSTRUCTION_CHARS = 500  # a style instruction is prefill text of a turn's first segment: kept short
MAX_PRONUNCIATIONS = 8  # pronunciation dictionaries one session selects (gateway.text.pronunciation)


@dataclass(frozen=True)
class GenerationSettings:
    cfg_value: float = 2.0
    temperature: float = 1.0
    seed: int | None = None
    timesteps: int | None = None
    max_length: int | None = None
    continuation: bool = True  # prompt each segment with the previous segment's tail, so a turn sounds like one
    continuation_patches: int = 12
    normalize: str = "auto"  # numbers, money, dates, units as words: gateway.text.normalize (auto / on / off)
    instruction: str | None = None  # style instruction (VoxCPM2 voice design): a turn's first segment is "(it)text"
    pronunciations: tuple[str, ...] = ()  # ids of pronunciation dictionaries, applied in this order

    def merged(self, update: dict[str, Any]) -> GenerationSettings:
        merged = {**asdict(self), **update}
        merged["pronunciations"] = tuple(merged["pronunciations"])
        return GenerationSettings(**merged)


# name -> (accepted types, check, description of the valid range). The sampling settings' ranges are the engine's
# (`SAMPLING_SETTINGS`, checked against its `sampling_ranges` by `check_generation`): here their types only
_GENERATION_RULES: dict[str, tuple[tuple[type, ...], Any, str]] = {
    "cfg_value": ((int, float), lambda v: True, "a number"),
    "temperature": ((int, float), lambda v: True, "a number"),
    "seed": ((int, type(None)), lambda v: v is None or 0 <= v < 2**63, "null or an integer in [0, 2^63)"),
    "timesteps": ((int, type(None)), lambda v: True, "null or an integer"),
    "max_length": ((int, type(None)), lambda v: v is None or 1 <= v <= 8192, "null or an integer in [1, 8192]"),
    "continuation": ((bool,), lambda v: True, "a boolean"),
    "continuation_patches": ((int,), lambda v: 1 <= v <= 64, "an integer in [1, 64]"),
    "normalize": ((str,), lambda v: v in NORMALIZE_MODES, f"one of {', '.join(NORMALIZE_MODES)}"),
    "instruction": ((str, type(None)), lambda v: v is None or len(v) <= MAX_INSTRUCTION_CHARS,
                    f"null or a string of at most {MAX_INSTRUCTION_CHARS} characters"),
    "pronunciations": ((list,), lambda v: len(v) <= MAX_PRONUNCIATIONS and all(
        isinstance(i, str) and 0 < len(i) <= 128 for i in v), f"a list of at most {MAX_PRONUNCIATIONS} dictionary ids"),
}


@dataclass(frozen=True)
class SessionStart:
    TYPE: ClassVar[str] = "session.start"
    voice: str | None = None
    output: dict[str, Any] = field(default_factory=dict)  # resolved by gateway.audio.OutputFormat.from_dict
    chunking: dict[str, Any] = field(default_factory=dict)  # resolved by gateway.text.segmenter.ChunkingConfig
    generation: dict[str, Any] = field(default_factory=dict)  # validated keys of GenerationSettings


@dataclass(frozen=True)
class SessionUpdate:
    """Changes for turns opened after it; turns already speaking keep their settings."""

    TYPE: ClassVar[str] = "session.update"
    voice: str | None = None
    output: dict[str, Any] | None = None
    chunking: dict[str, Any] | None = None
    generation: dict[str, Any] | None = None
    has_voice: bool = False  # distinguishes "voice": null (back to the default voice) from no voice field


@dataclass(frozen=True)
class TextAppend:
    TYPE: ClassVar[str] = "text.append"
    context_id: str
    text: str


@dataclass(frozen=True)
class TextFlush:
    TYPE: ClassVar[str] = "text.flush"
    context_id: str
    flush_id: str | None = None


@dataclass(frozen=True)
class ContextEnd:
    TYPE: ClassVar[str] = "context.end"
    context_id: str


@dataclass(frozen=True)
class ContextCancel:
    TYPE: ClassVar[str] = "context.cancel"
    context_id: str


@dataclass(frozen=True)
class PlaybackPosition:
    TYPE: ClassVar[str] = "playback.position"
    context_id: str
    played_ms: float


@dataclass(frozen=True)
class Ping:
    TYPE: ClassVar[str] = "ping"
    id: str | int | None = None


@dataclass(frozen=True)
class SessionEnd:
    TYPE: ClassVar[str] = "session.end"


@dataclass(frozen=True)
class Unknown:
    """A message type this server does not know: ignored (forward compatibility)."""

    type: str


ClientMessage = (SessionStart | SessionUpdate | TextAppend | TextFlush | ContextEnd | ContextCancel
                 | PlaybackPosition | Ping | SessionEnd | Unknown)


def parse_client_message(raw: str | bytes, limits: Limits = Limits()) -> ClientMessage:
    """Parse and validate one client frame; raises ProtocolError (non-fatal) on anything malformed."""
    if isinstance(raw, bytes | bytearray | memoryview):
        raise ProtocolError(ErrorCode.UNSUPPORTED_FRAME, "binary frames are not accepted from clients; send JSON text")
    size = len(raw.encode("utf-8", "surrogatepass")) if len(raw) * 4 > limits.max_message_bytes else len(raw)
    if size > limits.max_message_bytes:
        raise ProtocolError(ErrorCode.MESSAGE_TOO_LARGE,
                            f"message of {size} bytes exceeds the limit of {limits.max_message_bytes}")
    data = load_json(raw)
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "a message must be a JSON object")
    kind = data.get("type")
    if not isinstance(kind, str):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "a message needs a string field 'type'")
    valid = _valid_text_message(kind, data, limits)
    if valid is not None:
        return valid
    parser = _PARSERS.get(kind)
    if parser is None:
        return Unknown(kind)
    return parser(_Fields(kind, data, limits))


def _valid_text_message(kind: str, data: dict[str, Any], limits: Limits) -> TextAppend | ContextEnd | None:
    """A text.append or context.end that is valid as it is (a turn's text comes in these, many per second per
    session), made without the field-by-field checks; None for every other message, and for any of these with
    something to report, which the full parser then reports."""
    cid = data.get("context_id")
    if type(cid) is not str or not 0 < len(cid) <= limits.max_id_chars:
        return None
    if kind == "text.append" and len(data) == 3:
        text = data.get("text")
        if type(text) is str and len(text) <= limits.max_text_chars:
            return TextAppend(cid, text)
    elif kind == "context.end" and len(data) == 2:
        return ContextEnd(cid)
    return None


def load_json(raw: str | bytes) -> Any:
    """One client JSON document, every string in it valid Unicode (gateway.text.unicode_text): the one way client JSON
    is read, by the native protocol and every compat adapter. ProtocolError BAD_JSON, or INVALID_VALUE naming the
    field that is not text."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError (bytes that are not UTF-8) is a ValueError
        raise ProtocolError(ErrorCode.BAD_JSON, f"invalid JSON: {e}") from None
    # a lone surrogate is either in the raw text or made by a `\u` escape: a document with neither needs no walk
    where = None if type(raw) is str and "\\u" not in raw and is_text(raw) else first_invalid(data)
    if where is not None:
        cid = data.get("context_id") if isinstance(data, dict) else None
        raise ProtocolError(ErrorCode.INVALID_VALUE, f"field '{where or '(message)'}' is not valid Unicode text "
                            "(a lone surrogate)", context_id=cid if isinstance(cid, str) and is_text(cid) else None)
    return data


class _Fields:
    """Typed access to one message's fields; remembers which were read, so leftovers are reported."""

    def __init__(self, kind: str, data: dict[str, Any], limits: Limits):
        self.kind, self.data, self.limits = kind, data, limits
        self.context_id: str | None = None
        cid = data.get("context_id")
        if isinstance(cid, str):
            self.context_id = cid

    def fail(self, code: ErrorCode, message: str) -> ProtocolError:
        return ProtocolError(code, f"{self.kind}: {message}", context_id=self.context_id)

    def get(self, name: str, types: tuple[type, ...], *, required: bool = False, default: Any = None) -> Any:
        if name not in self.data:
            if required:
                raise self.fail(ErrorCode.MISSING_FIELD, f"missing field '{name}'")
            return default
        value = self.data[name]
        if not _is_instance(value, types):
            raise self.fail(ErrorCode.INVALID_VALUE, f"field '{name}' must be {_type_names(types)}, "
                                                      f"not {_json_type(value)}")
        return value

    def ident(self, name: str, *, required: bool, nullable: bool = False) -> str | None:
        value = self.get(name, (str, type(None)) if nullable else (str,), required=required)
        if value is not None and not 0 < len(value) <= self.limits.max_id_chars:
            raise self.fail(ErrorCode.INVALID_VALUE, f"field '{name}' must have 1 to {self.limits.max_id_chars} "
                                                      "characters")
        return value

    def section(self, name: str) -> dict[str, Any] | None:
        value = self.get(name, (dict, type(None)))
        return None if value is None else dict(value)

    def done(self, *names: str) -> None:
        extra = sorted(set(self.data) - {"type", *names})
        if extra:
            raise self.fail(ErrorCode.UNKNOWN_FIELD, f"unknown field(s): {', '.join(extra)}")


def _is_instance(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in types:
        return False  # JSON true is not a number
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return isinstance(value, types)


def _json_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join(_json_type(t()) if t is not type(None) else "null" for t in types)


SAMPLING_SETTINGS = ("cfg_value", "temperature", "timesteps")  # ranged by the engine's `SamplingRanges`


def check_generation(update: dict[str, Any], context_id: str | None = None, ranges: Any = None) -> dict[str, Any]:
    """Validate a `generation` object (names, types, ranges). `ranges`: the engine's `sampling_ranges` (what its
    guard takes and its graphs serve: `valid(name, value)`, `describe(name)`); the session passes it, a parse
    without an engine checks the sampling settings' types only."""
    for name, value in update.items():
        rule = _GENERATION_RULES.get(name)
        if rule is None:
            raise ProtocolError(ErrorCode.UNKNOWN_FIELD, f"unknown generation setting '{name}'; known: "
                                f"{', '.join(_GENERATION_RULES)}", context_id=context_id)
        types, ok, what = rule
        if not _is_instance(value, types) or not ok(value):
            raise ProtocolError(ErrorCode.INVALID_VALUE, f"generation.{name} must be {what}", context_id=context_id)
        if ranges is not None and name in SAMPLING_SETTINGS and value is not None and not ranges.valid(name, value):
            raise ProtocolError(ErrorCode.INVALID_VALUE, f"generation.{name} must be {ranges.describe(name)} "
                                f"(got {value!r})", context_id=context_id)
    return update


def _settings(f: _Fields) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("output", "chunking", "generation"):
        section = f.section(name)
        if section is not None:
            out[name] = section
    if "generation" in out:
        check_generation(out["generation"])
    if "voice" in f.data:
        out["voice"] = f.ident("voice", required=False, nullable=True)
    return out


def _session_start(f: _Fields) -> SessionStart:
    s = _settings(f)
    f.done("voice", "output", "chunking", "generation")
    return SessionStart(voice=s.get("voice"), output=s.get("output", {}), chunking=s.get("chunking", {}),
                        generation=s.get("generation", {}))


def _session_update(f: _Fields) -> SessionUpdate:
    s = _settings(f)
    f.done("voice", "output", "chunking", "generation")
    return SessionUpdate(voice=s.get("voice"), output=s.get("output"), chunking=s.get("chunking"),
                         generation=s.get("generation"), has_voice="voice" in s)


def _text_append(f: _Fields) -> TextAppend:
    cid = f.ident("context_id", required=True)
    text = f.get("text", (str,), required=True)
    f.done("context_id", "text")
    if len(text) > f.limits.max_text_chars:
        raise f.fail(ErrorCode.TEXT_TOO_LONG, f"{len(text)} characters exceed the limit of "
                                              f"{f.limits.max_text_chars} per message; send the text in pieces")
    return TextAppend(cid, text)


def _text_flush(f: _Fields) -> TextFlush:
    cid = f.ident("context_id", required=True)
    flush_id = f.ident("flush_id", required=False)
    f.done("context_id", "flush_id")
    return TextFlush(cid, flush_id)


def _context_end(f: _Fields) -> ContextEnd:
    cid = f.ident("context_id", required=True)
    f.done("context_id")
    return ContextEnd(cid)


def _context_cancel(f: _Fields) -> ContextCancel:
    cid = f.ident("context_id", required=True)
    f.done("context_id")
    return ContextCancel(cid)


def _playback_position(f: _Fields) -> PlaybackPosition:
    cid = f.ident("context_id", required=True)
    played = f.get("played_ms", (int, float), required=True)
    f.done("context_id", "played_ms")
    if played < 0:
        raise f.fail(ErrorCode.INVALID_VALUE, "played_ms must not be negative")
    return PlaybackPosition(cid, float(played))


def _ping(f: _Fields) -> Ping:
    ping_id = f.get("id", (str, int, type(None)))
    f.done("id")
    return Ping(ping_id)


def _session_end(f: _Fields) -> SessionEnd:
    f.done()
    return SessionEnd()


_PARSERS = {
    SessionStart.TYPE: _session_start, SessionUpdate.TYPE: _session_update, TextAppend.TYPE: _text_append,
    TextFlush.TYPE: _text_flush, ContextEnd.TYPE: _context_end, ContextCancel.TYPE: _context_cancel,
    PlaybackPosition.TYPE: _playback_position, Ping.TYPE: _ping, SessionEnd.TYPE: _session_end,
}
