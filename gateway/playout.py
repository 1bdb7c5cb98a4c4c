"""Sending a turn's audio paced against the client's playout: the playout model (real time from the turn's first
audio, corrected by the client's playback.position), the lead limit, gaps, the engine's buffered-audio hint and the
turn's `context.done`. `TurnSender` is a part of `Session`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any

from gateway import protocol as p
from gateway.metrics import GatewayMetrics
from gateway.protocol import ErrorCode, ProtocolError
from gateway.turn import SessionClosed, Turn, _EndMark, _FlushMark, _Packets, _SegmentMark
from gateway.turn_report import _round

log = logging.getLogger("voxgate.session")

REPORT_INTERVAL_S = 0.1  # how often a turn tells the engine's scheduler how much audio its listener has queued
# Once the client holds max_lead_ms, sending resumes only when this much fits again, then goes out as one write:
# one wakeup per ~engine chunk (160 ms) per stream instead of one per 20 ms frame.
PACE_QUANTUM_MS = 160.0


class TurnSender:
    """The sender task of a `Session` (it mixes this in): paced writes of a turn's queued audio and marks."""

    # the Session's attributes these methods use
    engine: Any
    clock: Callable[[], float]
    metrics: GatewayMetrics
    id: str

    async def _send_audio(self, turn: Turn) -> None:
        """Paced sending: never more than max_lead_ms ahead of the client's playout."""
        try:
            await self._send_audio_loop(turn)
        except SessionClosed:
            pass
        except Exception:  # a bug here must not leave the client waiting for audio that never comes
            log.exception("session %s context %s: sending failed", self.id, turn.id)
            self._background(self._abort_turn(turn, ProtocolError(ErrorCode.INTERNAL_ERROR, "internal error",
                                                                  context_id=turn.id)))

    async def _send_audio_loop(self, turn: Turn) -> None:
        while True:
            turn.sending = False
            item = await turn.frames.get()
            turn.sending = True
            if isinstance(item, _Packets):
                await self._send_packets(turn, item)
            elif isinstance(item, _SegmentMark):
                turn.segment_released_at = item.released_at
                await self._send(p.SegmentStarted(turn.id, item.segment.index, item.segment.shown(),
                                                  round(item.pts_ms, 1)))
            elif isinstance(item, _FlushMark):
                await self._send(p.TextFlushed(turn.id, item.flush_id, round(turn.sent_ms, 1)))
            elif isinstance(item, _EndMark):
                await self._finish_turn(turn)
                return

    async def _send_packets(self, turn: Turn, item: _Packets) -> None:
        """A batch of frames, in as few writes as pacing allows (usually one)."""
        payloads, frame_ms = item.payloads, turn.fmt.frame_ms
        done = 0
        while done < len(payloads):
            n = await self._pace(turn, len(payloads) - done)
            self._track_playout(turn, self.clock())
            part = payloads[done:done + n]
            done += n
            await self._send_frames(p.pack_frames(turn.fmt.kind, turn.index, turn.seq, turn.sent_ms, frame_ms, part,
                                                  last=item.last and done == len(payloads)))
            turn.seq += n
            turn.sent_ms += n * frame_ms
            turn.queued_ms -= n * frame_ms
            self._report_buffered(turn)

    def _room_ms(self, turn: Turn) -> float:
        """How far sending may still run ahead of the client's playout; frame k (from 0) of what is waiting may go
        now if k * frame_ms <= this. inf before the turn's first audio (playout starts with it) or without a lead
        limit."""
        if turn.t_play is None:
            return math.inf
        return turn.max_lead_ms - (turn.sent_ms - turn.played_ms(self.clock()))

    def _fits_now(self, turn: Turn, frames: int) -> bool:
        return self._room_ms(turn) >= (frames - 1) * turn.fmt.frame_ms

    async def _pace(self, turn: Turn, available: int) -> int:
        """How many of the next `available` frames may go now, waiting while the client is max_lead_ms ahead;
        once it is, sending resumes when PACE_QUANTUM_MS (or all that is available) fits again."""
        frame_ms = turn.fmt.frame_ms
        need = min(available, max(1, int(PACE_QUANTUM_MS // frame_ms)))
        while True:
            room = self._room_ms(turn)
            if room >= (available - 1) * frame_ms:
                return available
            if room >= (need - 1) * frame_ms:
                return int(room // frame_ms) + 1
            await asyncio.sleep(((need - 1) * frame_ms - room) / 1000.0)

    def _track_playout(self, turn: Turn, now: float) -> None:
        if turn.t_play is None:  # first audio of the turn: playout starts now
            turn.t_first_audio = now
            turn.t_play, turn.play_base_ms = now, 0.0
            if turn.t_first_text is not None:
                self.metrics.ttfb.observe(now - turn.t_first_text)
            return
        dry_since = turn.t_play + (turn.sent_ms - turn.play_base_ms) / 1000.0
        if now > dry_since:  # the listener ran out of audio: playout resumes when this packet arrives
            # only count silence the gateway caused, not time spent waiting for the client's text
            waited_from = max(dry_since, turn.segment_released_at)
            gap_ms = max(0.0, (now - waited_from) * 1000.0)
            turn.max_gap_ms = max(turn.max_gap_ms, gap_ms)
            if gap_ms > 0:
                self.metrics.gap.observe(gap_ms / 1000.0)
            turn.t_play, turn.play_base_ms = now, turn.sent_ms

    def _report_buffered(self, turn: Turn, force: bool = False) -> None:
        now = self.clock()
        if turn.request_id is None or (not force and now - turn.reported_at < REPORT_INTERVAL_S):
            return
        turn.reported_at = now
        buffered = turn.buffered_ms(now)
        turn.segmenter.set_queued_audio_ms(buffered)
        with contextlib.suppress(Exception):  # advisory: the scheduler's hint must never break a turn
            self.engine.update_buffered(turn.request_id, buffered)

    async def _finish_turn(self, turn: Turn) -> None:
        for task in turn.tasks:
            if task is not asyncio.current_task():
                task.cancel()  # the segment timer; the synthesis task has already returned
        audio_s = turn.sent_ms / 1000.0
        rtf = turn.engine_s / audio_s if audio_s > 0 else None
        if rtf is not None:
            self.metrics.rtf.observe(rtf)
        ttfb = None
        if turn.t_first_audio is not None and turn.t_first_text is not None:
            ttfb = round((turn.t_first_audio - turn.t_first_text) * 1000.0, 1)
        later = turn.later_ttfb_ms
        metrics = {"ttfb_ms": ttfb, "engine_ttfb_ms": _round(turn.engine_ttfb_ms), "rtf": _round(rtf, 4),
                   "max_gap_ms": round(turn.max_gap_ms, 1), "segments": len(turn.audio),
                   "later_segment_engine_ttfb_ms": _round(sum(later) / len(later)) if later else None,
                   "segment_log": [t.to_dict() for t in turn.segment_log]}
        self._retire(turn)
        self.metrics.turns_done.labels(outcome="done").inc()
        await self._send(p.ContextDone(turn.id, round(turn.sent_ms, 1), metrics))
