"""The cyclic garbage collector as a serving gateway process runs it (`voxgate serve`, every front of `--fronts N`,
and the benchmark's gateway process call `settle_gc()` once start-up is done)."""

from __future__ import annotations

import gc


def settle_gc(threshold: tuple[int, ...] | None = None) -> None:
    """Collect once, then freeze what start-up loaded, and set the collector's thresholds (None: the served ones).

    What is loaded by start-up (torch & co., ~170k objects) lives as long as the process: frozen, no collection walks
    it again (a full collection of it pauses the event loop for 85-180 ms, long enough to be heard in every stream).
    """
    gc.collect()
    gc.freeze()
    if threshold is not None:
        gc.set_threshold(*threshold)
