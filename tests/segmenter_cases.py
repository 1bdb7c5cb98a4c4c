"""A fixed, seeded corpus of turns through the segmenter, driven as a session drives it, and what it releases.

`traces()` runs every case through `gateway.text.segmenter.Segmenter` (whichever one is imported: the checkout's, or
main's when tests/data/record_segments.py records the reference) and returns, per case, every call's released
segments (text, reason, index, language) and the deadline the segment timer then reads.
The corpus: bench/gateway_load.py's paragraphs, the LLM stream fixtures, the normalisation corpus in turns of eight
lines, the segmenter tests' sentence cases and units, and random texts of the segmenter tests' pieces; each sent
whole, in LLM deltas of 1-6 words, in 1-4 character pieces and (short ones) character by character; with
normalisation off and auto, under four chunking configs, with the clock, the queued audio, timer polls and flushes
varied by a seeded RNG.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from bench.gateway_load import TEXTS, llm_deltas
from gateway.text.segmenter import ChunkingConfig, Segment, Segmenter

DATA = Path(__file__).parent / "data"
PIECES = [  # tests/test_segmenter.py's, and a few of the normaliser's units
    "Hello", "world", "3.14", "$1,000.50", "Dr.", "Mr. Smith", "e.g.", "U.S.", "etc.", "J. R. R.", "Tolkien", "...",
    "…", "(see Fig. 2)", '"Stop."', "she said", "example.com/a.b", "mail@x.org", "**bold**", "`code`",
    "[link](http://a.b/c)", "![img](x.png)", "# ", "- ", "1. ", "\n", "\n\n", " ", "  ", ",", ";", ":", "!", "?", ".",
    "—", " - ", "🎉", "👍🏽", "你好", "世界", "。", "，", "！", "？", "“引号”", "《书名》", "Python", "3.", "14",
    "__init__", "snake_case", "C#", "3:45 PM", "March 5, 1990", "{HH AH0 L OW1}", "2026年12月3日", "(a, b)", "no. 5",
]
SENTENCES = [  # tests/test_segmenter.py's sentence cases
    "It costs 3.14 dollars. Then we left.", "The price is $1,000.50, not less. Buy now.",
    "Dr. Smith and Mr. Jones arrived. They sat.", "J. R. R. Tolkien wrote it. Read it.",
    "Eat fruit, e.g. Apples or pears. Also nuts.", '"Stop." she said. He stopped.', 'He said "Stop." Then he left.',
    "Wait... what happened? Nothing!", "See example.com/docs.html today. Or mail a.b@c.org now.",
    "It is shown in Fig. 3 below. (Really. It is.) Next.", "Steps:\n1. Mix the flour.\n2. Bake it.",
    "Version 2.0 is out! Get it at 10:30 today.", "你好。我很好！你呢？", "他说：“好的。”然后走了。",
    "我喜欢Python。It is great.", "\n# Title\n**Bold** claim. [Docs](https://x.io/a.b). Done",
    "Intro sentence here. We walked home, then we ate dinner; it was late. And",
]
UNITS = ["$1,000.50", "3:45 PM", "2026-12-03", "3.5%", "March 5, 1990", "1,200 km", "{HH AH0 L OW1}", "{ni3}",
         "2026年12月3日"]
LEADS = ("Well then here it is", "So the total we want", "Okay", "那么我们来看看吧这个是")
CONFIGS = [ChunkingConfig(), ChunkingConfig(min_chars=1, first_chars=5, max_chars=40),
           ChunkingConfig(schedule=(30, 50), max_chars=60), ChunkingConfig(max_chars=50, max_delay_ms=0)]
MODES = ("off", "auto")
QUEUED_MS = (0.0, 0.0, 400.0, 1500.0, 5000.0)
EACH_MAX_CHARS = 160  # longer texts are not also sent character by character (1-4 character pieces cover them)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def texts() -> list[str]:
    rng = random.Random(34)
    corpus = [(DATA / f"normalize_corpus_{name}.txt").read_text().splitlines() for name in ("en", "zh")]
    return [*TEXTS, *(p.read_text() for p in sorted(DATA.glob("llm_stream_*.txt"))),
            *("\n".join(lines[i:i + 8]) for lines in corpus for i in range(0, len(lines), 8)), *SENTENCES,
            *(f"{lead} {unit} and that is all for today" for unit in UNITS for lead in LEADS),
            *("".join(rng.choice(PIECES) + rng.choice(["", " ", " ", ""]) for _ in range(rng.randint(1, 80)))
              for _ in range(40))]


def splits(text: str, rng: random.Random) -> dict[str, list[str]]:
    """The ways a turn's text arrives: whole, LLM deltas of 1-6 words, 1-4 character pieces, and (a short text)
    character by character."""
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 4)
        pieces.append(text[i:i + n])
        i += n
    ways = {"whole": [text], "words": llm_deltas(text, rng, (1, 6)), "chars": pieces}
    return ways | {"each": list(text)} if len(text) <= EACH_MAX_CHARS else ways


def _seen(segments: list[Segment]) -> list[list[Any]]:
    return [[s.text, s.reason, s.index, s.lang] for s in segments]


def drive(pieces: list[str], config: ChunkingConfig, mode: str, rng: random.Random) -> list[list[Any]]:
    """One turn, as a session drives its segmenter: the first text held to one segment and the rest released after
    (`push(limit=1)` + `release`), the queued audio set before each text, the timer's deadline read after it and
    polled when due (the clock jumping there, or not), an occasional flush, then the end. The outcome of every call
    that released something or moved the deadline, with the number of the text it followed."""
    clock = FakeClock()
    segmenter = Segmenter(config, clock=clock, normalize=mode)
    trace: list[list[Any]] = []
    last: list[float | None] = [None]

    def note(step: int, op: str, segments: list[Segment]) -> None:
        deadline = segmenter.next_deadline()
        if segments or deadline != last[0]:
            trace.append([step, op, _seen(segments), deadline])
        last[0] = deadline

    for step, piece in enumerate(pieces):
        clock.now += rng.choice((0.0, 0.01, 0.05, 0.3))
        segmenter.set_queued_audio_ms(rng.choice(QUEUED_MS))
        first = not segmenter.segments
        note(step, "push", segmenter.push(piece, limit=1 if first else None))
        if first:
            note(step, "release", segmenter.release())
        jump, flush = rng.random() < 0.4, rng.random() < 0.03
        deadline = last[0]
        if deadline is not None and jump:
            clock.now = max(clock.now, deadline)
            note(step, "poll", segmenter.poll())
        if flush:
            note(step, "flush", segmenter.flush())
    note(len(pieces), "end", segmenter.end())
    trace.append(["left", segmenter.buffered_chars])
    return trace


def whole_turn(text: str, config: ChunkingConfig, mode: str, said: bool) -> list[list[Any]]:
    """The turn in one push and its end, no clock: the plain segment sequence; `said`: with what each is spoken as
    (`Segment.speak`, normalised sentence by sentence)."""
    segmenter = Segmenter(config, clock=FakeClock(), normalize=mode)
    segments = segmenter.push(text) + segmenter.end()
    return [[*seen, s.speak()] if said else seen for seen, s in zip(_seen(segments), segments, strict=True)]


def traces() -> dict[str, list[list[Any]]]:
    """Every case's trace, by case name (text number, split, mode, config number)."""
    out: dict[str, list[list[Any]]] = {}
    for t, text in enumerate(texts()):
        rng = random.Random(t)
        for mode in MODES:
            for c, config in enumerate(CONFIGS):
                out[f"{t}:plain:{mode}:{c}"] = whole_turn(text, config, mode, said=mode != "off" and c == 0)
            for name, pieces in splits(text, rng).items():
                c = rng.randrange(len(CONFIGS))
                out[f"{t}:{name}:{mode}:{c}"] = drive(pieces, CONFIGS[c], mode, rng)
    return out
