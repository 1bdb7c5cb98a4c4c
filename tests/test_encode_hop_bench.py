"""bench/encode_hop.py --pattern steps, a new turn's first frame through a busy encoder process: every head of every
step is timed, and every stream's chunk is either answered or counted late."""

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
