"""Sending a turn's audio paced against the client's playout: the asyncio shell (the frame queue, sleeps, sends,
metrics) around the turn's `gateway.playout_model.Playout`, which makes every decision (how much may go now, how
long to wait, gaps, the engine's buffered-audio hint, the figures of `context.done`). `TurnSender` is a part of
`Session`."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from gateway import protocol as p
from gateway.metrics import GatewayMetrics
from gateway.turn import SessionClosed, Turn, _EndMark, _FlushMark, _Packets, _SegmentMark
from gateway.turn_report import _round

log = logging.getLogger("voxgate.session")


class TurnSender:
    """The sending of a `Session`'s turns (it mixes this in): paced writes of a turn's audio and marks, from its
    synthesis task while nothing waits, else from its sender task."""

    # the Session's attributes these methods use
    engine: Any
    clock: Callable[[], float]
    metrics: GatewayMetrics
    id: str
    closed: bool
    _unannounced: deque[Turn]
    _audio_now: Callable[[p.AudioPackets], bool] | None
    _turn_failed: Callable[[Turn, str], None]

    async def _hand_over(self, turn: Turn, item: _Packets | _SegmentMark | _FlushMark | _EndMark) -> None:
        """The synthesis task's next item for the listener, in order. With nothing waiting ahead of it and room at the
        client, it is sent from here: no queue hop nor sender wakeup per chunk and mark, and under a burst each turn's
        audio leaves right after its own encoding instead of after every turn's. Otherwise it queues for the sender
        task, started the first time an item has to wait (a turn whose audio never outruns its listener has none).
        Only the synthesis task hands items over, so nothing can slip in between."""
        frames = turn.frames
        if not turn.sending and (frames is None or frames.empty()):
            if type(item) is _Packets:
                now = self.clock()
                if turn.playout.fits(len(item.payloads), now):  # all of it may go now: one write
                    turn.sending = True
                    try:
                        await self._write(turn, item.payloads, item.last, now)
                    finally:
                        turn.sending = False
                    return
            else:
                turn.sending = True
                try:
                    await self._deliver(turn, item)
                finally:
                    turn.sending = False
                return
        if frames is None:
            frames = turn.frames = asyncio.Queue(turn.pipeline_chunks)
            turn.tasks.append(asyncio.create_task(self._send_audio(turn, frames)))
        await frames.put(item)

    async def _send_audio(self, turn: Turn, frames: asyncio.Queue) -> None:
        """Paced sending: never more than max_lead_ms ahead of the client's playout."""
        try:
            while True:
                turn.sending = False
                item = await frames.get()
                turn.sending = True
                await self._deliver(turn, item)
                if type(item) is _EndMark:
                    return
        except SessionClosed:
            pass
        except Exception:  # a bug here must not leave the client waiting for audio that never comes
            self._turn_failed(turn, "sending")

    async def _deliver(self, turn: Turn, item: _Packets | _SegmentMark | _FlushMark | _EndMark) -> None:
        """Send one item: a batch of frames (paced), a segment's or a flush's message, or the turn's end."""
        if type(item) is _Packets:
            await self._send_packets(turn, item)
        elif type(item) is _SegmentMark:
            turn.playout.segment_released(item.released_at)
            await self._send(p.SegmentStarted(turn.id, item.segment.index, item.segment.shown(),
                                              round(item.pts_ms, 1)))
        elif type(item) is _FlushMark:
            await self._send(p.TextFlushed(turn.id, item.flush_id, round(turn.playout.sent_ms, 1)))
        else:
            await self._finish_turn(turn)

    async def _send_packets(self, turn: Turn, item: _Packets) -> None:
        """A batch of frames, in as few writes as pacing allows (usually one)."""
        payloads, total = item.payloads, len(item.payloads)
        done = 0
        while done < total:
            n = await self._pace(turn, total - done)
            part = payloads if n == total else payloads[done:done + n]
            done += n
            await self._write(turn, part, item.last and done == total)

    async def _write(self, turn: Turn, payloads: list[bytes], last: bool, now: float | None = None) -> None:
        """One write of frames that may go now (`now`: the clock read that decided so)."""
        packets = self._packets(turn, payloads, last)
        self._track_playout(turn, self.clock() if now is None else now)
        await self._send_audio_packets(packets)
        self._sent(turn, len(payloads))

    def write_now(self, turn: Turn, payloads: list[bytes], now: float) -> bool:
        """The turn's next frames (not its last) written at once, outside any task, if nothing of the turn waits to
        be sent before them and the client takes them without waiting (True); else nothing is done (False). A turn's
        first frame goes out this way where its encoder's answer is read (`TurnPipeline._head_answered`)."""
        frames = turn.frames
        if (self._audio_now is None or self.closed or self._unannounced or turn.sending
                or (frames is not None and not frames.empty()) or not turn.playout.fits(len(payloads), now)):
            return False
        if not self._audio_now(self._packets(turn, payloads, False)):
            return False
        turn.playout.queued(len(payloads))
        self._track_playout(turn, now)
        self._sent(turn, len(payloads))
        return True

    @staticmethod
    def _packets(turn: Turn, payloads: list[bytes], last: bool) -> p.AudioPackets:
        fmt = turn.fmt
        return p.AudioPackets(turn.id, turn.index, fmt.kind, turn.seq, turn.playout.sent_ms, fmt.frame_ms, payloads,
                              last)

    def _sent(self, turn: Turn, n: int) -> None:
        turn.seq += n
        turn.playout.sent(n)
        self._report_buffered(turn)

    async def _pace(self, turn: Turn, available: int) -> int:
        """How many of the next `available` frames may go now, sleeping while the model says none may."""
        while True:
            pace = turn.playout.pace(available, self.clock())
            if pace.frames:
                return pace.frames
            await asyncio.sleep(pace.wait_s)

    def _track_playout(self, turn: Turn, now: float) -> None:
        """A write starts at `now`: the model's playout (re)starts, and its TTFB or gap goes to the metrics."""
        start = turn.playout.sending(now)
        if start.first_audio and turn.t_first_text is not None:
            self.metrics.ttfb.observe(now - turn.t_first_text)
        if start.gap_ms > 0:
            self.metrics.gap.observe(start.gap_ms / 1000.0)

    def _report_buffered(self, turn: Turn, force: bool = False) -> None:
        if turn.request_id is None:
            return
        buffered = turn.playout.report(self.clock(), force)
        if buffered is None:
            return
        turn.segmenter.set_queued_audio_ms(buffered)
        try:  # a try costs nothing until it catches; a suppress context per report does (this runs per chunk)
            self.engine.update_buffered(turn.request_id, buffered)
        except Exception:  # advisory: the scheduler's hint must never break a turn
            log.debug("session %s context %s: buffered-audio report failed", self.id, turn.id, exc_info=True)

    async def _finish_turn(self, turn: Turn) -> None:
        """The turn's last frame is out: from the synthesis task (an idle sender task is stopped), or from the sender
        task once the synthesis task has returned."""
        self._stop_timer(turn)
        for task in turn.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        figures = turn.playout.figures(turn.t_first_text, turn.engine_s)
        if figures.rtf is not None:
            self.metrics.rtf.observe(figures.rtf)
        later = turn.later_ttfb_ms
        metrics = {"ttfb_ms": _round(figures.ttfb_ms), "engine_ttfb_ms": _round(turn.engine_ttfb_ms),
                   "rtf": _round(figures.rtf, 4), "max_gap_ms": round(figures.max_gap_ms, 1),
                   "text_queued_ms": _round(turn.text_queued_ms), "chunk_queued_ms": _round(turn.chunk_queued_ms, 2),
                   "segments": len(turn.audio),
                   "later_segment_engine_ttfb_ms": _round(sum(later) / len(later)) if later else None,
                   "segment_log": [t.to_dict() for t in turn.segment_log]}
        if turn.first_encode_ms is not None:  # its first frame went through an offloaded encoder (Opus)
            metrics["first_encode_ms"] = _round(turn.first_encode_ms, 2)
        if turn.link_ms is not None:  # a front process's turn: the engine is in the host (`gateway.link`)
            metrics["link_ms"] = _round(turn.link_ms, 2)
            metrics["link_request_ms"] = _round(turn.link_request_ms, 2)
        self._retire(turn)
        self.metrics.turns_done.labels(outcome="done").inc()
        await self._send(p.ContextDone(turn.id, round(figures.audio_ms, 1), metrics))
