"""bench/gateway_load.py, the end-to-end load benchmark of issue 34: its levels, its LLM deltas, and what it reports
when it drives the real gateway (its own process) over the paced stand-in engine, fast and slower than real time."""

import json
import random

import pytest

from bench import gateway_load
from bench.gateway_load import Level, llm_deltas, parse_levels, session_mode

pytestmark = pytest.mark.timeout(120)

SHORT_TEXTS = ["One two three. Four five six seven.", "Eight nine ten. Eleven twelve."]


def test_levels_parse_counts_patterns_and_modes():
    assert parse_levels("64,closed:400:mix,256:llm,256:whole:pcm_s16le") == [
        Level(64), Level(400, True, "mix"), Level(256, False, "llm"), Level(256, False, "whole", "pcm_s16le")]
    assert [level.name for level in parse_levels("64,closed:400:mix,8:pcm_s16le")] == ["64", "closed:400:mix",
                                                                                       "8:pcm_s16le"]
    for bad in ("closed", "64:loud", "0"):
        with pytest.raises(Exception, match="level"):
            parse_levels(bad)


def test_llm_deltas_are_the_text_in_groups_of_a_few_words():
    text = gateway_load.TEXTS[0]
    deltas = llm_deltas(text, random.Random(1), (2, 4))
    assert "".join(deltas) == text
    assert all(2 <= len(d.split()) <= 4 for d in deltas[:-1]) and 1 <= len(deltas[-1].split()) <= 4
    assert 50 <= len(text.split()) <= 70  # the issue's ~60-word paragraphs
    assert [session_mode("mix", i) for i in range(4)] == ["whole", "llm", "whole", "llm"]


def _run(tmp_path, monkeypatch, *args: str) -> dict:
    monkeypatch.setattr(gateway_load, "TEXTS", SHORT_TEXTS)  # the clients run in this process (no --client-procs)
    out = tmp_path / "load.json"
    code = gateway_load.main(["--spawn-server", "--engine", "paced", "--max-length", "2", "--start-delay", "1",
                              "--json", str(out), *args])
    doc = json.loads(out.read_text())
    assert code == 0, doc["results"]
    assert doc["git_commit"] and doc["date"] and "gateway_load.py" in doc["command"] and doc["machine"]["cpus"]
    return doc


def test_at_once_and_closed_loop_levels_report_the_issues_figures(tmp_path, monkeypatch):
    doc = _run(tmp_path, monkeypatch, "--tick-ms", "20", "--sessions", "2:mix,closed:2:whole:pcm_s16le", "--turns",
               "1", "--ramp", "0.3", "--duration", "0.8")
    at_once, closed = doc["results"]
    assert (at_once["format"], closed["format"]) == ("opus", "pcm_s16le")
    assert (at_once["level"], at_once["turns_counted"], at_once["errors"]) == ("2:mix", 2, 0)
    assert set(at_once["by_mode"]) == {"whole", "llm"}  # one session each way
    assert closed["closed_loop"] and closed["turns"] >= 2 and closed["errors"] == 0
    for r in (at_once, closed):
        assert r["ttfb_ms_p50"] >= r["engine_ttfb_ms_p50"] > 0
        assert r["server_overhead_ms_p50"] is not None and r["server_gap_ms_p99"] is not None
        assert r["gateway_cpu_ms_per_stream_s"] > 0 and r["gateway_loop_lag_ms"]["n"] > 0
        assert isinstance(r["late_frames"], int)


def test_an_engine_slower_than_real_time_shows_as_late_frames_and_server_gaps(tmp_path, monkeypatch):
    # a 160 ms patch every 320 ms: with no cushion, every chunk after the first comes ~160 ms after its play time
    doc = _run(tmp_path, monkeypatch, "--tick-ms", "320", "--sessions", "1:whole", "--turns", "1",
               "--cushion-ms", "0", "--no-warmup")
    (r,) = doc["results"]
    assert r["late_frames"] >= 2 and r["late_ms_total"] >= 200
    assert r["underrun_turns"] == 1 and r["server_gap_ms_max"] >= 100
