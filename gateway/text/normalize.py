"""Text normalisation for speech: numbers, money, dates, times, units and symbols written out as words, the way the
official VoxCPM `normalize=True` does it (`voxcpm/utils/text_normalize.py`): WeTextProcessing's English and Chinese
TN grammars (the `wetext` package), `inflect` for digits the grammar leaves, and the official replacements.

Modes (`generation.normalize`; the segmenter hands over one sentence at a time, the official normaliser's unit):
- `on`: the official pipeline over the whole sentence.
- `auto`: the official pipeline over the spans that need it: tokens with digits or symbols, with one token of context
  before and two after (Chinese: three characters each side); plain words pass untouched. Text without numbers or
  symbols costs nothing, and plain text keeps clear of the grammar's side effects (quotes escaped with backslashes,
  "TV" read "Television", erhua removed).
- `off`: the text as written.
Phoneme braces (`{HH AH0 L OW1}`, `{ni3}`) pass untouched in every mode, and no segment boundary falls inside them.

Streaming: `cut_state(text, pos)` tells the segmenter where a cut leaves every unit whole ("$1,000.50", "3:45 PM",
"March 5, 1990" are never split), so normalising a turn segment by segment says the words of normalising it whole.
The language is the official test's (Chinese when the text holds a Chinese character), over the turn so far.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
import threading
from collections.abc import Callable
from typing import Any, Literal

log = logging.getLogger("voxgate.normalize")

MODES = ("auto", "on", "off")
Lang = Literal["en", "zh"]

_CHINESE = re.compile(r"[\u4e00-\u9fff]")
_BRACES = re.compile(r"\{[^{}]*\}")  # phoneme input: never normalised, never split
# what a token needs normalising for: digits, currency, units and math symbols, "@" / "&" / "#", a dot inside
# a word (domains, file names, "U.S."), an initial ("J. R. R. Tolkien", "p.m."), a Roman numeral ("World War II")
_TRIGGER = re.compile(r"[0-9$€£¥₹₩%‰°&@#+=×÷<>/²³√≈]|[A-Za-z]\.[A-Za-z]|\b[A-Za-z]\.|\b[IVX]{2,4}\b")
# every match of _TRIGGER holds one of these (a digit or symbol, a dot, a Roman numeral's letter): a scan for them
# alone costs ~10x less than the alternation's, and clears most text (`_triggers`)
_TRIGGER_CHAR = re.compile(r"[0-9$€£¥₹₩%‰°&@#+=×÷<>/²³√≈.IVX]")
_TRIGGER_START = re.compile(r"[0-9$€£¥₹₩%‰°&@#+=×÷<>/²³√≈]")
_TOKEN = re.compile(r"\S+")
_OPENING = "\"'“‘([{（【《「"
_CLOSING = "\"'”’)]}）】》」,;:!?，；：！？。"
_ABBREVIATION = re.compile(r"(?:[A-Za-z]\.)+|[A-Z][a-z]{0,3}\.")  # "p.m.", "U.S.", "Dr.", "Ave.": the dot is theirs
_EN_AFTER = 2  # English tokens of context after a token with a trigger ("at 123 Main Street": an address)
_ZH_CONTEXT = 3  # Chinese characters of context on each side of a span with digits (units, 年/月/日, 第, 百分之)
_ZH_STOPS = "，。！？；：、\n"
GRAMMAR_BUDGET_CHARS = 160  # per segment: at most ~7 ms of grammar for text, ~45 ms for a wall of numbers


def _triggers(text: str, pos: int = 0, endpos: int = sys.maxsize) -> bool:
    """`_TRIGGER.search(text, pos, endpos)` finds something: a token there needs normalising."""
    return _TRIGGER_CHAR.search(text, pos, endpos) is not None and _TRIGGER.search(text, pos, endpos) is not None


def contains_chinese(text: str) -> bool:
    """The official language test: any character in U+4E00..U+9FFF."""
    return not text.isascii() and _CHINESE.search(text) is not None  # isascii: O(1), a regex scans every character


def check_mode(value: Any) -> str:
    """`value` if it is a mode, else ValueError naming the choices."""
    if value not in MODES:
        raise ValueError(f"normalize: {value!r} must be one of {', '.join(MODES)}")
    return value


# --- the official pipeline ------------------------------------------------------------------------------------------

class _Official:
    """`voxcpm.utils.text_normalize.TextNormalizer.normalize` with its language given: the same libraries, the same
    steps in the same order."""

    def __init__(self) -> None:
        import inflect
        import regex
        from wetext import Normalizer

        self.zh = Normalizer(lang="zh", operator="tn", remove_erhua=True)
        self.en = Normalizer(lang="en", operator="tn")
        self.inflect = inflect.engine()
        self.emoji = regex.compile(r"\p{Emoji_Presentation}|\p{Emoji}\uFE0F", flags=regex.UNICODE)

    def clean(self, text: str) -> str:
        """The official `clean_text`: markdown, emoji, newlines and tabs, curly double quotes."""
        text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
        text = re.sub(r"`[^`]*`", "", text)
        text = re.sub(r"!\[[^\]]*\]\([^\)]+\)", "", text)
        text = re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", text)
        text = re.sub(r"^(\s*)-\s+", r"\1", text, flags=re.MULTILINE)
        text = re.sub(r"<[^>]+>", "", text)
        text = re.sub(r"^#{1,6}\s*", "", text, flags=re.MULTILINE)
        text = re.sub(r"\n\s*\n", "\n", text).strip()
        text = self.emoji.sub("", text)
        return text.replace("\n", " ").replace("\t", " ").replace("“", '"').replace("”", '"')

    def grammar(self, text: str, lang: Lang) -> str:
        """The TN grammar step and what the official code does right before and after it, for one language."""
        if lang == "zh":
            text = text.replace("=", "等于")
            if re.search(r"([\d$%^*_+≥≤≠×÷?=])", text):
                text = re.sub(r"(?<=[a-zA-Z0-9])-(?=\d)", " - ", text)  # "x-2" is x minus 2, not x negative 2
            return self.zh.normalize(text)
        return _spell_out_digits(self.en.normalize(text), self.inflect.number_to_words)

    def finish_zh(self, text: str) -> str:
        """The official steps after the Chinese grammar: blanks between non-ASCII characters, ², ³, √, ≈, <,
        brackets and dashes."""
        out = []
        for i, c in enumerate(text):
            if c != " " or (0 < i < len(text) - 1 and _ascii_word_char(text[i + 1]) and _ascii_word_char(text[i - 1])):
                out.append(c)
        text = "".join(out)
        for old, new in (("²", "平方"), ("³", "立方"), ("√", "根号"), ("≈", "约等于"), ("<", "小于"), ("（", " "),
                         ("）", " "), ("【", " "), ("】", " "), ("`", ""), ("——", " ")):
            text = text.replace(old, new)
        return text

    def normalize(self, text: str, lang: Lang) -> str:
        """The whole official pipeline."""
        text = self.clean(text)
        if not text.strip():
            return text
        text = self.grammar(text, lang)
        return self.finish_zh(text) if lang == "zh" else text


def _ascii_word_char(c: str) -> bool:
    return c.isascii() and c != " "


def _spell_out_digits(text: str, to_words: Callable[[str], str]) -> str:
    """The official `spell_out_number`: every run of digits (`str.isdigit`, so "²" too) the grammar left becomes
    words."""
    if not any(c.isdigit() for c in text):
        return text
    out, start = [], None
    for i, c in enumerate(text):
        if c.isdigit():
            start = i if start is None else start
            continue
        if start is not None:
            out.append(to_words(text[start:i]))
            start = None
        out.append(c)
    if start is not None:
        out.append(to_words(text[start:]))
    return "".join(out)


_loaded: _Official | None = None
_loading = threading.Lock()


def official() -> _Official:
    """The loaded grammars (about 2 s the first time; `preload` does it ahead of the first turn)."""
    global _loaded
    if _loaded is None:
        with _loading:
            if _loaded is None:
                _loaded = _Official()
    return _loaded


def preload() -> None:
    """Load the grammars now (a server calls this at start, so no turn waits for it)."""
    try:
        official()
    except Exception:  # no grammars: turns that need them say so (`normalize` falls back to the written text)
        log.exception("text normalisation grammars failed to load")


# --- spans, cuts, modes ---------------------------------------------------------------------------------------------

def _brace_spans(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in _BRACES.finditer(text)] if "{" in text else []


def _en_windows(text: str) -> list[tuple[int, int]]:
    """Spans to normalise in English text: each token with a trigger, with one token of context before and two after,
    merged where they overlap; opening and closing punctuation at a span's edges stays outside."""
    tokens = [m.span() for m in _TOKEN.finditer(text)]
    windows: list[list[int]] = []
    for i, (s, e) in enumerate(tokens):
        if not _triggers(text, s, e):
            continue
        lo, hi = max(0, i - 1), min(len(tokens) - 1, i + _EN_AFTER)
        if windows and lo <= windows[-1][1]:
            windows[-1][1] = hi
        else:
            windows.append([lo, hi])
    spans = []
    for lo, hi in windows:
        start, end = tokens[lo][0], tokens[hi][1]
        while start < end and text[start] in _OPENING:
            start += 1
        while end > start and (text[end - 1] in _CLOSING or
                               (text[end - 1] == "." and not _abbreviation_end(text, end))):
            end -= 1
        if start < end:
            spans.append((start, end))
    return spans


def _abbreviation_end(text: str, end: int) -> bool:
    start = end
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    return _ABBREVIATION.fullmatch(text, start, end) is not None


def _zh_windows(text: str) -> list[tuple[int, int]]:
    """Spans to normalise in Chinese text: each run of non-Chinese characters with a trigger, with up to three
    characters of context each side (not across clause punctuation), merged where they meet."""
    spans: list[list[int]] = []
    for m in re.finditer(r"[^\u4e00-\u9fff" + _ZH_STOPS + r"]+", text):
        if not _triggers(m.group()):
            continue
        start, end = m.start(), m.end()
        for _ in range(_ZH_CONTEXT):
            if start > 0 and text[start - 1] not in _ZH_STOPS:
                start -= 1
            if end < len(text) and text[end] not in _ZH_STOPS:
                end += 1
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return [(start, end) for start, end in spans]


class Budget:
    """How much text one segment may put through the grammar. The grammar holds the GIL (a thread would not spare
    the event loop) and costs ~40 us a character, up to ~300 us in dense numbers; past the budget, digits are
    spelled out run by run (`inflect`, microseconds), so no text, however long or dense, stalls the other sessions."""

    def __init__(self, chars: int = GRAMMAR_BUDGET_CHARS):
        self.left = chars

    def take(self, chars: int) -> bool:
        if chars > self.left:
            return False
        self.left -= chars
        return True


def normalize(text: str, mode: str = "auto", lang: Lang | None = None, budget: Budget | None = None) -> str:
    """The spoken form of one sentence. `lang`: None decides from the text itself (as the official code does);
    `budget`: shared by the sentences of one segment."""
    if mode == "off" or not text:
        return text
    if lang is None:
        lang = "zh" if contains_chinese(text) else "en"
    budget = budget or Budget()
    try:
        if mode == "on":
            said = _around_braces(text, lambda piece: _guarded(official().normalize, piece, lang)
                                  if budget.take(len(piece)) else _normalize_auto(piece, lang, budget))
        else:
            said = _around_braces(text, lambda piece: _normalize_auto(piece, lang, budget))
    except Exception:  # the grammars cannot load (logged by `preload`): the text as written
        log.debug("text normalisation unavailable", exc_info=True)
        return text
    return said if said.strip() else text  # all of it was markup to the official cleaner: say it as written


def as_written(text: str) -> bool:
    """Whether `normalize(sentence, "auto", "en")` gives every sentence of `text` back as it is: no token needs words
    (`_TRIGGER`, searched once over the whole text: a match inside one of its sentences is a match in it) and no
    newline or tab, which the official cleaner turns into spaces. Most English segments: no grammar, no split."""
    return "\n" not in text and "\t" not in text and not _triggers(text)


def _guarded(convert: Callable[[str, Lang], str], text: str, lang: Lang) -> str:
    """`convert(text, lang)`; where the grammar fails on a text (the official code raises), its digits as words."""
    try:
        return convert(text, lang)
    except Exception:
        log.debug("the TN grammar failed on %r; spelling its digits out", text[:80], exc_info=True)
        try:
            return _spell_out_digits(text, official().inflect.number_to_words)
        except Exception:  # a number inflect cannot say either: as written
            return text


def _around_braces(text: str, convert: Callable[[str], str]) -> str:
    """`convert` over the text between phoneme braces; the braces and their spacing stay as they are."""
    out, pos = [], 0
    for start, end in [*_brace_spans(text), (len(text), len(text))]:
        piece = text[pos:start]
        if piece.strip():
            lead, trail = piece[: len(piece) - len(piece.lstrip())], piece[len(piece.rstrip()):]
            out.append(lead + convert(piece.strip()) + trail)
        else:
            out.append(piece)
        out.append(text[start:end])
        pos = end
    return "".join(out)


def _normalize_auto(text: str, lang: Lang, budget: Budget) -> str:
    text = text.replace("\n", " ").replace("\t", " ")  # as the official `clean_text`
    if not _triggers(text):
        return official().finish_zh(text) if lang == "zh" else text
    engine = official()
    spans = _zh_windows(text) if lang == "zh" else _en_windows(text)
    out, pos = [], 0
    for start, end in spans:
        out.append(text[pos:start])
        span = text[start:end]
        if budget.take(end - start):
            out.append(_cached_grammar(span, lang))
        else:
            out.append(_guarded(_spell_out_only, span, lang))
        pos = end
    out.append(text[pos:])
    joined = "".join(out)
    return engine.finish_zh(joined) if lang == "zh" else joined


def _spell_out_only(text: str, lang: Lang) -> str:
    return _spell_out_digits(text, official().inflect.number_to_words)


@functools.lru_cache(maxsize=4096)
def _cached_grammar(span: str, lang: Lang) -> str:
    """Spans repeat (prices, times, versions): each one through the grammar once."""
    return _guarded(official().grammar, span, lang)


def inside_braces(text: str, pos: int) -> bool:
    """`pos` lies inside a phoneme brace (open or closed) of `text`."""
    return "{" in text and text.count("{", 0, pos) > text.count("}", 0, pos)


def cut_state(text: str, pos: int, word: bool = True, at_end: bool = False) -> bool | None:
    """Whether a segment may end at `pos` of `text` (the text so far) with every unit whole: True, False, or None
    while the text still to come decides. Never inside a phoneme brace; at a clause or sentence mark, yes (but not
    "March 5," before "1990"); at a word boundary, not after a token with digits or symbols (English: either of the
    two before), not before a word that starts with one, nor within three characters of one (Chinese).
    `word`: a cut at whitespace (False: after a clause or sentence mark); `at_end`: the text is all there is for now
    (a cut on a timeout).

    The segmenter asks this at every word of a turn's text, and a new turn's first text is cut in the handler of its
    message (in a burst, every other turn's handler waits for it), so it looks at the characters around `pos` only:
    no copy of the text before or after it."""
    if inside_braces(text, pos):
        return False
    end = pos  # `text[:pos].rstrip()` is text[:end]
    while end and text[end - 1].isspace():
        end -= 1
    nxt = pos  # `text[pos:].lstrip()` starts at nxt (empty when nxt == len(text))
    while nxt < len(text) and text[nxt].isspace():
        nxt += 1
    last = text[end - 1] if end else ""
    first = text[nxt] if nxt < len(text) else ""
    if not word and last and last in _CLAUSE_ENDS:
        if last == "," and end >= 2 and text[end - 2].isdigit():  # "March 5, 1990", "1, 2, 3"
            return (False if at_end else None) if not first else not first.isdigit()
        return True
    if _is_chinese(last) or _is_chinese(first):
        if len(text) - pos < _ZH_CONTEXT and not at_end:
            return None
        return not _triggers(text[max(0, pos - _ZH_CONTEXT):pos + _ZH_CONTEXT])
    # either of the two tokens before (of the 40 characters before, as a token may be longer); those 40 without a
    # character any trigger holds (most words) need no tokens split off
    window = max(0, end - 40)
    if _TRIGGER_CHAR.search(text, window, end) is not None \
            and _triggers(" ".join(text[window:end].split()[-_EN_AFTER:])):
        return False
    if not first:  # a timeout: the next word is unknown; a month name waits for its day ("on March" + "5, 1990")
        return _MONTH.fullmatch(text[max(0, end - 12):end].split()[-1]) is None if at_end and end else None
    # the next word by its first character alone, so the cut is decided as soon as the segmenter's own rule allows
    # (the next visible character has arrived): a number or symbol starting it keeps its left context
    return _TRIGGER_START.match(first) is None


def word_cuts_decided_before(text: str) -> int:
    """A position before which `cut_state` of a word boundary (word=True, not at_end) is True or False, never None:
    it is undecided only at the text's end (the next word unknown) or within the Chinese context of it."""
    return min(len(text.rstrip()), len(text) - _ZH_CONTEXT)


def _is_chinese(c: str) -> bool:
    """`contains_chinese` of one character (or of "")."""
    return "\u4e00" <= c <= "\u9fff"


_MONTH = re.compile(r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?")
_CLAUSE_ENDS = ".,;!?，；：！？。…"
