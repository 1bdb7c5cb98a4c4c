"""Run short CPU work (Opus encoding of engine chunks) off the event loop, in batches.

`asyncio.to_thread` per chunk costs a thread wakeup and a loop wakeup per call, and under a burst (one engine step
hands a chunk to every stream at once) those hops pile up on the loop and fight it for the GIL. Here every call made
during one loop iteration is collected, cut into a few parts, and each part is one job for a worker thread and one
wakeup of the loop when it is done. libopus runs without the GIL, so the threads spread over the cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gateway.settings import GatewaySettings

MAX_PART = 8  # calls per thread job
# a call this urgent (its listener has less audio than this left, in ms; a turn's first chunk has none) is handed
# back as soon as it is done; the others come back together at the end of their part (one loop wakeup)
URGENT = 200.0


def default_threads() -> int:
    """VOXGATE_ENCODE_THREADS, or three encode threads per four cores this process may run on, up to 12. A chunk's
    frames are one C call that releases the GIL once, so threads scale, but not onto every core: the event loop
    thread (~45% busy at 500 sessions) and the socket writes need the rest; past that, more threads only convoy
    (bench/gateway_capacity.py)."""
    configured = GatewaySettings.from_env().encode_threads
    if configured is not None:
        return configured
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(12, cores - cores // 4))


_Job = tuple[float, Callable[..., Any], tuple[Any, ...], asyncio.Future]
_Result = tuple[asyncio.Future, Any, BaseException | None]


class OffloadPool:
    """`await pool.run(fn, *args)`: fn(*args) in a worker thread; calls of one loop iteration travel together, the
    most urgent (lowest `urgency`) first.

    Calls are independent: callers that need ordering (one turn's encoder) await each call before the next."""

    def __init__(self, threads: int | None = None):
        self.threads = threads or default_threads()
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._pending: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[_Job]] = weakref.WeakKeyDictionary()

    async def run(self, fn: Callable[..., Any], *args: Any, urgency: float = 0.0) -> Any:
        """fn(*args) in a worker thread; its result (or exception) here. Among the calls of one loop iteration,
        lower `urgency` goes first (the session passes the audio its listener has left: a turn's first chunk, 0,
        before the chunks of streams with a second of audio queued)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        pending = self._pending.get(loop)
        if pending is None:
            pending = self._pending[loop] = []
        if not pending:
            loop.call_soon(self._flush, loop)  # after every task made ready by the same event has had its turn
        pending.append((urgency, fn, args, fut))
        return await fut

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        jobs = self._pending.pop(loop, None)
        if not jobs:
            return
        executor = self._get_executor()
        jobs.sort(key=_urgency)  # stable: equal urgency keeps arrival order
        size = min(MAX_PART, -(-len(jobs) // self.threads))
        for i in range(0, len(jobs), size):
            executor.submit(_run_part, loop, jobs[i:i + size])

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="voxgate-offload")
            return self._executor

    def shutdown(self) -> None:
        """Stop the threads (after the jobs already handed to them)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


def _urgency(job: _Job) -> float:
    return job[0]


def _run_part(loop: asyncio.AbstractEventLoop, jobs: list[_Job]) -> None:
    results: list[_Result] = []
    for urgency, fn, args, fut in jobs:
        if fut.cancelled():  # the caller is gone (turn cancelled): skip its work
            continue
        try:
            results.append((fut, fn(*args), None))
        except BaseException as e:  # handed to the awaiting caller, as asyncio.to_thread would
            results.append((fut, None, e))
        if urgency < URGENT:
            _hand_back(loop, results)
            results = []
    _hand_back(loop, results)


def _hand_back(loop: asyncio.AbstractEventLoop, results: list[_Result]) -> None:
    if results and not loop.is_closed():
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting any more
            loop.call_soon_threadsafe(_deliver, results)


def _deliver(results: list[_Result]) -> None:
    for fut, value, error in results:
        if fut.done():
            continue
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)


_shared: OffloadPool | None = None


def shared_pool() -> OffloadPool:
    """The process-wide pool every session uses (created on first use)."""
    global _shared
    if _shared is None:
        _shared = OffloadPool()
    return _shared
