"""The segmenter releases exactly what main's did, call by call, over tests/segmenter_cases.py's corpus (texts,
splits, configs, modes, clock and queued audio): its reference, tests/data/segments.json.gz, was recorded from main's
code by tests/data/record_segments.py, so a change that makes cutting cheaper cannot change a single segment."""

import gzip
import json
from itertools import zip_longest
from pathlib import Path

from segmenter_cases import traces

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
