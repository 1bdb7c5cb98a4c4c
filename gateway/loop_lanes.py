"""The event loop's low-priority lane: work that can wait a few milliseconds runs once no client message read off a
socket is still waiting for its handler.

Why: asyncio runs ready callbacks first in, first out. In a burst of new turns, the k-th turn's text.append handler
wakes up behind everything the turns ahead of it queued: their context.started, the cuts of the rest of their
paragraphs, their synthesis tasks' first steps (an encoder opened, segment.started). None of that is needed for the
next ~40 ms (the engine's TTFB), while every handler's engine request is. Work that can wait is handed to this lane
instead (`defer`); the lane runs it when no socket has a message read and unhandled (`message_waiting` /
`messages_handled`, kept by `gateway.sockets`), in slices of SLICE_S with the sockets polled between them (an item
that starts a task is charged what the task's first step will cost, `queues_s`: that step runs first in, first out,
after the slice), and an item older than BOUND_S runs whatever is waiting, so nothing starves. Without a burst
(nothing waiting) an item runs on the loop's next turn, as `call_soon` would run it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

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


class Lane:
    """One loop's lane (`lane()`): deferred callbacks, and the count of sockets with messages waiting."""

    def __init__(self, loop: asyncio.AbstractEventLoop, enabled: bool = True):
        self.loop = loop
        self.enabled = enabled
        self.waiting = 0  # sockets with a message read off them and not yet handled
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

    def message_waiting(self) -> None:
        """A socket has a message read off it that its handler has not taken yet."""
        self.waiting += 1

    def messages_handled(self) -> None:
        """A socket counted by `message_waiting` has no message left for its handler."""
        self.waiting = max(0, self.waiting - 1)
        if not self.waiting and self._items:
            self._schedule()

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
        items = self._items
        while items:
            item = items[0]
            if self.waiting and now - item.at < BOUND_S:
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


_lanes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Lane] = weakref.WeakKeyDictionary()


def lane(loop: asyncio.AbstractEventLoop | None = None) -> Lane:
    """The running loop's lane (made on first use; `gateway.settings` says whether it defers)."""
    loop = loop or asyncio.get_running_loop()
    found = _lanes.get(loop)
    if found is None:
        from gateway.settings import burst_lane_enabled

        found = _lanes[loop] = Lane(loop, burst_lane_enabled())
    return found
