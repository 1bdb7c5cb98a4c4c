"""The streaming normaliser's shortcuts (plain text copied in one piece; words and single spaces not collapsed run by
run) give exactly what its character-by-character rules give, whatever the text and however it is split."""

import random
import re

from gateway.text.segmenter import (
    _EMOJI,
    _LINE_MARK,
    _LINE_MARK_PREFIX,
    _LINK,
    _LINK_PREFIX,
    _MARKUP_OR_EMOJI,
    _Normalizer,
)

PIECES = [
    "Hello", "world", "3.14", "Dr.", "e.g.", "...", "(see Fig. 2)", '"Stop."', "**bold**", "*it*", "`code`",
    "[link](http://a.b/c)", "![img](x.png)", "[not a link", "# ", "## ", "- ", "* ", "> ", "1. ", "\n", "\n\n",
    " ", "  ", "\t", "\u00a0", " \n ", ",", "!", "_", "__", "__init__", "snake_case", "🎉", "👍🏽", "你好", "。", "C#",
    "a-b",
]


class ByTheRules(_Normalizer):
    """The normaliser without its shortcuts: every character through the rules (the reference)."""

    def _strip(self, final: bool) -> str:
        raw = self.raw
        i, out = 0, []
        while i < len(raw):
            c = raw[i]
            if self._line_start:
                mark = _LINE_MARK.match(raw, i)
                if mark:
                    self._line_start = raw[mark.end() - 1 : mark.end()] == ">"
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
                break
            elif c == "!" and raw.startswith("[", i + 1):
                i += 1
            elif c == "[":
                link = _LINK.match(raw, i)
                if link:
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


def feed_all(normalizer: _Normalizer, pieces: list[str]) -> list[str]:
    """What each piece yields, then the end; and the state after each (so a shortcut cannot drift silently)."""
    out = []
    for piece in pieces:
        out.append(normalizer.feed(piece))
        out.append(repr((normalizer.raw, normalizer._line_start, normalizer._space, normalizer._started)))
    out.append(normalizer.feed("", final=True))
    return out


def splits(text: str, rng: random.Random) -> list[list[str]]:
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        chunks.append(text[i : i + n])
        i += n
    return [[text], chunks, list(text)]


def test_shortcuts_agree_with_the_rules_on_random_texts_and_splits():
    rng = random.Random(99)
    for _ in range(400):
        text = "".join(rng.choice(PIECES) + rng.choice(["", " ", " ", "", "  ", "\n"])
                       for _ in range(rng.randint(1, 40)))
        for pieces in splits(text, rng):
            assert feed_all(_Normalizer(), pieces) == feed_all(ByTheRules(), pieces), (text, pieces)


def test_the_shortcuts_are_taken_by_plain_text():
    # the cases they exist for: a turn's whole plain text (at a line start), and an LLM's word-and-space pieces
    assert not _MARKUP_OR_EMOJI.search("Sure, I can help with that. The quickest way is to restart the router.")
    normalizer = _Normalizer()
    assert normalizer.feed("Sure, I can help with that. ") == "Sure, I can help with that."
    assert normalizer.feed("Restart it ") + normalizer.feed("now.") == " Restart it now."
