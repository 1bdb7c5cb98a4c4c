"""The worker process's host heap: freed memory goes back to the OS instead of piling up under load.

glibc's malloc raises its mmap threshold to the size of every large block freed (up to 32 MB), so after a few steps
the per-step buffers (a step's audio, sampled patches, prompt tensors: 128 KiB to several MB each) come from the
heap, and a storm of requests of many sizes cancelled at random moments fragments it: the free memory stays in the
process, and the worker's RSS grows round after round with every request, block and slot freed. `HeapTrimmer` hands
the heap's free pages back (`malloc_trim`) when the worker goes idle and at most once per `TRIM_INTERVAL_S` while it
is busy, so the RSS settles after the first rounds (tests/test_worker_memory.py). Pinning the mmap threshold instead
would cost an mmap, page faults and an munmap for every large buffer of every step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_INTERVAL_S = 1.0  # while busy: a trim walks the heap (~1 ms for a few hundred MB), so not every step


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return None


class HeapTrimmer:
    """Gives the heap's free pages back to the OS now and then (glibc only; elsewhere it does nothing)."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S):
        self.interval_s = interval_s
        self.trim = _malloc_trim()
        self.last = time.monotonic()

    def busy(self) -> None:
        """Between steps: trim when the last trim is `interval_s` old."""
        if self.trim is not None and time.monotonic() - self.last >= self.interval_s:
            self.idle()

    def idle(self) -> None:
        """The worker has nothing to do: trim now."""
        if self.trim is not None:
            self.trim(0)
            self.last = time.monotonic()
