"""gateway.text.normalize against the official `voxcpm` normaliser (the oracle) on an LLM-style corpus, and streamed:
a turn normalised segment by segment says the words of the turn normalised whole, however its text arrives."""

import random
import re
from pathlib import Path

import pytest

from gateway.text import normalize as spoken
from gateway.text.segmenter import ChunkingConfig, Segmenter
from gateway.text.segmenter import normalize as strip_markdown

DATA = Path(__file__).parent / "data"
CORPUS = [line for name in ("en", "zh") for line in (DATA / f"normalize_corpus_{name}.txt").read_text().splitlines()
          if line.strip()]
STREAMS = sorted(DATA.glob("llm_stream_*.txt"))


@pytest.fixture(scope="module")
def official():
    from voxcpm.utils.text_normalize import TextNormalizer

    return TextNormalizer()


def _official_or_none(official, text: str) -> str | None:
    try:
        return official.normalize(text)
    except Exception:  # the official grammar raises on a few inputs ("+1 212 555 0100"): no reference there
        return None


def test_the_corpus_is_large_and_covers_both_languages():
    zh = [s for s in CORPUS if spoken.contains_chinese(s)]
    assert len(CORPUS) >= 300 and len(zh) >= 100 and len(CORPUS) - len(zh) >= 200
    assert sum(bool(re.search(r"\d", s)) for s in CORPUS) >= 0.95 * len(CORPUS)


def test_on_equals_the_official_normalizer_on_every_sentence(official):
    compared = 0
    for sentence in CORPUS:
        reference = _official_or_none(official, sentence)
        if reference is None:
            continue
        compared += 1
        assert spoken.normalize(sentence, "on") == reference, sentence
    assert compared >= len(CORPUS) - 3


def test_auto_speaks_every_number_as_the_official_does_and_leaves_plain_words(official):
    """auto runs the official pipeline only around digits and symbols: the same as the official except where the
    official also rewrites plain words ("TV" -> "Television", "World War II" -> "two") or trims a final stop."""
    same = 0
    for sentence in CORPUS:
        said = spoken.normalize(sentence, "auto")
        assert not re.search(r"\d", said), (sentence, said)
        same += said == _official_or_none(official, sentence)
    assert same >= 0.98 * len(CORPUS)


def test_the_grammar_failing_on_a_text_still_speaks_its_digits():
    said = spoken.normalize("Dial +1 212 555 0100 for the New York office.", "on")
    assert not re.search(r"\d", said) and said.endswith("for the New York office.")


@pytest.mark.parametrize("mode", ["auto", "on"])
@pytest.mark.parametrize("text", ["Say {HH AH0 L OW1} at 3:45 PM, please.", "你好{ni3}世界，价格是3.5%。",
                                  "{T UW1} {F AY1 V} and 25 more"])
def test_phoneme_braces_pass_untouched(mode, text):
    said = spoken.normalize(text, mode)
    assert re.findall(r"\{[^}]*\}", said) == re.findall(r"\{[^}]*\}", text)
    assert not re.search(r"\d", re.sub(r"\{[^}]*\}", "", said))


def test_off_is_the_text_as_written_and_modes_are_checked():
    assert spoken.normalize("It costs $5.", "off") == "It costs $5."
    with pytest.raises(ValueError, match="auto, on, off"):
        spoken.check_mode("always")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _deltas(text: str, seed: int) -> list[str]:
    """Like an LLM token stream: 1-4 characters, mid-word, mid-number."""
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 4)
        out.append(text[i:i + n])
        i += n
    return out


def _stream(deltas: list[str], mode: str, timeouts: bool) -> list:
    """Segments of a turn fed delta by delta; `timeouts`: the first-segment timer fires after every delta (a cut
    wherever one is allowed, as if the LLM paused there)."""
    clock = FakeClock()
    segmenter = Segmenter(ChunkingConfig(), clock=clock, normalize=mode)
    segments = []
    for delta in deltas:
        segments += segmenter.push(delta)
        if timeouts:
            clock.now += 10.0
            segments += segmenter.poll()
    return segments + segmenter.end()


def _whole(text: str, mode: str) -> str:
    """The turn normalised whole: the written text (markdown stripped) sentence by sentence, the official unit."""
    segmenter = Segmenter(ChunkingConfig(max_chars=8000), clock=FakeClock(), normalize=mode)
    segments = segmenter.push(text) + segmenter.end()
    written = " ".join(s.text for s in segments)
    assert written == strip_markdown(text).strip() or len(segments) > 1
    return " ".join(s.speak() for s in segments)


def _words(text: str) -> list[str]:
    """The words said, punctuation aside (Chinese: its characters)."""
    if spoken.contains_chinese(text):
        return [c for c in text if c.isalnum()]
    return [w for w in (t.strip(".,;:!?\"'()") for t in text.split()) if w]


def _turns() -> list[str]:
    """The LLM fixtures and the corpus in turns of eight sentences, one a line."""
    corpus = [(DATA / f"normalize_corpus_{name}.txt").read_text().splitlines() for name in ("en", "zh")]
    return [p.read_text() for p in STREAMS] + ["\n".join(lines[i:i + 8]) for lines in corpus
                                                for i in range(0, len(lines), 8)]


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_turn_streamed_delta_by_delta_says_the_words_of_the_whole_turn(mode):
    for k, text in enumerate(_turns()):
        whole = _words(_whole(text, mode))
        for seed in (k, k + 1000):
            segments = _stream(_deltas(text, seed), mode, timeouts=False)
            assert _words(" ".join(s.speak() for s in segments)) == whole, text[:60]


def test_cuts_do_not_depend_on_how_the_text_arrives():
    """With normalisation on, the segmenter still cuts by the text alone: the same segments from any split."""
    for k, text in enumerate(_turns()):
        whole = [(s.text, s.speak()) for s in _stream([text], "auto", timeouts=False)]
        assert [(s.text, s.speak()) for s in _stream(_deltas(text, k), "auto", timeouts=False)] == whole
        assert [(s.text, s.speak()) for s in _stream(list(text), "auto", timeouts=False)] == whole


def test_cuts_wherever_a_pause_allows_still_say_the_same_words():
    """auto (the default) with the timer firing after every delta: segments end wherever the segmenter allows."""
    for k, text in enumerate(_turns()):
        whole = _words(_whole(text, "auto"))
        segments = _stream(_deltas(text, k), "auto", timeouts=True)
        assert len(segments) > text.count("\n") + 1  # the timer did cut inside sentences
        assert _words(" ".join(s.speak() for s in segments)) == whole, text[:60]


@pytest.mark.parametrize("unit", ["$1,000.50", "3:45 PM", "2026-12-03", "3.5%", "March 5, 1990", "1,200 km",
                                  "{HH AH0 L OW1}", "{ni3}", "2026年12月3日"])
def test_no_segment_boundary_splits_a_unit(unit):
    """Without normalisation, the timer cuts most of these (braces aside) for one of these lead-ins."""
    for lead in ("Well then here it is", "So the total we want", "Okay", "那么我们来看看吧这个是"):
        text = f"{lead} {unit} and that is all for today"
        for mode in ("auto", "on"):
            for seed in range(6):
                segments = _stream(_deltas(text, seed), mode, timeouts=True)
                assert any(unit in s.text for s in segments), (mode, [s.text for s in segments])


def test_braces_are_never_split_even_with_normalisation_off():
    text = "Please say the word {HH AH0 L OW1 W ER1 L D} slowly and clearly for me"
    for seed in range(6):
        segments = _stream(_deltas(text, seed), "off", timeouts=True)
        assert any("{HH AH0 L OW1 W ER1 L D}" in s.text for s in segments)
        assert all(s.speak() == s.text for s in segments)


def test_a_chinese_turn_speaks_its_english_clauses_the_chinese_way():
    """The official code picks the language per input: Chinese once it holds a Chinese character, so a segment of
    digits and Latin letters in a Chinese turn is read in Chinese."""
    segmenter = Segmenter(ChunkingConfig(min_chars=1, first_chars=4), clock=FakeClock(), normalize="auto")
    segments = segmenter.push("价格是多少？ The price is 3.5%, ") + segmenter.push("好的。") + segmenter.end()
    said = " ".join(s.speak() for s in segments)
    assert "百分之三点五" in said and not re.search(r"\d", said)


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_wall_of_numbers_puts_a_bounded_amount_of_text_through_the_grammar(mode, monkeypatch):
    """The grammar holds the GIL: past a budget per segment, digits are spelled out without it, so one client's
    text cannot stall the event loop for the others."""
    engine = spoken.official()
    fed: list[int] = []
    for name in ("grammar", "normalize"):
        real = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda text, lang, real=real: fed.append(len(text)) or real(text, lang))
    spoken._cached_grammar.cache_clear()
    wall = " ".join(f"${i},{i:03d}.{i % 100:02d} on 2026-12-{i % 28 + 1:02d}" for i in range(200))
    segmenter = Segmenter(ChunkingConfig(max_chars=8000, min_chars=2000, first_chars=2000), clock=FakeClock(),
                          normalize=mode)
    segments = segmenter.push(wall) + segmenter.end()
    said = " ".join(s.speak() for s in segments)
    assert len(segments) <= 2 and not re.search(r"\d", said)
    assert sum(fed) <= spoken.GRAMMAR_BUDGET_CHARS * len(segments)


def test_voxgate_say_takes_the_setting(capsys):
    from gateway.cli import _parser

    assert _parser().parse_args(["say", "It costs $5.", "-o", "x.wav"]).normalize == "auto"
    assert _parser().parse_args(["say", "x", "-o", "x.wav", "--normalize", "off"]).normalize == "off"
    with pytest.raises(SystemExit):
        _parser().parse_args(["say", "x", "-o", "x.wav", "--normalize", "always"])
    assert "invalid choice" in capsys.readouterr().err
