"""The text path's shortcuts give exactly what the regexes and the sentence-by-sentence normaliser they skip give:
ASCII text's whole-text checks by `isascii` and substring searches, the trigger test's character prefilter, word
candidates found by `str.find`, and a segment that needs no words spoken as written (gateway/text)."""

import random
from pathlib import Path

from gateway.text import boundaries, segmenter
from gateway.text import normalize as spoken

DATA = Path(__file__).parent / "data"
CORPUS = [line for path in sorted(DATA.glob("*.txt")) for line in path.read_text().splitlines() if line.strip()]
PIECES = list("abcdefgh IVXivx.,!?;:-\"'()[]{}*`_\n\t") + ["Dr.", "U.S.", "3", "$", "5%", "。", "II", "p.m.", " J. ",
                                                              "中文", "ｱ", "😀", "![", "[a](b)", "March 5, 1990"]


def _random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 40))) for _ in range(n)] + CORPUS


def test_the_trigger_prefilter_never_clears_a_trigger():
    texts = _random_texts(3000, 1)
    found = [bool(spoken._TRIGGER.search(t)) for t in texts]
    assert [spoken._triggers(t) for t in texts] == found
    assert any(found) and not all(found)
    for t in texts[:500]:  # with a window, as the normaliser searches a span
        for lo in range(0, len(t), 7):
            assert spoken._triggers(t, lo, lo + 9) == bool(spoken._TRIGGER.search(t, lo, lo + 9))


def test_whole_text_checks_of_ascii_text_match_the_regexes():
    for t in _random_texts(3000, 2):
        assert spoken.contains_chinese(t) == bool(spoken._CHINESE.search(t))
        assert segmenter._markup_or_emoji(t) == bool(segmenter._MARKUP_OR_EMOJI.search(t))
        assert boundaries.weight(t) == len(t) + len(boundaries._WIDE.findall(t))
        for lo in range(0, len(t) + 1, 5):
            assert boundaries._word_starts(t, lo, len(t)) == [m.start() for m in boundaries._WORD.finditer(t, lo)]


def test_a_segment_said_as_written_is_what_each_of_its_sentences_normalises_to():
    said_as_written = 0
    for t in _random_texts(2000, 3):
        if not spoken.as_written(t):
            continue
        said_as_written += 1
        assert boundaries.speak(t, "auto", "en") == t
        pos = 0
        for cut in [*boundaries._sentence_ends(t), len(t)]:
            body, pos = t[pos:cut].strip(), cut
            assert spoken.normalize(body, "auto", "en") == body
    assert said_as_written > 100
    assert not spoken.as_written("It costs $5.") and not spoken.as_written("one\ntwo")

