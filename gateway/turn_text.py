"""A turn's text through its segmenter, in message order: text.append, text.flush and context.end (`TextOp`s), and
the segments they release handed to the turn (`Session._release`). A new turn's first text.append cuts and starts only
its first segment; the rest of that text is cut in the loop's lane (`gateway.loop_lanes`: once no message read off a
socket waits for its handler), and text work of the turn's later messages (a context.end's cuts) queues behind it: in
a burst of new turns, each handler cuts one segment, not a paragraph, before the next turn's text is handled.
`TurnText` is a part of `Session`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from gateway.loop_lanes import lane
from gateway.text.segmenter import Segment
from gateway.turn import Turn, _EndMark, _FlushMark


@dataclass(frozen=True)
class TextOp:
    """A message's work on a turn's text: "push" (text.append: `arg` is its text), "flush" (text.flush: `arg` is
    its flush id) or "end" (context.end)."""

    kind: str
    arg: str | None = None


class TurnText:
    """The text work of a `Session`'s turns (it mixes this in)."""

    # the Session's attributes these methods use
    id: str
    closed: bool
    clock: Callable[[], float]
    _release: Callable[[Turn, list[Segment]], None]
    _turn_failed: Callable[[Turn, str], None]

    def _push_text(self, turn: Turn, text: str) -> None:
        """A text.append's text into the turn's segmenter. The turn's first segment goes to the engine right here;
        the rest of the text that released it is cut in the loop's lane, after the handlers of the messages waiting:
        in a burst of new turns, each handler cuts one segment, not a whole paragraph, before the next turn's text is
        handled."""
        first = not turn.segmenter.segments
        if not first:  # before its first segment a turn has no audio: the segmenter's queued audio is 0 already
            turn.segmenter.set_queued_audio_ms(turn.playout.buffered_ms(self.clock()))
        segments = turn.segmenter.push(text, limit=1 if first else None)
        self._release(turn, segments)  # a first segment's engine request leaves here
        if first and segments:
            # Exact: until the deferred cut runs, this turn's segmenter is touched by nothing but `_in_order` (which
            # queues behind it), and its listener's queued audio (which decides cuts) stays 0: the turn's synthesis
            # task starts from the lane after it (`Session._begin_turn`, deferred after it).
            turn.deferred = []
            lane().defer(self._cut_deferred, turn)

    def _cut_deferred(self, turn: Turn) -> None:
        """The cuts `_push_text` held back, then the turn's text work queued behind them, in order."""
        ops, turn.deferred = turn.deferred, None
        if ops is None:  # the turn was stopped meanwhile (`_stop_turn` settled its segmenter)
            return
        try:
            self._release(turn, turn.segmenter.release())
            for op in ops:
                self._text_op(turn, op)
            self._arm_timer(turn)
        except Exception:  # a bug here must not leave the turn waiting for segments that never come
            self._turn_failed(turn, "cutting its text")

    def _in_order(self, turn: Turn, op: TextOp) -> None:
        """Do `op` now (and re-read the segmenter's deadline), or after the cuts `_push_text` held back if they are
        pending."""
        if turn.deferred is None:
            self._text_op(turn, op)
            if turn.deferred is None:  # else the cuts it held back are pending: `_cut_deferred` arms it
                self._arm_timer(turn)
        else:
            turn.deferred.append(op)

    def _arm_timer(self, turn: Turn) -> None:
        """Time-based segment boundaries (the first segment leaves after max_delay_ms without a clause): a loop timer
        at the segmenter's next deadline, none while it has none or once the turn is ended. A timer handle, not a
        task per turn: most turns never need it, and re-arming it per text.append costs no task wakeup."""
        deadline = None if turn.ended or self.closed else turn.segmenter.next_deadline()
        if deadline == turn.timer_at and (deadline is None or turn.timer is not None):
            return
        self._stop_timer(turn)
        if deadline is not None:
            turn.timer_at = deadline
            turn.timer = asyncio.get_running_loop().call_later(max(0.0, deadline - self.clock()), self._on_deadline,
                                                               turn)

    def _stop_timer(self, turn: Turn) -> None:
        if turn.timer is not None:
            turn.timer.cancel()
        turn.timer = turn.timer_at = None

    def _on_deadline(self, turn: Turn) -> None:
        deadline, turn.timer, turn.timer_at = turn.timer_at, None, None
        if turn.ended or self.closed or turn.deferred is not None:
            return
        try:
            if deadline is not None and self.clock() >= deadline:
                turn.segmenter.set_queued_audio_ms(turn.playout.buffered_ms(self.clock()))
                self._release(turn, turn.segmenter.poll())
            self._arm_timer(turn)
        except Exception:  # a bug here must not leave the turn waiting for segments that never come
            self._turn_failed(turn, "its segment timer")

    def _text_op(self, turn: Turn, op: TextOp) -> None:
        if op.kind == "push":
            self._push_text(turn, op.arg or "")
            return
        self._release(turn, self._cut(turn, op))
        turn.segments.put_nowait(_FlushMark(op.arg) if op.kind == "flush" else _EndMark())

    def _cut(self, turn: Turn, op: TextOp) -> list[Segment]:
        """`op` done to the turn's segmenter alone: the segments it releases (nothing is held back)."""
        if op.kind == "push":
            turn.segmenter.set_queued_audio_ms(turn.playout.buffered_ms(self.clock()))
            return turn.segmenter.push(op.arg or "")
        return turn.segmenter.flush() if op.kind == "flush" else turn.segmenter.end()

    def _settle(self, turn: Turn) -> None:
        """A stopped turn's text work still held back, done to its segmenter alone (no segment released, no request
        sent): its text and cuts are then what they would have been (what a cancel reports as heard and not)."""
        ops, turn.deferred = turn.deferred, None
        if ops is None:
            return
        turn.segmenter.release()
        for op in ops:  # none is a turn's first push (that one held these back), so none would hold cuts back
            self._cut(turn, op)
