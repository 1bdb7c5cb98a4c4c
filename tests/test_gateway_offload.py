"""The gateway's thread pool for Opus encoding: calls of one loop iteration go out together, most urgent first."""

import asyncio
import os
import threading

import pytest

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


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 2), (4, 3), (8, 6), (16, 12), (64, 12)])
def test_default_threads_leave_a_quarter_of_the_cores_to_the_loop_up_to_12(monkeypatch, cores, threads):
    monkeypatch.delenv("VOXGATE_ENCODE_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert default_threads() == threads


def test_the_environment_overrides_the_default_threads(monkeypatch):
    monkeypatch.setenv("VOXGATE_ENCODE_THREADS", "16")
    assert default_threads() == 16
