"""Heavy one-off work of a worker (encoding prompt audio, loading a LoRA adapter) done in slices between steps.

A chore is a generator: each `next()` does one slice of it and yields whether that slice left work on the device
(then nothing more of the chore runs before the next step), its return value is the chore's result. Between two
steps the worker runs slices of the oldest chore until `slice_ms` of host time is spent or a slice went to the
device, so a chore adds at most about `slice_ms` (one slice past it at worst) to any step's gap, however large the
work: a 60 s prompt's encode or a 37 MB adapter's copies cost the streams that speak meanwhile a few ms a step,
where done at once they stopped every stream for seconds. Chores run one after another, oldest first.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Generator
from typing import Any

log = logging.getLogger(__name__)

CHORE_SLICE_MS = 20.0  # the default `WorkerConfig.chore_slice_ms`

Chore = Generator[bool, None, Any]  # yields "this slice left work on the device", returns the result
Reply = Callable[[int, bool, Any], None]  # (call id, ok, result or error message)


def as_array(chore: Chore) -> Chore:
    """`chore`, its tensor result as a numpy array: pickled by value through the pipe, where a tensor would go as a
    shared-memory handle that the pool's reader thread fetches from this process, stalling every stream's chunks
    behind it while this process's step loop holds the GIL."""
    return (yield from chore).numpy()


class Chores:
    """The worker's queue of chores and the slicing between steps."""

    def __init__(self, slice_ms: float, reply: Reply):
        self.slice_ms = slice_ms
        self.reply = reply
        self.queue: deque[tuple[Chore, int]] = deque()

    def __bool__(self) -> bool:
        return bool(self.queue)

    def add(self, chore: Chore, call: int) -> None:
        """Queue `chore`; its result (or its error's message) goes to `reply` under `call` when it ends."""
        self.queue.append((chore, call))

    def run(self) -> None:
        """Slices of the oldest chores until `slice_ms` is spent or a slice left work on the device."""
        start = time.perf_counter()
        while self.queue:
            chore, call = self.queue[0]
            try:
                on_device = next(chore)
            except StopIteration as done:
                self.queue.popleft()
                self.reply(call, True, done.value)
                continue
            except Exception as e:  # a bad input fails its call, not the worker and its streams
                log.debug("chore failed", exc_info=True)
                self.queue.popleft()
                self.reply(call, False, f"{type(e).__name__}: {e}")
                continue
            if on_device or 1000.0 * (time.perf_counter() - start) >= self.slice_ms:
                return

    def close(self) -> None:
        """Drop every chore unfinished (the worker is stopping)."""
        for chore, _ in self.queue:
            chore.close()
        self.queue.clear()
