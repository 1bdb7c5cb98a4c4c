"""gateway.text.segmenter: streamed LLM text -> segments; nothing lost, split-independent, time-aware via a fake
clock."""

import random
from pathlib import Path

import pytest

from gateway.text.boundaries import weight
from gateway.text.segmenter import REASONS, ChunkingConfig, Segmenter, normalize

DATA = sorted(Path(__file__).parent.glob("data/llm_stream_*.txt"))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tokens(text: str, seed: int) -> list[str]:
    """Split like an LLM token stream: 1-4 characters, mid-word, mid-number, mid-markup."""
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 4)
        out.append(text[i : i + n])
        i += n
    return out


def run(pieces: list[str], config: ChunkingConfig | None = None) -> list[tuple[str, str]]:
    segmenter = Segmenter(config, clock=FakeClock())
    out = []
    for piece in pieces:
        out += segmenter.push(piece)
    out += segmenter.end()
    assert [s.index for s in out] == list(range(len(out)))
    assert segmenter.buffered_chars == 0 and segmenter.next_deadline() is None
    return [(s.text, s.reason) for s in out]


def assert_covers(segments: list[tuple[str, str]], text: str) -> None:
    """The segments, in order, are exactly the normalised text (only whitespace between them is dropped)."""
    norm, pos = normalize(text), 0
    for seg, _ in segments:
        assert seg and seg == seg.strip()
        while pos < len(norm) and norm[pos].isspace():
            pos += 1
        assert norm.startswith(seg, pos), (seg, norm[pos : pos + 40])
        pos += len(seg)
    assert norm[pos:].strip() == ""


@pytest.mark.parametrize("path", DATA, ids=lambda p: p.stem)
def test_llm_streams_token_by_token_give_the_same_segments_as_whole(path):
    text = path.read_text()
    whole = run([text])
    assert len(whole) > 5
    assert_covers(whole, text)
    for seed in range(4):
        assert run(tokens(text, seed)) == whole
    config = ChunkingConfig()
    for seg, reason in whole:
        assert reason in REASONS
        assert weight(seg) <= config.max_chars
        if reason in ("clause", "sentence"):
            assert weight(seg) >= config.min_chars


@pytest.mark.parametrize("path", DATA, ids=lambda p: p.stem)
def test_segments_never_end_inside_a_number_link_or_markup(path):
    segments = [seg for seg, _ in run(tokens(path.read_text(), seed=9))]
    for seg in segments:
        assert not any(c in seg for c in "*`#")
        assert "](" not in seg and "(http" not in seg  # links are spoken as their text
    norm = normalize(path.read_text())
    for number in ("149.99", "93.5", "3.5", "21196.18", "5.3", "v2.0.1", "1:16"):
        if number in norm:
            assert any(number in seg for seg in segments), number


PIECES = [
    "Hello", "world", "3.14", "$1,000.50", "Dr.", "Mr. Smith", "e.g.", "U.S.", "etc.", "J. R. R.", "Tolkien", "...",
    "…", "(see Fig. 2)", '"Stop."', "she said", "example.com/a.b", "mail@x.org", "**bold**", "`code`", "[link](http://a.b/c)",
    "![img](x.png)", "# ", "- ", "1. ", "\n", "\n\n", " ", "  ", ",", ";", ":", "!", "?", ".", "—", " - ", "🎉", "👍🏽",
    "你好", "世界", "。", "，", "！", "？", "“引号”", "《书名》", "Python", "3.", "14", "__init__", "snake_case", "C#",
]


def test_property_random_texts_and_random_splits_lose_nothing_and_agree():
    rng = random.Random(1234)
    for trial in range(60):
        text = "".join(rng.choice(PIECES) + rng.choice(["", " ", " ", ""]) for _ in range(rng.randint(1, 60)))
        config = rng.choice([ChunkingConfig(), ChunkingConfig(min_chars=1, first_chars=5, max_chars=40),
                             ChunkingConfig(schedule=(30, 50), max_chars=60)])
        whole = run([text], config)
        assert_covers(whole, text)
        assert run(tokens(text, seed=trial), config) == whole
        assert run(list(text), config) == whole
        assert all(weight(seg) <= config.max_chars for seg, _ in whole)


def later_segments(text: str, queued_ms: float = 5000, **config) -> list[str]:
    """Segments after the (clause-eager) first one, while plenty of audio is queued: whole sentences."""
    segmenter = Segmenter(ChunkingConfig(min_chars=1, **config), clock=FakeClock())
    segmenter.set_queued_audio_ms(queued_ms)
    out = segmenter.push("Intro sentence here. " + text) + segmenter.end()
    assert out[0].text == "Intro sentence here."
    return [s.text for s in out[1:]]


@pytest.mark.parametrize("text,expected", [
    ("It costs 3.14 dollars. Then we left.", ["It costs 3.14 dollars.", "Then we left."]),
    ("The price is $1,000.50, not less. Buy now.", ["The price is $1,000.50, not less.", "Buy now."]),
    ("Dr. Smith and Mr. Jones arrived. They sat.", ["Dr. Smith and Mr. Jones arrived.", "They sat."]),
    ("J. R. R. Tolkien wrote it. Read it.", ["J. R. R. Tolkien wrote it.", "Read it."]),
    ("Eat fruit, e.g. Apples or pears. Also nuts.", ["Eat fruit, e.g. Apples or pears.", "Also nuts."]),
    ('"Stop." she said. He stopped.', ['"Stop." she said.', "He stopped."]),
    ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
    ("Wait... what happened? Nothing!", ["Wait... what happened?", "Nothing!"]),
    ("See example.com/docs.html today. Or mail a.b@c.org now.",
     ["See example.com/docs.html today.", "Or mail a.b@c.org now."]),
    ("It is shown in Fig. 3 below. (Really. It is.) Next.", ["It is shown in Fig. 3 below.", "(Really.", "It is.)",
                                                            "Next."]),
    ("Steps:\n1. Mix the flour.\n2. Bake it.", ["Steps:", "1. Mix the flour.", "2. Bake it."]),
    ("Version 2.0 is out! Get it at 10:30 today.", ["Version 2.0 is out!", "Get it at 10:30 today."]),
    ("你好。我很好！你呢？", ["你好。", "我很好！", "你呢？"]),
    ("他说：“好的。”然后走了。", ["他说：“好的。”", "然后走了。"]),
    ("我喜欢Python。It is great.", ["我喜欢Python。", "It is great."]),
    ("\n# Title\n**Bold** claim. [Docs](https://x.io/a.b). Done", ["Title", "Bold claim.", "Docs.", "Done"]),
])
def test_sentence_detection(text, expected):
    assert later_segments(text) == expected


def test_little_queued_audio_releases_clauses_plenty_releases_sentences():
    text = "Intro sentence here. We walked home, then we ate dinner; it was late. And"
    low = Segmenter(clock=FakeClock())
    assert [s.text for s in low.push(text)] == ["Intro sentence here.", "We walked home,", "then we ate dinner;",
                                                "it was late."]
    high = Segmenter(clock=FakeClock())
    high.set_queued_audio_ms(2000)
    released = [s.text for s in high.push(text)]
    assert released == ["Intro sentence here.", "We walked home, then we ate dinner; it was late."]


def test_markdown_is_stripped():
    assert normalize("**bold** and *it* and `code` and ```py\nx = 1\n```") == "bold and it and code and py\nx = 1"
    assert normalize("# Heading\n## Sub\n- one\n* two\n+ three\n> quoted") == "Heading\nSub\none\ntwo\nthree\nquoted"
    assert normalize("See [the docs](https://a.b/c_d.html) and ![a cat](cat.png).") == "See the docs and a cat."
    assert normalize("[not a link] and [**bold link**](x)") == "[not a link] and bold link"
    kept = "snake_case, C# and #1, 5 - 3, -5 degrees"
    assert normalize("__init__ vs " + kept) == "init vs " + kept
    assert normalize("Great job 🎉👍🏽!  Done   now\n\n\nNext") == "Great job ! Done now\nNext"
    assert normalize("  \n leading and trailing  \n ") == "leading and trailing"


def test_markup_split_across_tokens_is_still_stripped():
    text = "**Bold** start. A [link](http://x.y/z) here, and `code` too. # not a heading"
    for pieces in (list(text), tokens(text, 3)):
        segments = run(pieces)
        assert " ".join(s for s, _ in segments) == "Bold start. A link here, and code too. # not a heading"


def test_a_boundary_is_final_only_when_the_next_character_arrives():
    seg = Segmenter(ChunkingConfig(min_chars=1), clock=FakeClock())
    assert seg.push("It is 3.") == []  # "3." may become "3.14"
    assert seg.push("14") == []
    out = seg.push(" now. Yes")
    assert [s.text for s in out] == ["It is 3.14 now."]
    seg = Segmenter(ChunkingConfig(min_chars=1), clock=FakeClock())
    assert seg.push("Call Dr.") == [] and seg.push(" ") == []
    assert seg.push("Smith, please") and seg.segments[0].text == "Call Dr. Smith,"


def test_first_segment_leaves_at_the_first_clause_boundary():
    seg = Segmenter(clock=FakeClock())
    assert seg.push("Hello there,") == []
    out = seg.push(" my friend")
    assert [(s.text, s.reason) for s in out] == [("Hello there,", "clause")]


def test_first_segment_leaves_after_first_chars_at_a_word_boundary():
    seg = Segmenter(ChunkingConfig(first_chars=20), clock=FakeClock())
    released = []
    for piece in tokens("The quick brown fox jumps over the lazy dog", seed=2):
        released += seg.push(piece)
    assert [(s.text, s.reason) for s in released] == [("The quick brown fox jumps", "length")]
    assert 20 <= weight(released[0].text) < 20 + len("jumps ")


def test_first_segment_leaves_after_max_delay_without_a_boundary():
    clock = FakeClock()
    seg = Segmenter(ChunkingConfig(max_delay_ms=600), clock=clock)
    assert seg.push("Well I think so") == []
    assert seg.next_deadline() == pytest.approx(0.6)
    clock.now = 0.59
    assert seg.poll() == []
    clock.now = 0.6
    out = seg.poll()
    assert [(s.text, s.reason) for s in out] == [("Well I think", "timeout")]  # "so" may be the start of "soon"
    assert seg.pending_text == "so"
    assert seg.next_deadline() is None  # "so" alone is below min_chars: only more text or end() releases it
    assert [(s.text, s.reason) for s in seg.end()] == [("so", "end")]


def test_timeout_releases_a_complete_last_word_and_waits_for_a_short_buffer():
    clock = FakeClock()
    seg = Segmenter(clock=clock)
    assert seg.push("Hi") == [] and seg.next_deadline() is None  # below min_chars: nothing to time out
    clock.now = 0.2
    assert seg.push(" there Sam ") == []
    clock.now = 5.0
    assert [s.text for s in seg.poll()] == ["Hi there Sam"]  # the space proves "Sam" is complete


def test_deadline_waits_while_plenty_of_audio_is_queued():
    clock = FakeClock()
    seg = Segmenter(clock=clock)
    seg.push("First part, and")
    clock.now = 1.0
    seg.set_queued_audio_ms(3000)
    seg.push(" then a long clause without any end")
    assert seg.next_deadline() == pytest.approx(1.0 + 3.0 - 0.5)  # released just before the queue runs dry
    clock.now = 2.0
    assert seg.poll() == []
    seg.set_queued_audio_ms(200)  # the listener caught up: the timeout is max_delay_ms again
    assert seg.next_deadline() == pytest.approx(0.6)
    assert [(s.text, s.reason) for s in seg.poll()] == [("and then a long clause without any", "timeout")]


def test_short_fragments_merge_and_the_tail_is_never_cut_off():
    assert run(["Hi. How are you today? Fine. Ok"]) == [("Hi. How are you today?", "sentence"), ("Fine. Ok", "end")]
    assert run(["Last words without a stop"]) == [("Last words without a", "length"), ("stop", "end")]
    assert run([""]) == [] and run(["   \n "]) == []


def test_max_chars_cuts_at_the_best_boundary_before_the_cap():
    words = " ".join(f"word{i}" for i in range(60))
    segments = run(tokens(words, 1), ChunkingConfig(max_chars=40))
    assert all(weight(s) <= 40 for s, _ in segments)
    assert " ".join(s for s, _ in segments) == words  # cut between words, never inside one
    text = "This one, that one, " * 5 + "and a very long tail that keeps going on and on without end"
    segments = run([text], ChunkingConfig(max_chars=50))
    assert [s for s, _ in segments][:2] == ["This one,", "that one,"]
    assert run(["x" * 120], ChunkingConfig(max_chars=50)) == [("x" * 50, "length"), ("x" * 50, "length"),
                                                               ("x" * 20, "end")]


def test_schedule_sets_the_minimum_size_of_each_segment():
    text = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen."
    segments = [s for s, _ in run(tokens(text, 4), ChunkingConfig(schedule=(20, 40)))]
    assert weight(segments[0]) >= 20 and all(weight(s) >= 40 for s in segments[1:-1])
    assert " ".join(segments) == text


def test_flush_releases_everything_and_the_turn_goes_on():
    seg = Segmenter(clock=FakeClock())
    assert seg.push("Hello wor") == []
    assert [(s.text, s.reason) for s in seg.flush()] == [("Hello wor", "flush")]
    assert seg.flush() == []
    seg.push("ld. And **more")
    assert [(s.text, s.reason) for s in seg.end()] == [("ld. And more", "end")]
    assert seg.ended and seg.end() == []


def test_bad_input_gets_clear_errors():
    seg = Segmenter()
    with pytest.raises(ValueError, match="text"):
        seg.push(None)  # type: ignore[arg-type]
    seg.end()
    with pytest.raises(ValueError, match="ended"):
        seg.push("more")


@pytest.mark.parametrize("d,field", [
    ({"first_chars": 0}, "chunking.first_chars"),
    ({"max_delay_ms": -1}, "chunking.max_delay_ms"),
    ({"min_chars": "8"}, "chunking.min_chars"),
    ({"max_chars": 10}, "chunking.max_chars"),
    ({"first_chars": 500, "max_chars": 300}, "chunking.max_chars"),
    ({"schedule": []}, "chunking.schedule"),
    ({"schedule": [120, 0]}, "chunking.schedule"),
    ({"schedule": "120"}, "chunking.schedule"),
    ({"chunk_size": 5}, "chunking.chunk_size"),
])
def test_chunking_config_rejects_bad_values_naming_the_field(d, field):
    with pytest.raises(ValueError, match=field):
        ChunkingConfig.from_dict(d)


def test_chunking_config_from_dict():
    assert ChunkingConfig.from_dict(None) == ChunkingConfig()
    assert ChunkingConfig.from_dict({"schedule": [120, 160, 250, 290]}).schedule == (120, 160, 250, 290)


def test_a_push_held_to_one_segment_then_released_gives_exactly_the_whole_push():
    """`push(text, limit=1)` + `release()` (a new turn's first text: its first segment now, the rest after the burst's
    other handlers) are the segments of `push(text)`, with the same deadlines; whatever runs next releases the held
    cuts too, so nothing is lost or reordered however the session orders its calls."""
    rng = random.Random(7)
    texts = [path.read_text() for path in DATA] + [
        "".join(rng.choice(PIECES) + rng.choice(["", " "]) for _ in range(rng.randint(5, 60))) for _ in range(30)]
    for i, text in enumerate(texts):
        config = [ChunkingConfig(), ChunkingConfig(min_chars=1, first_chars=5, max_chars=40),
                  ChunkingConfig(schedule=(30, 50), max_chars=60)][i % 3]
        for mode in ("auto", "off"):
            for queued_ms in (0.0, 5000.0):
                whole, held = (Segmenter(config, clock=FakeClock(), normalize=mode) for _ in range(2))
                for s in (whole, held):
                    s.set_queued_audio_ms(queued_ms)
                expected = whole.push(text)
                first = held.push(text, limit=1)
                assert len(first) == min(1, len(expected))
                assert held.release() == expected[1:] and held.release() == []
                assert (held.pending_text, held.next_deadline()) == (whole.pending_text, whole.next_deadline())
                assert held.end() == whole.end()
                # the held cuts come out of whichever call comes next, ahead of its own
                direct = Segmenter(config, clock=FakeClock(), normalize=mode)
                direct.set_queued_audio_ms(queued_ms)
                assert direct.push(text, limit=1) + direct.end() == whole.segments
