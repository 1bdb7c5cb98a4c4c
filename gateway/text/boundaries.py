"""Where a segment may end in a turn's text: sentence, clause and word boundaries (abbreviations, initials, decimals,
numbered lists and quotes are no sentence ends; CJK needs no space after a stop; a boundary is final only once the next
character has arrived), never inside a phoneme brace or a unit the normaliser reads as one; and a text's weight (CJK
characters count twice). `BoundaryScan` finds a growing text's boundaries once; `gateway.text.segmenter` decides which
boundary to cut at."""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Generator, Iterator
from itertools import accumulate

from gateway.text import normalize as spoken

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_WIDE = re.compile(f"[{_CJK}\uac00-\ud7af\u3000-\u303f\uff00-\uffef]")  # a wide char counts as two
IS_CJK = re.compile(f"[{_CJK}]")
# sentence and clause marks, newlines: where a segment may end (`_mark_cut` says whether). `_MARK_CHAR` is every
# character a mark starts with: the regex engine skips the text between marks at C speed with it, instead of trying
# each alternative at every character
_MARK_CHAR = re.compile(r"[。！？.!?…，；：,;:—\-–\n]")
_MARK = re.compile(
    f"(?={_MARK_CHAR.pattern})"
    r"(?:(?P<sentence>[。！？]+[.!?…。！？]*|[.!?…]+)"
    r"|(?P<clause>[，；：]|[,;:]|—|(?<=\s)[-–](?=\s))"
    r"|(?P<newline>\n))"
)
_WORD = re.compile(f"(?=[ {_CJK}])(?: |(?<=[{_CJK}]))")  # word candidates: a space, between two CJK characters
_CLOSERS = "\"'”’»)]}」』）】〉》"
_OPENERS = "([{（【「『〈《"
_BRACKET_CLOSERS = ")]}）】」』〉》"
_OPENER = re.compile(f"[{re.escape(_OPENERS)}]")
_BEFORE_WORD = "([{\"'“‘«"  # what, besides whitespace, comes right before a word
_NEVER_ENDS = {  # "Dr. Smith", "e.g. Paris": a capital letter after these does not start a sentence
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "gen", "col", "capt", "lt", "sgt", "rev", "hon", "sen",
    "rep", "gov", "pres", "e.g", "i.e", "cf", "vs", "viz", "approx", "ca", "dept", "ave", "blvd",
}
_BEFORE_NUMBERS = {"no", "nos", "nr", "fig", "figs", "vol", "ch", "pp", "p", "art", "sec", "op", "eq", "ref"}


def weight(text: str) -> int:
    """Characters, counting CJK/wide characters twice (one hanzi carries about two Latin letters of speech)."""
    return len(text) if text.isascii() else len(text) + len(_WIDE.findall(text))


def prefix_weights(text: str) -> list[int] | range:
    """weights[i] == weight(text[:i])."""
    if text.isascii() or not _WIDE.search(text):  # the common case: no list to build
        return range(len(text) + 1)
    wide = {m.start() for m in _WIDE.finditer(text)}
    return list(accumulate((2 if i in wide else 1 for i in range(len(text))), initial=0))


class BoundaryScan:
    """The boundaries of one text that only grows at its end (a segmenter's buffer between two cuts), each found and
    judged once. Whether a candidate is a boundary is final once decided (it needs the characters after it, never
    more text), so a scan that ran out resumes where it stopped when text is appended, instead of starting over at
    every cut check, timer read and release; and word boundaries, most of a text's candidates, are looked for only
    where a caller wants them.

    Sentence and clause marks and word candidates are scanned apart (`_MARK`, `_WORD`: together, the candidates of one
    scan with both, as no match of either starts inside one of the other) and merged by position."""

    __slots__ = ("line_start", "normalizing", "_marks", "_marks_from", "_ahead", "_ran_out_at", "_boundaries_end",
                 "_unsettled", "_text_len", "_settled_before", "_words", "_words_lo", "_words_hi", "_word_ok",
                 "_weights", "_weighed")

    def __init__(self, line_start: bool, normalizing: bool) -> None:
        self.line_start = line_start  # the text starts a line (a numbered list item may begin it)
        self.normalizing = normalizing  # no cut through a unit the normaliser reads as one (else: braces only)
        self._marks: list[tuple[int, int, str]] = []  # (mark's start, cut, kind) of each mark that is a boundary
        self._marks_from = 0  # where the mark scan goes on (past every mark decided so far)
        self._ahead: tuple[int, int] | None = None  # (from, where the first mark character from there is): `_mark_at`
        self._ran_out_at = -1  # the text's length when the mark scan last ran out (no mark left, or one undecided)
        self._boundaries_end = 0  # ... and where the boundaries ended then (the undecided mark's start, or the end)
        # A verdict is final once a visible character follows the cut (`cut_state` reads the next one); one judged
        # with only whitespace after it is judged again when the text grows: (its index in `_marks`, its start)
        self._unsettled: tuple[int, int] | None = None
        self._text_len = 0  # the length of the text last seen
        self._settled_before = 0  # ... and where its trailing whitespace starts: verdicts before it are final
        self._words: list[int] = []  # word candidates in [_words_lo, _words_hi): spaces, between two CJK characters
        self._words_lo = self._words_hi = 0
        self._word_ok: dict[int, bool] = {}  # the decided verdicts of the word candidates asked about
        self._weights: list[int] | None = None  # prefix weights (a list once a wide character came)
        self._weighed = 0  # ... up to this length of text

    def boundaries(self, text: str, words_from: int = 0) -> Iterator[tuple[int, str]]:
        """(cut position, kind) in order, kind in sentence/clause/word; stops at the first undecidable one. Never inside
        a phoneme brace; normalising: never through a unit the normaliser reads as one ("3:45 PM", "$1,000.50").
        `words_from`: word boundaries before it are left out (for a caller that takes no word cut there; they must be
        ones that cannot stop the scan: `normalize.word_cuts_decided_before`). `text` is the text of earlier calls, or
        it with more appended."""
        self._see(text)
        i, words_after = 0, 0
        while True:
            if i < len(self._marks):
                more = True
            else:
                # the word boundaries before the next mark go first, before that mark is judged: a caller that cuts
                # at one of them (a turn's first segment, most often) never needs its verdict, which a cut drops
                ahead = self._next_candidate(text) if max(words_after, words_from) < len(text) else None
                if ahead is not None:
                    if (yield from self._word_cuts(text, max(words_after, words_from), ahead)):
                        return
                    words_after = max(words_after, ahead)
                more = self._next_mark(text)
            start, cut, kind = self._marks[i] if more else (self._boundaries_end, 0, "")
            if (yield from self._word_cuts(text, max(words_after, words_from), start)):
                return
            if not more:
                return
            yield cut, kind
            i, words_after = i + 1, start

    def last_word(self, text: str, lo: int, hi: int) -> int | None:
        """The last word boundary in [lo, hi), judged from `hi` back (a word cut as the last resort, among the word
        boundaries `boundaries` left out: they are decided)."""
        self._see(text)
        for pos in reversed(self._word_candidates(text, lo, hi)):
            if self._word_verdict(text, pos):
                return pos
        return None

    def last_boundary(self, text: str, lo: int, hi: int) -> int | None:
        """The last cut in [lo, hi] that `boundaries(text)` yields, found from the end back (a timeout's cut: the last
        one allowed): the marks are all scanned (they are few), and of the words only those near the text's end,
        where one could be undecided and end the boundaries, are judged forward."""
        self._see(text)
        while self._next_mark(text):
            pass
        end = self._boundaries_end
        decided = spoken.word_cuts_decided_before(text) if self.normalizing else end
        for pos in self._word_candidates(text, decided, end):
            if self._word_verdict(text, pos) is None:
                end = pos
                break
        mark = next((cut for start, cut, _ in reversed(self._marks) if start < end and lo <= cut <= hi), None)
        word = self.last_word(text, lo, min(end, hi + 1))
        return mark if word is None else word if mark is None else max(mark, word)

    def weights(self, text: str) -> list[int] | range:
        """`prefix_weights(text)`, extended from the last call's."""
        if self._weights is None:
            if text.isascii() or not _WIDE.search(text, self._weighed):  # no wide character yet: no list to build
                self._weighed = len(text)
                return range(len(text) + 1)
            self._weights = list(prefix_weights(text))
        weights = self._weights
        for c in text[len(weights) - 1:]:
            weights.append(weights[-1] + (2 if _WIDE.match(c) else 1))
        return weights

    def rest(self, start: int, line_start: bool) -> BoundaryScan:
        """The scan of the text from `start` on (what is left after a cut). A boundary depends on where the text
        starts (brackets opened, the words before it, a list item at a line start), so none carries over; where the
        text has no wide character does."""
        scan = BoundaryScan(line_start, self.normalizing)
        if self._weights is None:
            scan._weighed = max(0, self._weighed - start)
        return scan

    def _see(self, text: str) -> None:
        """Takes in the text's growth: the verdicts that were not final are dropped, to be judged again."""
        if len(text) == self._text_len:
            return
        self._text_len, self._settled_before = len(text), len(text.rstrip())
        if self._unsettled is not None:
            index, self._marks_from = self._unsettled
            del self._marks[index:]
            self._unsettled, self._ran_out_at = None, -1

    def _next_mark(self, text: str) -> bool:
        """Scans on to the next mark that is a boundary (appended to `_marks`); False where the text so far has none
        (none left, or one the characters still to come decide: `_boundaries_end` says where the boundaries end)."""
        if self._ran_out_at == len(text):
            return False
        pos = self._marks_from
        while (at := self._mark_at(text, pos)) is not None:  # (the matches `_MARK.finditer` would give)
            m = _MARK.match(text, at)
            if m is None:  # a hyphen that is no dash
                pos = at + 1
                continue
            cut = _mark_cut(text, m, self.line_start)
            ok = None if cut is None else cut != _NOT_A_CUT and self._judge(text, cut, word=False)
            if ok is None:
                self._marks_from = self._boundaries_end = m.start()
                self._ran_out_at = len(text)
                return False
            if self._unsettled is None and cut >= self._settled_before:
                self._unsettled = len(self._marks), m.start()
            self._marks_from = pos = m.end()
            if ok:
                self._marks.append((m.start(), cut, "clause" if m.lastgroup == "clause" else "sentence"))
                return True
        self._ran_out_at = self._boundaries_end = len(text)
        return False

    def _next_candidate(self, text: str) -> int | None:
        """Where the next mark not judged yet starts (None: none is left to judge): a search, no verdict."""
        return None if self._ran_out_at == len(text) else self._mark_at(text, self._marks_from)

    def _mark_at(self, text: str, pos: int) -> int | None:
        """Where the first mark character at or after `pos` is: searched once for both `_next_candidate` and
        `_next_mark` (a find stays right as the text grows: it only grows at its end)."""
        ahead = self._ahead
        if ahead is not None and ahead[0] == pos:
            return ahead[1]
        hit = _MARK_CHAR.search(text, pos)
        if hit is None:
            return None
        self._ahead = (pos, hit.start())
        return hit.start()

    def _word_cuts(self, text: str, lo: int, hi: int) -> Generator[tuple[int, str], None, bool]:
        """Yield the word boundaries in [lo, hi) a segment may end at, in order; -> True when one's verdict waits for
        text still to come (the scan stops there)."""
        for pos in self._word_candidates(text, lo, hi) if lo < hi else ():
            ok = self._word_verdict(text, pos)
            if ok is None:
                return True
            if ok:
                yield pos, "word"
        return False

    def _word_verdict(self, text: str, pos: int) -> bool | None:
        ok = self._word_ok.get(pos)
        if ok is None:
            ok = self._judge(text, pos, word=True)
            if ok is not None and pos < self._settled_before:
                self._word_ok[pos] = ok
        return ok

    def _judge(self, text: str, cut: int, word: bool) -> bool | None:
        """Whether a segment may end at this candidate (None: the text still to come decides)."""
        return spoken.cut_state(text, cut, word) if self.normalizing else not spoken.inside_braces(text, cut)

    def _word_candidates(self, text: str, lo: int, hi: int) -> list[int]:
        """The word candidates in [lo, hi), scanned once: the scanned range only widens."""
        lo, hi = max(lo, 0), min(hi, len(text))  # none lies at the text's end: it needs the character still to come
        if lo >= hi:
            return []
        if self._words_lo == self._words_hi:
            self._words_lo = self._words_hi = lo
        if lo < self._words_lo:
            self._words[:0] = _word_starts(text, lo, self._words_lo)
            self._words_lo = lo
        if hi > self._words_hi:
            self._words += _word_starts(text, self._words_hi, hi)
            self._words_hi = hi
        return self._words[bisect_left(self._words, lo):bisect_left(self._words, hi)]


_NOT_A_CUT = -1


def _word_starts(text: str, lo: int, hi: int) -> list[int]:
    """Where `_WORD` matches in [lo, hi); in ASCII text (O(1) to tell) that is at its spaces, found by `str.find`
    (the regex tries its lookahead at every position)."""
    if not text.isascii():
        return [m.start() for m in _WORD.finditer(text, lo, hi)]
    found = []
    at = text.find(" ", lo, hi)
    while at >= 0:
        found.append(at)
        at = text.find(" ", at + 1, hi)
    return found


def _mark_cut(buf: str, m: re.Match[str], line_start: bool) -> int | None:
    """Where a sentence or clause mark (or a newline) lets a segment end: its position after any closing quotes and
    brackets; `_NOT_A_CUT` where it ends nothing (an abbreviation, a decimal point, a clause inside brackets); None
    while the characters still to come decide (a digit after "3.", a closing quote, a capital letter)."""
    kind, start, end = m.lastgroup, m.start(), m.end()
    if kind == "newline":
        return start
    size = len(buf)
    while end < size and buf[end] in _CLOSERS:
        end += 1
    if end == size:
        return None
    lead, nxt = buf[start], buf[end]
    if kind == "clause":
        return end if (lead in "，；：—" or nxt.isspace()) and _depth(buf, start) == 0 else _NOT_A_CUT
    if lead in "。！？" or IS_CJK.match(nxt):
        return end  # CJK needs no space after the stop
    if not nxt.isspace():
        return _NOT_A_CUT
    after = end
    while after < size and buf[after].isspace():
        after += 1
    if after == size:
        return None
    return end if _ends_sentence(buf, start, m.group(), buf[after], line_start) else _NOT_A_CUT


def _ends_sentence(buf: str, dot: int, punct: str, nxt: str, line_start: bool) -> bool:
    if nxt.islower():
        return False  # "Stop." she said / Wait... what / e.g. lowercase
    if punct != ".":
        return True
    begin = dot  # the word before the dot: back to whitespace or an opening bracket or quote
    while begin and not (buf[begin - 1].isspace() or buf[begin - 1] in _BEFORE_WORD):
        begin -= 1
    word = buf[begin:dot]
    low = word.lower()
    if low in _NEVER_ENDS or (low in _BEFORE_NUMBERS and nxt.isdigit()):
        return False
    if len(word) == 1 and word.isupper():
        return False  # an initial: J. R. R. Tolkien
    # a numbered list item ("1. Preheat the oven") is no sentence end
    return not (word.isdigit() and (buf[begin - 1 : begin] == "\n" or (begin == 0 and line_start)))


def _depth(text: str, end: int) -> int:
    """Open brackets in `text[:end]`: no clause cuts inside (but sentence cuts still happen)."""
    if not _OPENER.search(text, 0, end):  # the usual clause: nothing to count
        return 0
    depth = 0
    for c in text[:end]:
        if c in _OPENERS:
            depth += 1
        elif c in _BRACKET_CLOSERS and depth:
            depth -= 1
    return depth


def speak(text: str, mode: str, lang: spoken.Lang) -> str:
    """`text` normalised sentence by sentence (the official normaliser's unit: its grammar reads a number differently
    with other sentences around it)."""
    if mode == "auto" and lang == "en" and spoken.as_written(text):
        return text
    out, pos, budget = [], 0, spoken.Budget()
    for cut in [*_sentence_ends(text), len(text)]:
        piece, pos = text[pos:cut], cut
        body = piece.strip()
        if body:
            start = piece.index(body[0])
            piece = piece[:start] + spoken.normalize(body, mode, lang, budget) + piece[start + len(body):]
        out.append(piece)
    return "".join(out)


def _sentence_ends(text: str) -> Iterator[int]:
    """The sentence boundaries of a whole text (a segment's), up to the first undecided mark (one at its end)."""
    for m in _MARK.finditer(text):
        cut = _mark_cut(text, m, False)
        if cut is None:
            return
        if cut != _NOT_A_CUT and m.lastgroup != "clause":
            yield cut
