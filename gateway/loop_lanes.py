"""The event loop's low-priority lane: work that can wait a few milliseconds runs once no client message read off a
socket is still waiting for its handler.

Why: asyncio runs ready callbacks first in, first out. In a burst of new turns, the k-th turn's text.append handler
wakes up behind everything the turns ahead of it queued: their context.started, the cuts of the rest of their
paragraphs, their synthesis tasks' first steps (an encoder opened, segment.started). None of that is needed for the
next ~40 ms (the engine's TTFB), while every handler's engine request is. Work that can wait is handed to this lane
instead (`defer`); the lane runs it when no socket has a message read and unhandled (`gateway.sockets` tells it when
bytes come in, `read`, and when a handler asks for its next message, `handled`; a partial frame holds nothing back),
in slices of SLICE_S with the sockets polled between them (an item that starts a task is charged what the task's
first step will cost, `queues_s`: that step runs first in, first out, after the slice), and an item older than
BOUND_S runs whatever is waiting, so nothing starves. Without a burst (nothing waiting) an item runs on the loop's
next turn, as `call_soon` would run it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from gateway.loop_local import LoopLocal
from gateway.settings import loop_settings

log = logging.getLogger("voxgate.loop")

BOUND_S = 0.005  # an item deferred this long runs even while messages wait: the lane never starves
SLICE_S = 0.0005  # the lane's work between two polls of the sockets


class Deferred:
    """A callback queued in the lane; `cancel()` drops it if it has not run."""

    __slots__ = ("fn", "args", "at", "queues_s")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], at: float, queues_s: float = 0.0):
        self.fn: Callable[..., Any] | None = fn
        self.args = args
        self.at = at
        self.queues_s = queues_s

    def cancel(self) -> None:
        self.fn, self.args = None, ()

    @property
    def pending(self) -> bool:
        """Queued and neither run nor cancelled."""
        return self.fn is not None


class Source(Protocol):
    """A socket whose messages the lane lets go first (`gateway.sockets.ClientSocket`)."""

    def has_message(self) -> bool:
        """A message read off it waits for its handler."""
        ...


class Lane:
    """One loop's lane (`lane()`): deferred callbacks, and the sockets that may have messages waiting."""

    def __init__(self, loop: asyncio.AbstractEventLoop, enabled: bool = True):
        self.loop = loop
        self.enabled = enabled
        # sockets that read bytes since their handler last asked for a message: those whose bytes made a whole
        # message have one waiting (`has_message`); a partial frame alone holds nothing back
        self._read: set[Source] = set()
        self._items: deque[Deferred] = deque()
        self._run_at: float | None = None  # when the scheduled run is due (loop clock); None: none scheduled
        self._handle: asyncio.TimerHandle | None = None

    def defer(self, fn: Callable[..., Any], *args: Any, queues_s: float = 0.0) -> Deferred:
        """Run `fn(*args)` once no message waits for its handler (or BOUND_S from now at the latest); `queues_s`: the
        loop time of what it queues (a task's first step), counted in the lane's slice as if it ran inside it."""
        item = Deferred(fn, args, time.monotonic(), queues_s)
        if not self.enabled:  # off: as the loop would run it, first in first out
            self.loop.call_soon(self._run_one, item)
            return item
        self._items.append(item)
        self._schedule()
        return item

    def read(self, source: Source) -> None:
        """Bytes came in on a socket: a message may wait for its handler."""
        self._read.add(source)

    def handled(self, source: Source) -> None:
        """A socket's handler asks for its next message (or its reading ended)."""
        self._read.discard(source)
        if not self._read and self._items:
            self._schedule()

    @property
    def waiting(self) -> bool:
        """Some socket has a message read off it that its handler has not taken yet."""
        read = self._read
        if read:
            for source in [s for s in read if not s.has_message()]:
                read.discard(source)
        return bool(read)

    def _schedule(self) -> None:
        # a timer due now, not call_soon: timers join the ready queue after the sockets' reads of the same loop
        # iteration, so a message read then is counted before the lane runs
        now = self.loop.time()
        due = now if not self.waiting else now + max(0.0, self._items[0].at + BOUND_S - time.monotonic())
        if self._run_at is not None and self._run_at <= due:
            return
        if self._handle is not None:
            self._handle.cancel()
        self._run_at, self._handle = due, self.loop.call_at(due, self._run)

    def _run(self) -> None:
        self._run_at = self._handle = None
        start = now = time.monotonic()
        queued = 0.0
        waiting = self.waiting  # no socket is read while the lane runs
        items = self._items
        while items:
            item = items[0]
            if waiting and now - item.at < BOUND_S:
                break
            items.popleft()
            if item.fn is not None:
                queued += item.queues_s
            self._run_one(item)
            now = time.monotonic()
            if now - start + queued >= SLICE_S:
                break
        if items:
            self._schedule()

    @staticmethod
    def _run_one(item: Deferred) -> None:
        fn, args = item.fn, item.args
        if fn is None:
            return
        item.cancel()  # ran: no longer pending
        try:
            fn(*args)
        except Exception:  # one session's bug must not stop the others' deferred work
            log.exception("deferred work failed")


_lanes: LoopLocal[Lane] = LoopLocal(lambda loop: Lane(loop, loop_settings().burst_lane))


def lane() -> Lane:
    """The running loop's lane (made on first use; `gateway.settings` says whether it defers)."""
    return _lanes.get()
