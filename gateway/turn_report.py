"""A turn's report: where each segment's audio lies, how its synthesis went (`context.done` metrics), and which of
its text the listener heard when it is cancelled. Pure data and functions, no I/O."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(slots=True)
class SegmentAudio:
    text: str
    start_ms: float
    end_ms: float | None = None  # known once all its audio is queued


@dataclass(slots=True)
class SegmentTiming:
    """Where one segment's synthesis sat in its turn, reported in `context.done` metrics as `segment_log`: tells a
    segment that was started too late (little `lead_ms`) from an engine that fell behind (`max_wait_ms`)."""

    segment: int
    submit_ms: float  # the turn's first text -> the segment submitted to the engine
    lead_ms: float  # audio the listener had queued then (at the client and here): the time the engine has
    engine_ttfb_ms: float | None = None  # submitted -> its first chunk
    done_ms: float | None = None  # the turn's first text -> its last chunk received from the engine
    max_wait_ms: float = 0.0  # the longest wait for one of its later chunks (the engine, not the listener, was late)
    max_wait_end_ms: float | None = None  # the turn's first text -> when that wait ended
    patches: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {k: round(v, 1) if isinstance(v, float) else v for k, v in asdict(self).items()}



def split_heard(texts: list[str], audio: list[SegmentAudio], played_ms: float) -> tuple[str, str]:
    """(heard, not heard) text of a turn: whole segments played, and of the segment playing, its played share cut
    back to a word end. `texts` are the turn's segments in order (then any unreleased text); `audio[i]` is where
    segment i's audio lies. A segment still being synthesised counts as unheard: better to repeat than to skip."""
    heard: list[str] = []
    rest: list[str] = []
    for i, text in enumerate(texts):
        seg = audio[i] if i < len(audio) else None
        if rest or seg is None or seg.start_ms >= played_ms or seg.end_ms is None:
            rest.append(text)
        elif played_ms >= seg.end_ms:
            heard.append(text)
        else:
            cut = int(len(text) * (played_ms - seg.start_ms) / max(seg.end_ms - seg.start_ms, 1e-9))
            if cut < len(text) and not text[cut].isspace():
                cut = text.rfind(" ", 0, cut) + 1  # back to the start of the word being spoken
            heard.append(text[:cut].strip())
            rest.append(text[cut:].strip())
    return " ".join(t for t in heard if t), " ".join(t for t in rest if t)



def _round(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)
