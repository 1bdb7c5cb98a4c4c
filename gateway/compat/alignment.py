"""ElevenLabs' character alignment, estimated (VoxCPM gives none): each segment's real audio span shared among its
characters and the space after it (compat.share_span), attached to audio the way ElevenLabs attaches it, on the socket
(`AlignmentCarrier`, `socket_alignment`) and on `/stream/with-timestamps` (`AlignedLines`)."""

from __future__ import annotations

import base64
import json
import math
from typing import Any

from gateway.audio import OutputFormat
from gateway.compat import share_span
from gateway.protocol import ContextDone

Span = tuple[float, str, float]  # a segment: (start_ms, text, end_ms) in its turn's audio


class AlignmentCarrier:
    """ElevenLabs attaches alignment to audio: the newest audio is held back one message, and a segment's alignment
    rides on the message whose audio reaches the segment's end (its end is known once the next segment starts,
    when the audio up to it may not all have arrived yet). Each call returns the messages due: (audio, the spans
    they end)."""

    def __init__(self) -> None:
        self.held: bytes | None = None
        self.held_end_ms = 0.0  # where the held audio ends in the turn
        self.ended: list[Span] = []  # segments ended, their alignment not sent yet

    def audio(self, payload: bytes, end_ms: float) -> list[tuple[bytes, list[Span]]]:
        """`payload` arrived, reaching `end_ms` of the turn's audio."""
        if not payload:
            return []
        due = [self._take()] if self.held is not None else []
        self.held, self.held_end_ms = payload, end_ms
        return due

    def segment_end(self, span: Span) -> list[tuple[bytes, list[Span]]]:
        self.ended.append(span)
        covered = self.held is not None and self.held_end_ms + 1.0 >= span[2]  # whole-ms frame positions
        return [self._take()] if covered else []

    def finish(self) -> list[tuple[bytes, list[Span]]]:
        """The turn is over: the last audio carries every alignment left."""
        return [self._take(everything=True)] if self.held is not None else []

    def _take(self, everything: bool = False) -> tuple[bytes, list[Span]]:
        assert self.held is not None
        payload, self.held = self.held, None
        spans = [s for s in self.ended if everything or s[2] <= self.held_end_ms + 1.0]
        self.ended = self.ended[len(spans):]
        return payload, spans


def socket_alignment(segments: list[Span], from_context_start: bool) -> dict[str, list]:
    """The socket's character alignment of consecutive segments (start_ms, text, end_ms): each segment's span shared
    among its characters and the space after it (compat.share_span: an estimate, VoxCPM gives none).

    Times count from the start of the first segment given (ElevenLabs' documented default: "relative to the returned
    chunk"; Pipecat advances its clock by each alignment's span), or, `from_context_start` (`sync_alignment=true`,
    which LiveKit's plugin sends), from the start of the context's audio, so they never go backwards inside a turn
    (LiveKit reads them as they come)."""
    origin = 0.0 if from_context_start else segments[0][0]
    chars: list[str] = []
    starts: list[int] = []
    durations: list[int] = []
    for start_ms, text, end_ms in segments:
        piece = list(text + " ")
        edges = [round(e * 1000) for e in share_span([1] * len(piece), start_ms - origin, end_ms - origin)]
        chars += piece
        starts += edges[:-1]
        durations += [b - a for a, b in zip(edges, edges[1:], strict=False)]
    return {"chars": chars, "charStartTimesMs": starts, "charDurationsMs": durations}


class AlignedLines:
    """The lines of `/stream/with-timestamps` (the SDK's StreamingAudioChunkWithTimestampsResponse: every line has
    audio), each segment's alignment (times from the request's start) on the line that reaches its end
    (`AlignmentCarrier`). A container's bytes do not say their duration: its alignment rides on the line held when
    the segment's end is known."""

    def __init__(self, segments: list[tuple[float, str]], output: OutputFormat):
        self.segments = segments  # the turn's, growing as segments start
        self.carrier = AlignmentCarrier()
        raw = {"pcm_s16le": 2, "mulaw": 1, "alaw": 1}.get(output.format)
        self.ms_per_byte = 1000.0 / (output.sample_rate * raw) if raw else math.inf
        self.audio_ms = 0.0

    def audio(self, data: bytes) -> bytes:
        self.audio_ms += len(data) * self.ms_per_byte
        return self._lines(self.carrier.audio(data, self.audio_ms))

    def segment_done(self, k: int, end_ms: float) -> bytes:
        """Segment k ended at `end_ms`."""
        if k < 0:  # no segment at all (text with nothing to speak)
            return b""
        return self._lines(self.carrier.segment_end((*self.segments[k], end_ms)))

    def trailer(self, done: ContextDone) -> bytes:
        return self.segment_done(len(self.segments) - 1, done.audio_ms) + self._lines(self.carrier.finish())

    @staticmethod
    def _lines(due: list[tuple[bytes, list[Span]]]) -> bytes:
        out = b""
        for data, spans in due:
            aligned = http_alignment(spans) if spans else None
            out += _line({"audio_base64": base64.b64encode(data).decode(), "alignment": aligned,
                          "normalized_alignment": aligned})
        return out


def segment_spans(segments: list[tuple[float, str]], end_ms: float) -> list[Span]:
    """Consecutive segments (pts_ms, text), the last ending at `end_ms`, as spans."""
    ends = [start for start, _ in segments[1:]] + [end_ms]
    return [(start, text, end) for (start, text), end in zip(segments, ends, strict=True)]


def http_alignment(spans: list[Span]) -> dict[str, list]:
    """ElevenLabs' HTTP character alignment of consecutive segments, in seconds from the request's start: each
    segment's span shared among its characters and the space after it (compat.share_span: an estimate)."""
    chars: list[str] = []
    starts: list[float] = []
    ends: list[float] = []
    for start_ms, text, end_ms in spans:
        piece = list(text + " ")
        edges = share_span([1] * len(piece), start_ms, end_ms)
        chars += piece
        starts += edges[:-1]
        ends += edges[1:]
    return {"characters": chars, "character_start_times_seconds": starts, "character_end_times_seconds": ends}


def _line(message: dict[str, Any]) -> bytes:
    return (json.dumps(message) + "\n").encode()
