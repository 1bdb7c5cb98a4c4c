"""Where a segment may end in a turn's text: sentence, clause and word boundaries (abbreviations, initials, decimals,
numbered lists and quotes are no sentence ends; CJK needs no space after a stop; a boundary is final only once the next
character has arrived), never inside a phoneme brace or a unit the normaliser reads as one; and a text's weight (CJK
characters count twice). Pure functions over the text: `gateway.text.segmenter` decides which boundary to cut at."""

from __future__ import annotations

import re
from collections.abc import Iterator
from itertools import accumulate

from gateway.text import normalize as spoken

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_WIDE = re.compile(f"[{_CJK}\uac00-\ud7af\u3000-\u303f\uff00-\uffef]")  # a wide char counts as two
IS_CJK = re.compile(f"[{_CJK}]")
_CANDIDATE = re.compile(
    r"(?P<sentence>[。！？]+[.!?…。！？]*|[.!?…]+)"
    r"|(?P<clause>[，；：]|[,;:]|—|(?<=\s)[-–](?=\s))"
    r"|(?P<newline>\n)"
    r"|(?P<word> )"
    f"|(?P<cjk>(?<=[{_CJK}])(?=[{_CJK}]))"
)
_CLOSERS = "\"'”’»)]}」』）】〉》"
_OPENERS = "([{（【「『〈《"
_BRACKET_CLOSERS = ")]}）】」』〉》"
_WORD_BEFORE = re.compile(r"[^\s(\[{\"'“‘«]*$")
_NEVER_ENDS = {  # "Dr. Smith", "e.g. Paris": a capital letter after these does not start a sentence
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "gen", "col", "capt", "lt", "sgt", "rev", "hon", "sen",
    "rep", "gov", "pres", "e.g", "i.e", "cf", "vs", "viz", "approx", "ca", "dept", "ave", "blvd",
}
_BEFORE_NUMBERS = {"no", "nos", "nr", "fig", "figs", "vol", "ch", "pp", "p", "art", "sec", "op", "eq", "ref"}


def weight(text: str) -> int:
    """Characters, counting CJK/wide characters twice (one hanzi carries about two Latin letters of speech)."""
    return len(text) + len(_WIDE.findall(text))


def prefix_weights(text: str) -> list[int] | range:
    """weights[i] == weight(text[:i])."""
    if not _WIDE.search(text):  # the common case, and this runs for every cut: no list to build
        return range(len(text) + 1)
    wide = {m.start() for m in _WIDE.finditer(text)}
    return list(accumulate((2 if i in wide else 1 for i in range(len(text))), initial=0))


def boundaries(buf: str, line_start: bool, normalizing: bool = False,
                words_from: int = 0) -> Iterator[tuple[int, str]]:
    """(cut position, kind) in order, kind in sentence/clause/word; stops at the first undecidable one. Never inside
    a phoneme brace; `normalizing`: never through a unit the normaliser reads as one ("3:45 PM", "$1,000.50").
    `words_from`: word boundaries before it are left out (for a caller that takes no word cut; they must be ones that
    cannot stop the scan: `normalize.word_cuts_decided_before`)."""
    for cut, kind in _candidates(buf, line_start):
        if cut < words_from and kind == "word":
            continue
        ok = spoken.cut_state(buf, cut, kind == "word") if normalizing else not spoken.inside_braces(buf, cut)
        if ok is None:
            return
        if ok:
            yield cut, kind


def _candidates(buf: str, line_start: bool) -> Iterator[tuple[int, str]]:
    for m in _CANDIDATE.finditer(buf):
        kind, start, end = m.lastgroup, m.start(), m.end()
        if kind in ("word", "cjk"):
            yield start, "word"
            continue
        if kind == "newline":
            yield start, "sentence"
            continue
        while end < len(buf) and buf[end] in _CLOSERS:
            end += 1
        if end == len(buf):
            return  # the next character decides (a digit after "3.", a closing quote, ...)
        nxt = buf[end]
        if kind == "clause":
            cjk = m.group()[0] in "，；：—"
            if (cjk or nxt.isspace()) and _depth(buf[:start]) == 0:
                yield end, "clause"
            continue
        if IS_CJK.match(m.group()[0]) or m.group()[0] in "。！？" or IS_CJK.match(nxt):
            yield end, "sentence"  # CJK needs no space after the stop
        elif nxt.isspace():
            after = end
            while after < len(buf) and buf[after].isspace():
                after += 1
            if after == len(buf):
                return
            if _ends_sentence(buf, start, m.group(), buf[after], line_start):
                yield end, "sentence"


def _ends_sentence(buf: str, dot: int, punct: str, nxt: str, line_start: bool) -> bool:
    if nxt.islower():
        return False  # "Stop." she said / Wait... what / e.g. lowercase
    if punct != ".":
        return True
    word = _WORD_BEFORE.search(buf, 0, dot).group()
    low = word.lower()
    if low in _NEVER_ENDS or (low in _BEFORE_NUMBERS and nxt.isdigit()):
        return False
    if len(word) == 1 and word.isupper():
        return False  # an initial: J. R. R. Tolkien
    begin = dot - len(word)
    # a numbered list item ("1. Preheat the oven") is no sentence end
    return not (word.isdigit() and (buf[:begin].endswith("\n") or (begin == 0 and line_start)))


def _depth(text: str) -> int:
    """Open brackets at the end of `text`: no clause cuts inside (but sentence cuts still happen)."""
    depth = 0
    for c in text:
        if c in _OPENERS:
            depth += 1
        elif c in _BRACKET_CLOSERS and depth:
            depth -= 1
    return depth


def speak(text: str, mode: str, lang: spoken.Lang) -> str:
    """`text` normalised sentence by sentence (the official normaliser's unit: its grammar reads a number differently
    with other sentences around it)."""
    out, pos, budget = [], 0, spoken.Budget()
    for cut in [*(cut for cut, kind in _candidates(text, False) if kind == "sentence"), len(text)]:
        piece, pos = text[pos:cut], cut
        body = piece.strip()
        if body:
            start = piece.index(body[0])
            piece = piece[:start] + spoken.normalize(body, mode, lang, budget) + piece[start + len(body):]
        out.append(piece)
    return "".join(out)
