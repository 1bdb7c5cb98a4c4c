"""A turn's playout at the client, modelled from what the gateway sent. Sans-I/O: no asyncio, no clock of its own;
every event and question carries its time `now` (seconds on the caller's monotonic clock), so the model is driven
by plain numbers in tests and by `gateway.playout.TurnSender` in the server.

The listener is modelled as playing in real time from the turn's first audio, never past what was sent; each
`playback.position` report re-anchors the model on what the client says it played. From that model come every
pacing decision (how much may go now and how long to wait: never more than `max_lead_ms` ahead of the listener,
resuming in PACE_QUANTUM_MS steps), the silences the server caused (the listener ran dry while the audio was late,
not while the client's text was), the buffered-audio hint the engine's scheduler gets (every REPORT_INTERVAL_S) and
the figures `context.done` reports."""

from __future__ import annotations

import math
from dataclasses import dataclass

REPORT_INTERVAL_S = 0.1  # how often a turn tells the engine's scheduler how much audio its listener has queued
# Once the client holds max_lead_ms, sending resumes only when this much fits again, then goes out as one write:
# one wakeup per ~engine chunk (160 ms) per stream instead of one per 20 ms frame.
PACE_QUANTUM_MS = 160.0


@dataclass(frozen=True)
class Pace:
    """What may be sent now: `frames` of those waiting, or none (0) and `wait_s` until the quantum fits."""

    frames: int
    wait_s: float = 0.0


@dataclass(frozen=True)
class SendStart:
    """What starting a write tells: whether it carries the turn's first audio, and the silence (ms) the server
    caused before it (0.0 when the listener had audio, or was waiting for the client's text)."""

    first_audio: bool
    gap_ms: float = 0.0


# the answers of `Playout.sending` without a gap, made once (it answers every write of every turn)
_FIRST = SendStart(first_audio=True)
_PLAYING = SendStart(first_audio=False)


@dataclass(frozen=True)
class TurnFigures:
    """A finished turn's playout figures (unrounded): `context.done`'s audio_ms and metrics."""

    audio_ms: float  # audio sent
    ttfb_ms: float | None  # the turn's first text -> its first audio sent
    rtf: float | None  # engine time per second of audio sent
    max_gap_ms: float  # the longest silence the server caused


class Playout:
    """One turn's audio from the encoder to the listener's ears. Events: `queued`, `sending`/`sent`, `position`,
    `segment_released`; questions: `played_ms`, `buffered_ms`, `room_ms`, `fits`, `pace`, `report`, `figures`."""

    def __init__(self, max_lead_ms: float, frame_ms: float):
        self.max_lead_ms = max_lead_ms  # audio sent ahead of the listener's playout (inf: no limit)
        self.frame_ms = frame_ms  # one frame of the turn's output format
        self.queued_ms = 0.0  # encoded, not yet sent
        self.sent_ms = 0.0
        # the listener's playout is real time from (t_play, play_base_ms), capped at what was sent
        self.t_play: float | None = None
        self.play_base_ms = 0.0
        self.client_reported = False  # a playback.position came: the playout is the client's, not an estimate
        self.first_audio_at: float | None = None
        self.max_gap_ms = 0.0
        self.segment_released_at = 0.0  # when the segment being sent left the segmenter
        self.reported_at = 0.0  # the last buffered-audio report to the engine

    # ------------------------------------------------------------------------------------------------ events

    def queued(self, frames: int) -> None:
        """Encoded frames are waiting to be sent."""
        self.queued_ms += frames * self.frame_ms

    def segment_released(self, at: float) -> None:
        """The segment whose audio comes next left the segmenter at `at`: the listener's wait for audio before
        then was a wait for the client's text, not a silence the server caused."""
        self.segment_released_at = at

    def sending(self, now: float) -> SendStart:
        """A write of queued frames starts: the turn's first one starts the playout; one after the listener ran dry
        restarts it (and the silence since then, if the server caused it, is a gap)."""
        if self.t_play is None:
            self.first_audio_at = now
            self.t_play, self.play_base_ms = now, 0.0
            return _FIRST
        dry_since = self.t_play + (self.sent_ms - self.play_base_ms) / 1000.0
        if now <= dry_since:
            return _PLAYING
        # only count silence the gateway caused, not time spent waiting for the client's text
        waited_from = max(dry_since, self.segment_released_at)
        gap_ms = max(0.0, (now - waited_from) * 1000.0)
        self.max_gap_ms = max(self.max_gap_ms, gap_ms)
        self.t_play, self.play_base_ms = now, self.sent_ms  # the listener resumes when this write arrives
        return SendStart(first_audio=False, gap_ms=gap_ms)

    def sent(self, frames: int) -> None:
        """A write of `frames` queued frames went out."""
        self.sent_ms += frames * self.frame_ms
        self.queued_ms -= frames * self.frame_ms

    def position(self, played_ms: float, now: float) -> None:
        """The client's playback.position: it has played `played_ms` of the turn (never more than was sent)."""
        self.play_base_ms = min(played_ms, self.sent_ms)
        self.t_play = now
        self.client_reported = True

    # ------------------------------------------------------------------------------------------------ questions

    def played_ms(self, now: float) -> float:
        """Audio the listener has played by `now`."""
        if self.t_play is None:
            return 0.0
        return min(self.sent_ms, self.play_base_ms + (now - self.t_play) * 1000.0)

    def buffered_ms(self, now: float) -> float:
        """Audio the listener has or will have before it runs dry: queued at the client plus queued here."""
        return self.sent_ms - self.played_ms(now) + self.queued_ms

    def room_ms(self, now: float) -> float:
        """How far sending may still run ahead of the listener; frame k (from 0) of what is waiting may go now if
        k * frame_ms <= this. inf before the turn's first audio (playout starts with it) or without a lead limit."""
        if self.t_play is None:
            return math.inf
        return self.max_lead_ms - (self.sent_ms - self.played_ms(now))

    def fits(self, frames: int, now: float) -> bool:
        """Whether all of `frames` waiting frames may go now."""
        return self.room_ms(now) >= (frames - 1) * self.frame_ms

    def pace(self, available: int, now: float) -> Pace:
        """How many of the next `available` (>= 1) frames may go now. With the listener max_lead_ms ahead, none
        until PACE_QUANTUM_MS (or all that is available) fits again: `wait_s` says when that is, if nothing else
        changes (a position report may bring it earlier or later: ask again after the wait)."""
        if available < 1:  # nothing to send would never be allowed to go: a caller's bug, not a wait
            raise ValueError(f"available: {available} frames, need at least 1")
        need = min(available, max(1, int(PACE_QUANTUM_MS // self.frame_ms)))
        room = self.room_ms(now)
        if room >= (available - 1) * self.frame_ms:
            return Pace(available)
        if room >= (need - 1) * self.frame_ms:
            return Pace(int(room // self.frame_ms) + 1)
        return Pace(0, ((need - 1) * self.frame_ms - room) / 1000.0)

    def report(self, now: float, force: bool = False) -> float | None:
        """The buffered audio (ms) to tell the engine's scheduler now, or None while the last report is younger than
        REPORT_INTERVAL_S (`force`: a position report changed the picture, tell it anyway)."""
        if not force and now - self.reported_at < REPORT_INTERVAL_S:
            return None
        self.reported_at = now
        return self.buffered_ms(now)

    def figures(self, first_text_at: float | None, engine_s: float) -> TurnFigures:
        """The turn's figures for `context.done`, given when its first text came and the time spent waiting for the
        engine."""
        audio_s = self.sent_ms / 1000.0
        ttfb = None
        if self.first_audio_at is not None and first_text_at is not None:
            ttfb = (self.first_audio_at - first_text_at) * 1000.0
        return TurnFigures(self.sent_ms, ttfb, engine_s / audio_s if audio_s > 0 else None, self.max_gap_ms)
