"""bench/loop_cost.py, the loop thread's CPU per turn and per chunk under a burst: it drives the real session core over
the paced stand-in engine and every turn of the burst gets its audio."""

import json

import pytest

from bench import loop_cost

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("fmt", ["pcm_s16le", "opus"])
def test_a_small_burst_reports_every_phase_and_every_turns_first_frame(tmp_path, fmt):
    out = tmp_path / "loop_cost.json"
    assert loop_cost.main(["--sessions", "4", "--format", fmt, "--runs", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    run = report["runs"][0]
    assert report["median"] == run and report["sessions"] == 4 and report["format"] == fmt
    for phase in ("handler_us_per_turn", "after_burst_us_per_turn", "first_chunk_us_per_turn",
                  "later_chunk_us_per_chunk"):
        assert run[phase] > 0, phase
    # every turn's first frame was written (the phase waits for all of them), and each later chunk is 160 ms of
    # 20 ms frames
    assert 0 < run["first_frame_ms_p50"] <= run["first_frame_ms_max"]
    assert run["later_frames_per_chunk"] == 8.0


def test_a_burst_over_the_link_runs_as_a_front(tmp_path):
    """--link: the sessions' engine is the real RemoteEngine, linked to an EngineHost child over the paced stand-in."""
    out = tmp_path / "loop_cost.json"
    assert loop_cost.main(["--sessions", "4", "--format", "pcm_s16le", "--runs", "1", "--link", "--segmenter",
                           "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    run = report["runs"][0]
    assert report["link"] is True
    assert 0 < run["first_frame_ms_p50"] <= run["first_frame_ms_max"] and run["later_frames_per_chunk"] == 8.0
    # the segmenter's share is a part of its phase's CPU
    assert 0 < run["handler_segmenter_us_per_turn"] < run["handler_us_per_turn"]
    assert 0 <= run["after_burst_segmenter_us_per_turn"] < run["after_burst_us_per_turn"]
