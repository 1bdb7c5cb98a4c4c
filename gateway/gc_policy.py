"""The cyclic garbage collector as a serving gateway process runs it (`voxgate serve`, every front of `--fronts N`,
and the benchmark's gateway process call `settle_gc()` once start-up is done)."""

from __future__ import annotations

import gc

# A collection of generation 0 runs each time tracked objects allocated minus freed reach the first threshold; every
# 10th also collects generation 1, and every 10th of those everything not frozen. Each session keeps a few hundred
# tracked objects alive, so at Python's default of 700 the collector runs several times a second under load, and the
# full collections it leads to walk every session's objects at once: a paused event loop, heard in every stream. A
# first threshold of 10,000 runs it an order of magnitude less often, most of a turn's objects are gone before it
# looks, and generation-1 and full collections come minutes apart; a generation-0 pause grows to a few ms, memory
# does not grow. bench/gateway_load.py --gc-threshold measures other settings against it.
SERVED_THRESHOLD = (10_000, 10, 10)


def settle_gc(threshold: tuple[int, ...] | None = None) -> None:
    """Collect once, freeze what start-up loaded, and set the collector's thresholds (None: SERVED_THRESHOLD).

    What is loaded by start-up (torch & co., ~170k objects) lives as long as the process: frozen, no collection walks
    it again (a full collection of it pauses the event loop for 85-180 ms, long enough to be heard in every stream).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*(threshold or SERVED_THRESHOLD))
