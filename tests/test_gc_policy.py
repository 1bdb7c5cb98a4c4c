"""gateway.gc_policy: the collector as every serving gateway process runs it."""

import gc

from gateway.gc_policy import SERVED_THRESHOLD, settle_gc


def test_settle_gc_freezes_start_up_and_sets_the_served_thresholds():
    before = gc.get_threshold()
    try:
        settle_gc()
        assert gc.get_threshold() == SERVED_THRESHOLD and gc.get_freeze_count() > 0
        tracked = len(gc.get_objects())
        assert tracked < gc.get_freeze_count()  # a full collection walks what came after start-up, not start-up
        settle_gc((700, 10, 10))
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
