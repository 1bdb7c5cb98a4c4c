"""The segmenter releases exactly what main's did, call by call, over tests/segmenter_cases.py's corpus (texts,
splits, configs, modes, clock and queued audio): its reference, tests/data/segments.json.gz, was recorded from main's
code by tests/data/record_segments.py, so a change that makes cutting cheaper cannot change a single segment (one
meant to change segments records the reference again, from its own code, and says so)."""

import gzip
import json
import random
from itertools import zip_longest
from pathlib import Path

from segmenter_cases import texts, traces

from gateway.text.boundaries import BoundaryScan

RECORDED = Path(__file__).parent / "data" / "segments.json.gz"


def test_every_case_releases_the_recorded_segments_call_by_call():
    with gzip.open(RECORDED, "rt", encoding="utf-8") as f:
        recorded = json.load(f)["cases"]
    now = json.loads(json.dumps(traces(), ensure_ascii=False))  # tuples and floats as the recording holds them
    assert now.keys() == recorded.keys()
    assert len(now) > 2000
    differ = [name for name in now if now[name] != recorded[name]]
    if differ:
        name = differ[0]
        first = next(i for i, (a, b) in enumerate(zip_longest(now[name], recorded[name])) if a != b)
        raise AssertionError(f"{len(differ)} of {len(now)} cases differ, e.g. {name} at event {first}: "
                             f"now {now[name][first:first + 2]}, recorded {recorded[name][first:first + 2]}")


def test_a_scan_extended_piece_by_piece_finds_what_a_fresh_scan_of_the_same_text_finds():
    """`BoundaryScan` resumes where the text ran out: every prefix of a text, scanned on from the previous prefix's
    scan, gives the boundaries (all of them, or from a word position on) and the last ones a new scan of it gives."""
    rng = random.Random(7)
    for text in texts():
        for normalizing in (False, True):
            grown = BoundaryScan(line_start=True, normalizing=normalizing)
            cuts = sorted(rng.sample(range(1, len(text) + 1), min(len(text), 24)))
            for end in cuts:
                prefix = text[:end]
                fresh = BoundaryScan(line_start=True, normalizing=normalizing)
                words_from = rng.randrange(end + 2)
                assert list(grown.boundaries(prefix, words_from)) == list(fresh.boundaries(prefix, words_from))
                assert list(grown.boundaries(prefix)) == list(BoundaryScan(True, normalizing).boundaries(prefix))
                lo, hi = sorted(rng.randrange(end + 1) for _ in range(2))
                last = BoundaryScan(line_start=True, normalizing=normalizing).last_boundary(prefix, lo, hi)
                assert grown.last_boundary(prefix, lo, hi) == last
