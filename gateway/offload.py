"""Run short CPU work (Opus encoding of engine chunks) off the event loop, in batches, earliest deadline first.

`asyncio.to_thread` per chunk costs a thread wakeup and a loop wakeup per call, and under a burst (one engine step
hands a chunk to every stream at once) those hops pile up on the loop and fight it for the GIL. Here every call made
during one loop iteration goes into one queue shared by the worker threads, and one thread job per few calls drains
it; a non-urgent call's result waits for its job's others (one wakeup of the loop for several). libopus runs without
the GIL, so the threads spread over the cores. The queue is earliest deadline first: a call's deadline is when its
listener runs out of audio (queued at + `urgency`), so a turn's first frame never waits behind calls queued earlier
for listeners with audio left, and a call queued long ago is not overtaken for ever by newer, shorter ones.

The threads run at a lower CPU priority than the rest of the process (VOXGATE_ENCODE_NICE): when a burst of encoding
meets the event loop or the engine worker's host thread (whose lateness delays every stream's step), those come first.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gateway.settings import GatewaySettings

log = logging.getLogger("voxgate.offload")

MAX_PART = 8  # calls per thread job
# a call this urgent when it is done (its listener has less audio than this left, in ms; a turn's first chunk has
# none) is handed back at once; the others come back together at the end of their job (one loop wakeup)
URGENT = 200.0


def default_threads() -> int:
    """VOXGATE_ENCODE_THREADS, or three encode threads per four cores this process may run on, up to 12. A chunk's
    frames are one C call that releases the GIL once, so threads scale, but not onto every core: the event loop
    thread (~45% busy at 500 sessions) and the socket writes need the rest; past that, more threads only convoy
    (bench/gateway_capacity.py). Their lower priority (`lower_thread_priority`) keeps a burst from delaying the loop
    or the engine's host thread, so the pool is sized for encoding throughput."""
    configured = GatewaySettings.from_env().encode_threads
    return three_quarters_of_cores() if configured is None else configured


_processes_sharing_cores = 1  # gateway front processes on this machine (`share_cores`)


def share_cores(processes: int) -> None:
    """This process is one of `processes` gateway fronts on the machine (`gateway.fronts`): the sizes chosen from
    the cores (encode threads, encoder processes) become its share, so N fronts start as many as one process would."""
    global _processes_sharing_cores
    _processes_sharing_cores = max(1, processes)


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def three_quarters_of_cores() -> int:
    """Three workers per four cores this process may run on, up to 12 (encode threads, or encoder processes), divided
    among the gateway fronts sharing the machine (at least 1 each)."""
    cores = usable_cores()
    return max(1, min(12, cores - cores // 4) // _processes_sharing_cores)


def default_encode_procs() -> int:
    """Encoder processes of this front (VOXGATE_ENCODE_PROCS=auto): `three_quarters_of_cores`, and at least two where
    the front has two cores of its own. A burst's first frames, one per new turn, each wait for those ahead of them in
    their process: two processes serve them two at a time."""
    return max(three_quarters_of_cores(), min(2, usable_cores() // _processes_sharing_cores))


def lower_thread_priority(increment: int) -> None:
    """Lower the calling thread's CPU priority by `increment` nice levels (Linux, where a nice value is per thread).
    A no-op for 0, elsewhere, or where it is not permitted: encoding then runs at the process's priority."""
    if increment <= 0 or sys.platform != "linux":  # elsewhere PRIO_PROCESS with a thread id names another process
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError as e:
        log.debug("encode thread priority left unchanged: %s", e)


_Job = tuple[float, int, asyncio.AbstractEventLoop, Callable[..., Any], tuple[Any, ...], asyncio.Future]
_Result = tuple[asyncio.Future, Any, BaseException | None]


class OffloadPool:
    """`await pool.run(fn, *args)`: fn(*args) in a worker thread; the queued call whose listener runs out of audio
    first runs next, whichever loop iteration queued it.

    Calls are independent: callers that need ordering (one turn's encoder) await each call before the next."""

    def __init__(self, threads: int | None = None, nice: int | None = None):
        self.threads = threads or default_threads()
        self.nice = GatewaySettings.from_env().encode_nice if nice is None else nice
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._queue: list[_Job] = []  # a heap: earliest (deadline, arrival) first
        self._arrival = itertools.count()
        self._pending: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[_Job]] = weakref.WeakKeyDictionary()

    async def run(self, fn: Callable[..., Any], *args: Any, urgency: float = 0.0) -> Any:
        """fn(*args) in a worker thread; its result (or exception) here. `urgency`: ms until the caller's listener
        runs out of audio (a turn's first frame, 0, goes before the chunks of streams with a second of audio queued);
        the earliest deadline goes first, equal deadlines in arrival order."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        pending = self._pending.get(loop)
        if pending is None:
            pending = self._pending[loop] = []
        if not pending:
            loop.call_soon(self._flush, loop)  # after every task made ready by the same event has had its turn
        deadline = time.monotonic() * 1000.0 + urgency
        pending.append((deadline, next(self._arrival), loop, fn, args, fut))
        return await fut

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        jobs = self._pending.pop(loop, None)
        if not jobs:
            return
        executor = self._get_executor()
        with self._lock:
            for job in jobs:
                heapq.heappush(self._queue, job)
        # enough thread jobs to take every call queued now; each takes whatever is most urgent when it runs
        size = min(MAX_PART, -(-len(jobs) // self.threads))
        for _ in range(-(-len(jobs) // size)):
            executor.submit(self._run_part, size)

    def _next(self) -> _Job | None:
        with self._lock:
            return heapq.heappop(self._queue) if self._queue else None

    def _run_part(self, size: int) -> None:
        """Up to `size` calls, the earliest deadline queued first each time; urgent results go back at once."""
        results: dict[asyncio.AbstractEventLoop, list[_Result]] = {}
        for _ in range(size):
            job = self._next()
            if job is None:
                break
            deadline, _, loop, fn, args, fut = job
            if fut.cancelled():  # the caller is gone (turn cancelled): skip its work
                continue
            try:
                result: _Result = (fut, fn(*args), None)
            except BaseException as e:  # handed to the awaiting caller, as asyncio.to_thread would
                result = (fut, None, e)
            if deadline - time.monotonic() * 1000.0 < URGENT:
                _hand_back(loop, [result])
            else:
                results.setdefault(loop, []).append(result)
        for loop, done in results.items():
            _hand_back(loop, done)

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="voxgate-offload",
                                                    initializer=lower_thread_priority, initargs=(self.nice,))
            return self._executor

    def shutdown(self) -> None:
        """Stop the threads (after the jobs already handed to them)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


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
