"""gateway.playout_model: the playout model that paces a turn's audio, driven with plain times (no sockets, no
asyncio): the lead limit, the pacing quantum, playback.position corrections, gap accounting, the engine's
buffered-audio hint and the figures of context.done."""

import math
import random

import pytest

from gateway.playout_model import PACE_QUANTUM_MS, REPORT_INTERVAL_S, Pace, Playout

FRAME_MS = 20
QUANTUM_FRAMES = int(PACE_QUANTUM_MS // FRAME_MS)


def sent_at(playout: Playout, frames: int, now: float) -> None:
    """Queue `frames` and write them at `now`, as the sender does."""
    playout.queued(frames)
    playout.sending(now)
    playout.sent(frames)


# ---------------------------------------------------------------------------------------------- before the first audio

def test_before_the_first_audio_everything_may_go_and_nothing_is_played():
    playout = Playout(max_lead_ms=300.0, frame_ms=FRAME_MS)
    playout.queued(50)
    assert playout.room_ms(5.0) == math.inf
    assert playout.pace(50, 5.0) == Pace(50)
    assert playout.fits(50, 5.0)
    assert playout.played_ms(5.0) == 0.0
    assert playout.buffered_ms(5.0) == 50 * FRAME_MS  # all of it still here


def test_the_first_write_starts_the_playout_in_real_time_capped_at_what_was_sent():
    playout = Playout(max_lead_ms=1500.0, frame_ms=FRAME_MS)
    playout.queued(10)
    assert playout.sending(2.0).first_audio
    playout.sent(10)
    assert playout.first_audio_at == 2.0
    assert playout.played_ms(2.0) == 0.0
    assert playout.played_ms(2.05) == pytest.approx(50.0)
    assert playout.buffered_ms(2.05) == pytest.approx(150.0)
    assert playout.played_ms(3.0) == 200.0  # never past what was sent
    assert playout.buffered_ms(3.0) == 0.0
    assert not playout.sending(3.0).first_audio


# ---------------------------------------------------------------------------------------------- the lead limit

def test_the_lead_limit_holds_frames_until_the_quantum_fits():
    lead = 300.0
    playout = Playout(max_lead_ms=lead, frame_ms=FRAME_MS)
    sent_at(playout, int(lead // FRAME_MS), 0.0)  # the listener holds max_lead_ms
    assert playout.room_ms(0.0) == 0.0
    # one frame fits at once (frame 0 needs no room), but sending waits for a whole quantum
    assert playout.fits(1, 0.0) and not playout.fits(2, 0.0)
    wait = playout.pace(20, 0.0)
    assert wait.frames == 0
    assert wait.wait_s == pytest.approx((QUANTUM_FRAMES - 1) * FRAME_MS / 1000.0)
    # after that wait a quantum fits; later, as many frames as the room holds go, not just the quantum
    later = wait.wait_s
    assert playout.pace(20, later) == Pace(QUANTUM_FRAMES)
    assert playout.pace(20, later + 0.1) == Pace(13)  # 240 ms of room: frames 0..12 start within it
    assert playout.pace(20, 1.0) == Pace(16)  # all played: 300 ms of room, frames 0..15
    # with room for all of them, everything waiting goes in one write
    assert playout.pace(10, 1.0) == Pace(10)


def test_a_batch_smaller_than_the_quantum_waits_only_until_it_fits():
    playout = Playout(max_lead_ms=200.0, frame_ms=FRAME_MS)
    sent_at(playout, 10, 0.0)
    wait = playout.pace(3, 0.0)
    assert wait.frames == 0 and wait.wait_s == pytest.approx(2 * FRAME_MS / 1000.0)  # 3 frames, not a quantum
    assert playout.pace(3, wait.wait_s) == Pace(3)


def test_frames_longer_than_the_quantum_go_one_at_a_time():
    frame_ms = 200
    playout = Playout(max_lead_ms=400.0, frame_ms=frame_ms)
    sent_at(playout, 2, 0.0)
    assert playout.pace(5, 0.0) == Pace(1)  # frame 0 needs no room
    playout.sending(0.0)
    playout.sent(1)
    wait = playout.pace(4, 0.0)
    assert wait.frames == 0 and wait.wait_s == pytest.approx(0.2)


def test_no_lead_limit_sends_everything_at_once():
    playout = Playout(max_lead_ms=math.inf, frame_ms=FRAME_MS)
    sent_at(playout, 1000, 0.0)
    assert playout.pace(500, 0.0) == Pace(500)
    assert playout.fits(500, 0.0)


def test_pacing_nothing_is_refused():
    with pytest.raises(ValueError, match="available"):
        Playout(max_lead_ms=300.0, frame_ms=FRAME_MS).pace(0, 0.0)


def test_fits_agrees_with_pace():
    rng = random.Random(7)
    for _ in range(200):
        playout = Playout(max_lead_ms=rng.choice([100.0, 500.0, 1500.0]), frame_ms=rng.choice([10, 20, 60]))
        now = 0.0
        for _ in range(rng.randint(0, 5)):
            now += rng.uniform(0.0, 0.3)
            sent_at(playout, rng.randint(1, 20), now)
        if rng.random() < 0.5:
            playout.position(rng.uniform(0.0, playout.sent_ms * 1.2), now)
        now += rng.uniform(0.0, 0.3)
        n = rng.randint(1, 30)
        pace = playout.pace(n, now)
        assert playout.fits(n, now) == (pace.frames == n)
        assert 0 <= pace.frames <= n and (pace.frames > 0) == (pace.wait_s == 0.0)
        # what pace lets go fits
        assert pace.frames == 0 or playout.fits(pace.frames, now)


# ---------------------------------------------------------------------------------------------- position reports

def test_a_client_behind_the_estimate_gets_more_buffered_and_less_room():
    playout = Playout(max_lead_ms=500.0, frame_ms=FRAME_MS)
    sent_at(playout, 25, 0.0)  # 500 ms
    assert playout.played_ms(0.3) == pytest.approx(300.0)
    playout.position(100.0, 0.3)  # its player started late: it has played 100 ms, not 300
    assert playout.client_reported
    assert playout.played_ms(0.3) == 100.0
    assert playout.buffered_ms(0.3) == 400.0
    assert playout.room_ms(0.3) == 100.0  # 300 ms would fit by the estimate
    assert playout.played_ms(0.4) == pytest.approx(200.0)  # real time from the report on


def test_a_client_ahead_of_the_estimate_gets_room_sooner_and_never_past_what_was_sent():
    playout = Playout(max_lead_ms=500.0, frame_ms=FRAME_MS)
    sent_at(playout, 25, 0.0)
    playout.position(400.0, 0.1)  # ahead of the estimate (100 ms)
    assert playout.room_ms(0.1) == 400.0
    assert playout.pace(20, 0.1) == Pace(20)  # 400 ms fit: 19 * 20 <= 400
    playout.position(10_000.0, 0.2)  # more than was ever sent: capped
    assert playout.played_ms(0.2) == 500.0 and playout.played_ms(9.0) == 500.0
    assert playout.buffered_ms(0.2) == 0.0


# ---------------------------------------------------------------------------------------------- gaps

def test_a_late_chunk_is_a_gap_and_the_playout_resumes_when_it_arrives():
    playout = Playout(max_lead_ms=1500.0, frame_ms=FRAME_MS)
    sent_at(playout, 5, 0.0)  # 100 ms: the listener runs dry at 0.1
    playout.queued(5)
    start = playout.sending(0.25)
    assert not start.first_audio and start.gap_ms == pytest.approx(150.0)
    playout.sent(5)
    assert playout.max_gap_ms == pytest.approx(150.0)
    assert playout.played_ms(0.25) == 100.0  # playout restarts with this write
    assert playout.played_ms(0.3) == pytest.approx(150.0)
    sent_at(playout, 1, 0.3)  # on time (the listener still has 50 ms): no gap, the model is not re-anchored
    assert playout.max_gap_ms == pytest.approx(150.0)
    assert playout.played_ms(0.3) == pytest.approx(150.0)


def test_a_write_exactly_when_the_listener_runs_dry_is_no_gap():
    playout = Playout(max_lead_ms=1500.0, frame_ms=FRAME_MS)
    sent_at(playout, 8, 1.0)
    assert playout.sending(1.0 + 8 * FRAME_MS / 1000.0).gap_ms == 0.0
    assert playout.max_gap_ms == 0.0


def test_after_a_flush_drains_waiting_for_the_clients_text_is_no_gap():
    playout = Playout(max_lead_ms=1500.0, frame_ms=FRAME_MS)
    sent_at(playout, 10, 0.0)  # the flush's audio: the listener drains it by 0.2
    # the client's next text releases a segment at 1.0; its first audio leaves at 1.12: only 120 ms is the server's
    playout.segment_released(1.0)
    playout.queued(8)
    start = playout.sending(1.12)
    assert start.gap_ms == pytest.approx(120.0)
    playout.sent(8)
    # a chunk late inside the segment counts from when the listener ran dry
    sent_at(playout, 8, 1.5)  # dry at 1.28 (released long before): 220 ms
    assert playout.max_gap_ms == pytest.approx(220.0)
    playout.segment_released(3.0)
    playout.queued(1)
    assert playout.sending(2.9).gap_ms == 0.0  # released after the write started: never negative
    assert playout.played_ms(2.9) == playout.sent_ms  # re-anchored all the same: the listener restarts here


# ---------------------------------------------------------------------------------------------- the buffered hint

def test_the_buffered_hint_goes_every_report_interval_or_when_forced():
    playout = Playout(max_lead_ms=1500.0, frame_ms=FRAME_MS)
    playout.queued(30)
    playout.sending(1.0)
    playout.sent(20)  # 400 ms sent, 200 ms still here
    assert playout.report(1.0) == 600.0
    assert playout.report(1.0 + REPORT_INTERVAL_S / 2) is None  # too soon
    playout.position(0.0, 1.05)  # the client has not started playing yet
    assert playout.report(1.05, force=True) == 600.0
    assert playout.report(1.05 + REPORT_INTERVAL_S / 2) is None  # the forced one counts as the latest
    assert playout.report(1.05 + REPORT_INTERVAL_S) == pytest.approx(600.0 - REPORT_INTERVAL_S * 1000.0)


# ---------------------------------------------------------------------------------------------- context.done

def test_figures_of_a_finished_turn():
    playout = Playout(max_lead_ms=1500.0, frame_ms=FRAME_MS)
    sent_at(playout, 10, 10.25)  # first text at 10.0
    sent_at(playout, 40, 10.5)  # 50 ms late
    figures = playout.figures(first_text_at=10.0, engine_s=0.3)
    assert figures.audio_ms == 1000.0
    assert figures.ttfb_ms == pytest.approx(250.0)
    assert figures.rtf == pytest.approx(0.3)
    assert figures.max_gap_ms == pytest.approx(50.0)


def test_figures_of_a_turn_without_audio():
    figures = Playout(max_lead_ms=1500.0, frame_ms=FRAME_MS).figures(first_text_at=1.0, engine_s=0.2)
    assert figures.audio_ms == 0.0 and figures.ttfb_ms is None and figures.rtf is None and figures.max_gap_ms == 0.0


# ---------------------------------------------------------------------------------------------- a whole turn

def run_turn(lead_ms: float, chunk_frames: int, period_s: float, chunks: int) -> tuple[Playout, list[float]]:
    """The sender's loop on a fake clock: the engine delivers a chunk every `period_s`; each is written as pacing
    allows (sleeping for `Pace.wait_s`). Returns the model and the listener's lead after each write."""
    playout = Playout(max_lead_ms=lead_ms, frame_ms=FRAME_MS)
    now, leads = 0.0, []
    for k in range(chunks):
        now = max(now, k * period_s)  # the chunk has arrived
        playout.queued(chunk_frames)
        done = 0
        while done < chunk_frames:
            pace = playout.pace(chunk_frames - done, now)
            if not pace.frames:
                now += pace.wait_s
                continue
            playout.sending(now)
            playout.sent(pace.frames)
            done += pace.frames
            leads.append(playout.sent_ms - playout.played_ms(now))
    return playout, leads


def test_an_engine_faster_than_real_time_is_held_at_the_lead_limit():
    lead = 500.0
    playout, leads = run_turn(lead, chunk_frames=8, period_s=0.02, chunks=40)  # 8x real time
    assert playout.sent_ms == 40 * 8 * FRAME_MS and playout.queued_ms == 0.0
    assert max(leads) <= lead + FRAME_MS  # a write fits frame k when k * frame_ms <= room
    assert max(leads) >= lead  # and it runs all the way up to the limit
    assert playout.max_gap_ms == 0.0


def test_an_engine_slower_than_real_time_leaves_a_gap_per_chunk():
    playout, _ = run_turn(1500.0, chunk_frames=8, period_s=0.2, chunks=5)  # 160 ms of audio every 200 ms
    assert playout.max_gap_ms == pytest.approx(40.0)
    assert playout.figures(0.0, engine_s=1.0).rtf == pytest.approx(1.0 / 0.8)
