"""The gateway's thread pool for Opus encoding: calls of one loop iteration go out together, most urgent first."""

import asyncio
import os
import threading

import pytest

from gateway import offload
from gateway.offload import OffloadPool, default_threads

pytestmark = pytest.mark.timeout(30)


async def test_calls_run_in_worker_threads_and_return_their_results():
    pool = OffloadPool(threads=2)
    main = threading.get_ident()
    try:
        results = await asyncio.gather(*(pool.run(lambda x: (x * x, threading.get_ident()), i) for i in range(20)))
    finally:
        pool.shutdown()
    assert [r[0] for r in results] == [i * i for i in range(20)]
    assert all(r[1] != main for r in results)


async def test_an_exception_reaches_its_caller_only():
    pool = OffloadPool(threads=1)

    def boom() -> None:
        raise ValueError("bad chunk")

    try:
        ok, bad = await asyncio.gather(pool.run(int, "7"), pool.run(boom), return_exceptions=True)
    finally:
        pool.shutdown()
    assert ok == 7
    assert isinstance(bad, ValueError) and str(bad) == "bad chunk"


async def test_the_most_urgent_calls_of_one_iteration_run_first():
    pool = OffloadPool(threads=1)
    order: list[float] = []
    urgencies = [900.0, 0.0, 450.0, 1500.0, 20.0]
    try:
        await asyncio.gather(*(pool.run(order.append, u, urgency=u) for u in urgencies))
    finally:
        pool.shutdown()
    assert order == sorted(urgencies)


async def test_results_handed_back_while_the_loop_is_busy_arrive_in_one_wakeup(monkeypatch):
    deliveries: list[int] = []
    handed_back: list[int] = []
    all_back = threading.Event()
    deliver, put = offload._Inbox.deliver, offload._Inbox.put

    def counted_deliver(self: offload._Inbox) -> None:
        deliveries.append(len(self.results))
        deliver(self)

    def counted_put(self: offload._Inbox, results: list) -> None:
        put(self, results)
        handed_back.extend(r[1] for r in results)
        if len(handed_back) == 8:
            all_back.set()

    monkeypatch.setattr(offload._Inbox, "deliver", counted_deliver)
    monkeypatch.setattr(offload._Inbox, "put", counted_put)
    pool = OffloadPool(threads=1)
    try:
        # urgent calls (a burst of first chunks) are each handed back as soon as they are done
        calls = [asyncio.ensure_future(pool.run(lambda i: i * 10, i, urgency=0.0)) for i in range(8)]
        await asyncio.sleep(0)  # the calls are collected
        await asyncio.sleep(0)  # and go to the worker
        assert all_back.wait(5)  # the loop is busy (blocked here) while the worker hands back all eight, one by one
        results = await asyncio.gather(*calls)
    finally:
        pool.shutdown()
    assert results == [i * 10 for i in range(8)]
    assert deliveries == [8]


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 2), (4, 3), (8, 6), (16, 12), (64, 12)])
def test_default_threads_leave_a_quarter_of_the_cores_to_the_loop_up_to_12(monkeypatch, cores, threads):
    monkeypatch.delenv("VOXGATE_ENCODE_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert default_threads() == threads


def test_the_environment_overrides_the_default_threads(monkeypatch):
    monkeypatch.setenv("VOXGATE_ENCODE_THREADS", "16")
    assert default_threads() == 16
