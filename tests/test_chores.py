"""The worker's chores (engine.chores), without a worker: slices between steps within the budget, results and errors
replied under their call, oldest chore first."""

import time

from engine.chores import Chores


def test_chores_run_in_slices_within_the_budget_and_reply_in_order():
    replies = []
    chores = Chores(slice_ms=20.0, reply=lambda call, ok, value: replies.append((call, ok, value)))

    def host_work(n: int, ms: float):
        for _ in range(n):
            time.sleep(ms / 1000)
            yield False
        return n

    def device_work():
        yield True  # its slice left work on the device: nothing more of any chore before the next step
        yield True
        return "encoded"

    def broken():
        yield False
        raise ValueError("bad input")

    chores.add(host_work(10, 5.0), 1)
    chores.add(broken(), 2)
    chores.add(device_work(), 3)
    runs = 0
    while chores:
        chores.run()
        runs += 1
    assert replies == [(1, True, 10), (2, False, "ValueError: bad input"), (3, True, "encoded")]
    # 50 ms of host work in turns of 20 ms (at most 5 slices of 5 ms: 3 turns or more), then one turn per device
    # slice; all at once it would have been 2 turns
    assert runs >= 3 + 2
