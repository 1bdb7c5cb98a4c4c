"""Split decodes: under high load the speaking streams decode in two halves that take turns (`engine.scheduler`).

Past `above` speaking streams a full step is long, and a new prompt waits for about three of them; two halves taking
turns halve the step, while each stream still gets a patch every two steps. Speakers alternate between the halves in
arrival order when the split starts; a stream joins the smaller half at its first patch; the split ends below 3/4
of the bound. Sans-I/O: the scheduler asks which half decodes next and commits each step's turn.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.request import Request


class DecodeHalves:
    """Whether decodes are split (`split`), the half the last step decoded (`turn`), split steps so far."""

    def __init__(self, above: int | None):
        self.above = above  # `split_decodes_above`; None: never split
        self.split = False  # the decodes take turns by half (`Request.decode_group`)
        self.turn = 0
        self.num_split_steps = 0

    def next_turn(self, speaking: Callable[[], list[Request]]) -> int | None:
        """The half whose decodes the next step runs, or None while all decode every step, given the requests that
        will have spoken by then (asked only while splitting is on). Nothing is committed until `commit`: a step
        that is not scheduled takes no turn."""
        if self.above is None:
            return None
        speakers = speaking()
        if len(speakers) <= self.above * (0.75 if self.split else 1.0):
            return None
        if not self.split:
            for i, req in enumerate(sorted(speakers, key=lambda r: r.arrival)):
                req.decode_group = i % 2
        return 1 - self.turn

    @staticmethod
    def decoding(turn: int | None, decodes: list[Request]) -> tuple[int | None, list[Request]]:
        """The turn and the `decodes` of its half (all of them while not split); the other half's turn again when
        that one has nothing to decode (yet)."""
        if turn is None:
            return None, decodes
        if not any(r.decode_group == turn for r in decodes):
            turn = 1 - turn
        return turn, [r for r in decodes if r.decode_group == turn]

    def commit(self, turn: int | None, new: list[Request], running: list[Request]) -> None:
        """A step of `turn` is scheduled; while split, its `new` streams (first patch) join the smaller half of the
        `running` ones."""
        self.split = turn is not None
        if turn is None:
            return
        self.turn = turn
        self.num_split_steps += 1
        sizes = [0, 0]
        for r in running if new else ():  # the halves' sizes
            sizes[r.decode_group] += bool(r.generated)
        for req in new:
            req.decode_group = int(sizes[1] < sizes[0])
            sizes[req.decode_group] += 1
