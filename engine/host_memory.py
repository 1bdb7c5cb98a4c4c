"""The worker process's host heap: freed memory goes back to the OS instead of piling up under load.

glibc's malloc serves blocks of at least its mmap threshold from their own mappings (returned to the OS when
freed), but it raises that threshold to the size of every such block freed, up to 32 MB. After a few steps every
per-step buffer (a step's audio, sampled patches, prompt tensors: 128 KiB to several MB each) is therefore carved
from the heap, and a storm of requests of many sizes cancelled at random moments fragments it: the worker's RSS grew
~15 MB per round of 64 cancelled requests on the CPU (hundreds of MB a round on an H200) with every request, block
and slot freed. Pinning the thresholds at glibc's own defaults keeps those buffers in mappings of their own, so the
RSS settles after the first rounds (tests/test_worker_memory.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
HEAP_THRESHOLD_BYTES = 128 * 1024  # glibc's default; setting it at all turns the dynamic raise off


def keep_heap_returnable() -> bool:
    """Pin malloc's mmap and trim thresholds (glibc only; elsewhere nothing changes). Whether they were set."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): their allocators have no such threshold
        return False
    ok = all(mallopt(param, HEAP_THRESHOLD_BYTES) == 1 for param in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))
    if not ok:
        log.debug("mallopt refused the heap thresholds")
    return ok
