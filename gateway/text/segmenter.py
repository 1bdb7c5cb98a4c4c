"""Incremental text -> synthesis segments. Sans-I/O: time comes from an injected clock; the caller polls.

Text arrives from an LLM in arbitrary pieces (mid-word, mid-number, mid-markup). It is normalised as it streams
(markdown that should not be spoken is stripped, whitespace collapsed, emoji dropped), then cut into segments:
- the first segment of a turn leaves early: at the first clause boundary, after ~`first_chars` characters (at a word
  boundary), or after `max_delay_ms` without a boundary, so audio starts fast;
- later segments are clauses while little audio is queued, whole sentences while >= ~1 s is queued (better prosody);
- a boundary is final only once the next non-space character has arrived, so "3." + "14" never splits, and
  abbreviations, initials, decimals, URLs, quotes ("Stop." she said) and numbered lists are not sentence ends.
Nothing is ever lost or duplicated: the segments, in order, are exactly the normalised text (see `normalize`).
With a text normalisation mode (gateway.text.normalize), no cut splits what its grammar reads as one unit ("3:45 PM",
"March 5, 1990") and `Segment.speak()` gives the text as spoken (numbers and symbols in words); phoneme braces
(`{HH AH0 L OW1}`) are never split in any mode.
"""

from __future__ import annotations

import re
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from gateway.text import normalize as spoken
from gateway.text.boundaries import IS_CJK, BoundaryScan, speak

REASONS = ("clause", "sentence", "length", "timeout", "flush", "end")
RELAXED_QUEUE_MS = 1000.0  # with this much audio queued, segments grow to whole sentences
SYNTH_LEAD_MS = 500.0  # when audio is queued, time-based release waits until the queue is this close to running dry


@dataclass
class ChunkingConfig:
    """`session.start` "chunking"."""

    first_chars: int = 20  # the first segment leaves after ~this many chars (at a word boundary) without a clause
    max_delay_ms: int = 600  # ... or after this long without a boundary
    min_chars: int = 8  # never send a fragment shorter than this unless flushed/ended
    max_chars: int = 300  # hard cap per segment (split at the best boundary before it)
    schedule: tuple[int, ...] | None = None  # like ElevenLabs chunk_length_schedule: min chars of segment i

    def __post_init__(self) -> None:
        for name, low, high in (("first_chars", 1, 2000), ("max_delay_ms", 0, 60000), ("min_chars", 0, 2000),
                                ("max_chars", 20, 8000)):
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high:
                raise ValueError(f"chunking.{name}: {value!r} must be an integer in {low}..{high}")
        if self.max_chars < max(self.first_chars, self.min_chars):
            raise ValueError(f"chunking.max_chars: {self.max_chars} is below first_chars/min_chars")
        if self.schedule is not None:
            if not isinstance(self.schedule, list | tuple) or not self.schedule:
                raise ValueError(f"chunking.schedule: {self.schedule!r} must be a non-empty list of integers")
            for value in self.schedule:
                if type(value) is not int or not 1 <= value <= self.max_chars:
                    raise ValueError(f"chunking.schedule: {value!r} must be an integer in 1..{self.max_chars}")
            self.schedule = tuple(self.schedule)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ChunkingConfig:
        """Parse `session.start` "chunking" (missing fields take the defaults)."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ValueError(f"chunking.{key}: unknown field")
        return cls(**d)


@dataclass
class Segment:
    text: str  # as written (markdown stripped): what cancel reports quote
    index: int
    reason: str  # one of REASONS
    mode: str = "off"  # gateway.text.normalize mode that `speak` applies
    lang: spoken.Lang = "en"  # the language it is read in
    spoken: str | None = None  # what `speak` made of it
    rewrite: Callable[[str], str] | None = field(default=None, repr=False)  # pronunciation rules, before normalising
    respelled: bool = False  # the rules changed the text (known once `speak` ran)

    def speak(self) -> str:
        """The text the model speaks: the pronunciation rules applied (gateway.text.pronunciation), then numbers and
        symbols in words, sentence by sentence (gateway.text.normalize). Made once, when the segment goes to the engine:
        a burst of released segments costs its normalisation one segment at a time, paced by synthesis, not all at
        once in the handler that released them."""
        if self.spoken is None:
            text = self.text if self.rewrite is None else self.rewrite(self.text)
            self.respelled = text != self.text
            self.spoken = self._normalized(text)
        return self.spoken

    def shown(self) -> str:
        """What clients are told is spoken (`segment.started`, alignments, an agent's transcript): as `speak`, but
        words instead of the pronunciation rules' phonemes and aliases (normalised once more only where a rule
        changed the text)."""
        spoken = self.speak()
        return self._normalized(self.text) if self.respelled else spoken

    def _normalized(self, text: str) -> str:
        return text if self.mode == "off" else speak(text, self.mode, self.lang)


# --- normalisation --------------------------------------------------------------------------------------------------

_EMOJI = re.compile("[\U0001f000-\U0001faff\u2300-\u23ff\u2600-\u27bf\u2b00-\u2bff\ufe0e\ufe0f\u200d"
                    "\U000e0020-\U000e007f]")
_LINE_MARK = re.compile(r"[ \t]*(?:#{1,6}[ \t]+|[-*+][ \t]+|>[ \t]?)")  # heading, bullet, quote at line start
_LINE_MARK_PREFIX = re.compile(r"[ \t]*(?:#{1,6}|[-*+]|>)?")  # could still become one of those
_LINK = re.compile(r"\[([^\[\]\n]{0,200})\]\(([^()\s]{0,500})\)")  # [text](url) and, after "!", images
_LINK_PREFIX = re.compile(r"\[[^\[\]\n]{0,200}(?:\](?:\([^()\s]{0,500})?)?")
# every character _strip treats specially (markup, emoji, the newline that starts a line); text without any passes as is
_MARKUP_CHARS = "*`_![\n"  # the ASCII ones (`_markup_or_emoji`)
_MARKUP_OR_EMOJI = re.compile("[" + re.escape(_MARKUP_CHARS) + _EMOJI.pattern[1:])
_LINE_MARK_START = " \t#-*+>"  # what a line mark (or its prefix) starts with
_ODD_SPACE = re.compile(r"[^\S ]| {2}")  # whitespace other than a lone " " (newline, tab, nbsp, a run of spaces)


class _Normalizer:
    """Streaming markdown stripper + whitespace collapser. Holds back only what the next characters could change."""

    def __init__(self) -> None:
        self.raw = ""  # input not yet decided (e.g. "**", "[link te", "#" at a line start)
        self._line_start = True
        self._space = ""  # collapsed whitespace waiting for the next visible character ("" / " " / "\n")
        self._started = False  # leading whitespace of a turn is dropped

    @property
    def ends_word(self) -> bool:
        """The text so far ends at a word end (whitespace arrived after it and nothing is held back)."""
        return bool(self._space) and not self.raw

    def feed(self, text: str, final: bool = False) -> str:
        self.raw += text
        return self._collapse(self._strip(final))

    def _strip(self, final: bool) -> str:
        raw = self.raw
        if self._line_start and raw and raw[0] not in _LINE_MARK_START:
            self._line_start = False  # no line mark here, nor the start of one: as the loop below decides at raw[0]
        if not self._line_start and not _markup_or_emoji(raw):
            self.raw = ""  # plain text (the usual LLM piece): nothing below would change or hold back any of it
            return raw
        i, out = 0, []
        while i < len(raw):
            if not self._line_start:  # up to the next special character, the text passes as is (in one piece)
                special = _MARKUP_OR_EMOJI.search(raw, i)
                stop = len(raw) if special is None else special.start()
                if stop > i:
                    out.append(raw[i:stop])
                    i = stop
                    continue
            c = raw[i]
            if self._line_start:
                mark = _LINE_MARK.match(raw, i)
                if mark:
                    self._line_start = raw[mark.end() - 1 : mark.end()] == ">"  # "> - item" is still a line start
                    i = mark.end()
                    continue
                if not final and _LINE_MARK_PREFIX.fullmatch(raw, i):
                    break
                self._line_start = False
            if c in "*`":
                i += 1
            elif c == "_" and raw.startswith("__", i):
                j = i
                while j < len(raw) and raw[j] == "_":
                    j += 1
                if j == len(raw) and not final:
                    break
                i = j
            elif c in "_!" and i + 1 == len(raw) and not final:
                break  # "_" may start "__", "!" may start an image "!["
            elif c == "!" and raw.startswith("[", i + 1):
                i += 1
            elif c == "[":
                link = _LINK.match(raw, i)
                if link:  # speak the link text (processed again: it may hold emphasis), drop the URL
                    raw = raw[:i] + link.group(1) + raw[link.end() :]
                    continue
                if not final and _LINK_PREFIX.fullmatch(raw, i):
                    break
                out.append(c)
                i += 1
            elif _EMOJI.match(c):
                i += 1
            else:
                out.append(c)
                self._line_start = c == "\n"
                i += 1
        self.raw = raw[i:]
        return "".join(out)

    def _collapse(self, text: str) -> str:
        # words and single spaces (the usual piece): no run to collapse inside. Every whitespace character but " " is
        # unprintable, so printable text without "  " has none (a check far cheaper than the regex's)
        if (text.isprintable() and "  " not in text) or not _ODD_SPACE.search(text):
            body = text.strip(" ")
            if text[:1] == " ":
                self._space = "\n" if self._space == "\n" else " "
            if not body:
                return ""
            lead = self._space if self._started and self._space else ""
            self._started, self._space = True, " " if text[-1] == " " else ""
            return lead + body
        out = []
        for run in re.finditer(r"\s+|\S+", text):
            piece = run.group()
            if piece[0].isspace():
                self._space = "\n" if "\n" in piece or self._space == "\n" else " "
                continue
            if self._started and self._space:
                out.append(self._space)
            out.append(piece)
            self._started, self._space = True, ""
        return "".join(out)


def _markup_or_emoji(text: str) -> bool:
    """`_MARKUP_OR_EMOJI.search(text)` finds something; ASCII text (O(1) to tell) by a few substring searches, each
    far cheaper than the regex's scan of every character against its class."""
    if text.isascii():
        return any(c in text for c in _MARKUP_CHARS)
    return _MARKUP_OR_EMOJI.search(text) is not None


def normalize(text: str) -> str:
    """The text a turn's segments add up to: markdown markup, emoji and extra whitespace removed."""
    return _Normalizer().feed(text, final=True)


# --- the segmenter --------------------------------------------------------------------------------------------------

class Segmenter:
    """One turn's text -> segments. push/flush/end return segments ready now; poll() at next_deadline()."""

    def __init__(self, config: ChunkingConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 normalize: str = "off", rewrite: Callable[[str], str] | None = None):
        self.config = config or ChunkingConfig()
        self._rewrite = rewrite  # pronunciation rules each segment's `speak` applies
        self._clock = clock
        self._mode = spoken.check_mode(normalize)  # gateway.text.normalize: how segments become what is spoken
        self._lang: spoken.Lang = "en"  # Chinese from the turn's first Chinese character on
        self._chinese_came = False  # a Chinese character is in the text (normalising: it makes the next segment zh)
        self._norm = _Normalizer()
        self._buf = ""  # normalised, unreleased text (no leading whitespace)
        self._line_start = True  # _buf starts a line (turn start, or the last cut was at a newline)
        self._since: float | None = None  # when the oldest unreleased text arrived
        self._queued_ms = 0.0
        self._queue_dry_at: float | None = None
        self._ended = False
        self._held_at: float | None = None  # when the push whose `limit` held cuts back ran (`release` makes them)
        # the boundaries of `_buf`, found once however often cuts are looked for (`_scan()`; a new one per buffer)
        self._boundaries: BoundaryScan | None = None
        # the inputs of the last look for a cut that found none: the segment timer's `next_deadline` right after a
        # push asks the same question of the same text
        self._no_cut: tuple[int, bool, bool, int] | None = None
        self.segments: list[Segment] = []  # everything released so far, in order

    @property
    def buffered_chars(self) -> int:
        return len(self._buf) + len(self._norm.raw)

    @property
    def pending_text(self) -> str:
        """Text received but not released yet (normalised part + raw part still being decided)."""
        return self._buf + self._norm.raw

    @property
    def ended(self) -> bool:
        return self._ended

    def push(self, text: str, limit: int | None = None) -> list[Segment]:
        """Append streamed text (any split: mid-word, mid-number, mid-markup). `limit`: release at most this many
        segments now; `release()`, called before anything else, releases the others exactly as this call would have
        (a new turn's first segment goes to the engine at once, and cutting the rest of its text can wait until the
        handlers of other turns' first text have run)."""
        if not isinstance(text, str):
            raise ValueError(f"text: expected a string, got {type(text).__name__}")
        if self._ended:
            raise ValueError("text: the turn has ended")
        was_empty = not (self._buf or self._norm.raw)  # (`pending_text` without joining the two)
        self._append(self._norm.feed(text))
        if was_empty and (self._buf or self._norm.raw):
            self._since = self._clock()
        if limit is None:
            return self._release(complete=False)
        now = self._clock()
        segments = self._release(complete=False, now=now, limit=limit)
        if len(segments) == limit:
            self._held_at = now
        return segments

    def release(self) -> list[Segment]:
        """The segments the text so far allows that a `push` with a `limit` held back (none if none was)."""
        return [] if self._held_at is None else self._release(complete=False, now=self._held_at)

    def flush(self) -> list[Segment]:
        """Everything buffered now (text.flush); the turn goes on."""
        if self._ended:
            return []
        self._append(self._norm.feed("", final=True))
        return self._release(complete=True, last_reason="flush")

    def end(self) -> list[Segment]:
        """No more text (context.end): the rest, never cut off."""
        if self._ended:
            return []
        self._append(self._norm.feed("", final=True))
        segments = self._release(complete=True, last_reason="end")
        self._ended = True
        self._since = None
        return segments

    def poll(self) -> list[Segment]:
        """Releases what is due now: time-based cuts, and cuts that set_queued_audio_ms made possible."""
        segments = self._release(complete=False)
        deadline = self.next_deadline()
        if deadline is not None and self._clock() >= deadline:
            cut = self._timeout_cut()
            if cut is not None:
                segments.append(self._emit(cut, "timeout"))
        return segments

    def next_deadline(self) -> float | None:
        """Clock time at which poll() may release something; None when only more text (or end) can."""
        if self._ended or self._since is None:
            return None
        if self._cut() is not None:
            return self._clock()
        if self._timeout_cut() is None:
            return None
        deadline = self._since + self.config.max_delay_ms / 1000
        if self._queue_dry_at is not None:
            deadline = max(deadline, self._queue_dry_at)
        return deadline

    def set_queued_audio_ms(self, ms: float) -> None:
        """Audio synthesised but not yet played. Plenty queued: wait for whole sentences; little: release clauses."""
        self._queued_ms = ms
        relaxed = ms >= RELAXED_QUEUE_MS
        self._queue_dry_at = self._clock() + (ms - SYNTH_LEAD_MS) / 1000 if relaxed else None

    # --- internals ---

    def _append(self, clean: str) -> None:
        if not self._buf:
            if clean[:1] == "\n":
                self._line_start = True
            clean = clean.lstrip()
            self._boundaries = None  # a new buffer (it may start a line)
        if self._mode != "off" and not self._chinese_came:
            self._chinese_came = spoken.contains_chinese(clean)
        self._buf += clean

    def _release(self, complete: bool, last_reason: str = "end", now: float | None = None,
                 limit: int | None = None) -> list[Segment]:
        self._held_at = None  # whatever releases, releases the held-back cuts too
        segments: list[Segment] = []
        while (limit is None or len(segments) < limit) and (cut := self._cut()) is not None:
            segments.append(self._emit(*cut, now=now))
        if complete and self._buf:
            segments.append(self._emit(len(self._buf), last_reason, now=now))
        return segments

    def _emit(self, cut: int, reason: str, now: float | None = None) -> Segment:
        text, rest = self._buf[:cut].rstrip(), self._buf[cut:]
        body = rest.lstrip()
        self._line_start = "\n" in rest[: len(rest) - len(body)]
        if self._boundaries is not None:
            self._boundaries = self._boundaries.rest(len(self._buf) - len(body), self._line_start)
        self._buf = body
        # the segment or the text after it holds the turn's first Chinese character (none came before: the segments
        # before were read in English)
        if self._chinese_came and self._lang == "en":
            self._lang = "zh"
        segment = Segment(text, len(self.segments), reason, self._mode, self._lang, rewrite=self._rewrite)
        self.segments.append(segment)
        self._since = (self._clock() if now is None else now) if self._buf or self._norm.raw else None
        return segment

    def _scan(self) -> BoundaryScan:
        if self._boundaries is None:
            self._boundaries = BoundaryScan(self._line_start, self._mode != "off")
        return self._boundaries

    def _cut(self) -> tuple[int, str] | None:
        """Where the next segment ends, by the text alone (no clock): the same cuts however the text was split."""
        cfg, buf, index = self.config, self._buf, len(self.segments)
        if not buf:
            return None
        # everything the answer depends on (the config and the normalisation mode are the turn's, fixed; the buffer
        # only grows until a cut, which makes a new scan)
        inputs = (len(buf), self._line_start, self._queued_ms >= RELAXED_QUEUE_MS, index)
        if self._no_cut == inputs:
            return None
        first = index == 0 and cfg.schedule is None
        if cfg.schedule is not None:
            threshold, kinds = cfg.schedule[min(index, len(cfg.schedule) - 1)], ("sentence", "clause", "word")
        elif self._queued_ms >= RELAXED_QUEUE_MS and not first:
            threshold, kinds = cfg.min_chars, ("sentence",)
        else:
            threshold, kinds = cfg.min_chars, ("sentence", "clause")
        scan = self._scan()
        weights = scan.weights(buf)
        best: dict[str, int] = {}
        # Without a schedule, a word cut is taken only by the first segment once it is first_chars long, or as the
        # last resort past max_chars (below, from the end back): a word boundary before that matters only where it
        # could stop the scan, so the others are not looked at (a paragraph's words are most of its boundaries).
        words_from = 0
        if "word" not in kinds:
            words_from = spoken.word_cuts_decided_before(buf) if scan.normalizing else len(buf) + 1
            if first:
                words_from = min(words_from, bisect_left(weights, cfg.first_chars))
        for cut, kind in scan.boundaries(buf, words_from):
            w = weights[cut]
            if w > cfg.max_chars:
                break
            if w == 0:
                continue
            if kind in kinds and w >= threshold:
                return cut, "length" if kind == "word" else kind
            if first and kind == "word" and w >= cfg.first_chars:
                return cut, "length"
            best[kind] = cut
        if weights[-1] <= cfg.max_chars:  # every boundary passed (none beyond max_chars)
            self._no_cut = inputs
            return None
        for kind in ("sentence", "clause"):
            if kind in best:
                return best[kind], "length"
        within = bisect_right(weights, cfg.max_chars) - 1  # the last position within max_chars
        # the last word boundary passed: the scan's, or one of those it left out (all before its own)
        word = best.get("word")
        if word is None:
            word = scan.last_word(buf, 1, min(words_from, within + 1))
        return (within if word is None else word), "length"

    def _timeout_cut(self) -> int | None:
        """The last cut that leaves no word half-spoken, if the text before it is long enough."""
        buf, cfg = self._buf, self.config
        scan = self._scan()
        weights = scan.weights(buf)
        if buf and cfg.min_chars <= weights[-1] <= cfg.max_chars and (
                self._norm.ends_word or IS_CJK.match(buf[-1])) and (
                spoken.cut_state(buf, len(buf), at_end=True) if self._mode != "off"
                else not spoken.inside_braces(buf, len(buf))):
            return len(buf)
        return scan.last_boundary(buf, bisect_left(weights, cfg.min_chars), bisect_right(weights, cfg.max_chars) - 1)
