"""bench/encode_hop.py --pattern steps, a new turn's first frame through a busy encoder process: every head of every
step is timed, and every stream's chunk is either answered or counted late; --pattern burst-heads: every head of the
burst and of the later turns is timed, and every first chunk."""

import asyncio
import json

import pytest

from bench import encode_hop

pytestmark = pytest.mark.timeout(60)


def test_every_head_is_timed_and_every_chunk_answered_or_late(tmp_path):
    out = tmp_path / "steps.json"
    steps, turns, heads = 4, 3, 2
    asyncio.run(encode_hop.main(["--pattern", "steps", "--turns", str(turns), "--heads", str(heads), "--steps",
                                 str(steps), "--step-ms", "20", "--spread-ms", "5", "--repeats", "2", "--json",
                                 str(out)]))
    report = json.loads(out.read_text())
    assert report["command"].startswith("python bench/encode_hop.py --pattern steps") and len(report["runs"]) == 2
    assert report["chunk_encode_ms"] > 0 and report["head_encode_ms"] > 0
    for run in report["runs"]:
        assert run["heads"] == steps * heads
        assert run["chunks"] + run["late_chunks"] == steps * turns
        assert 0 < run["head_ms"]["p50"] <= run["head_ms"]["p90"] <= run["head_ms"]["max"]


def test_burst_heads_times_every_head_and_first_chunk(tmp_path):
    out = tmp_path / "burst.json"
    turns, later = 4, 2
    asyncio.run(encode_hop.main(["--pattern", "burst-heads", "--turns", str(turns), "--later-heads", str(later),
                                 "--later-ms", "5", "--repeats", "2", "--json", str(out)]))
    report = json.loads(out.read_text())
    assert report["pattern"] == "burst-heads" and len(report["runs"]) == 2
    for run in report["runs"]:
        assert run["heads"] == turns + later
        for figure in ("head_ms", "later_head_ms", "first_chunk_ms"):
            assert 0 < run[figure]["p50"] <= run[figure]["p90"] <= run[figure]["max"]
        assert run["first_chunk_ms"]["max"] >= run["head_ms"]["max"]  # a turn's first chunk ends after its head
