"""The gateway's thread pool for Opus encoding: calls of one loop iteration go out together, the most urgent call
queued runs first, and its threads run at a lower CPU priority."""

import asyncio
import logging
import os
import sys
import threading

import numpy as np
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


async def test_an_urgent_call_goes_before_calls_an_earlier_iteration_queued():
    """The one thread is busy; calls queued meanwhile wait in the pool, and a later, more urgent call jumps them."""
    pool = OffloadPool(threads=1)
    gate = threading.Event()
    order: list[str] = []
    try:
        blocker = asyncio.ensure_future(pool.run(lambda: gate.wait(10) and order.append("blocker"), urgency=500.0))
        earlier = [asyncio.ensure_future(pool.run(order.append, f"chunk{i}", urgency=500.0 + i)) for i in range(6)]
        await asyncio.sleep(0.05)  # those went to the pool; the thread holds the blocker
        urgent = asyncio.ensure_future(pool.run(order.append, "first frame", urgency=0.0))
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(blocker, urgent, *earlier)
    finally:
        gate.set()
        pool.shutdown()
    assert order == ["blocker", "first frame", *(f"chunk{i}" for i in range(6))]


async def test_a_burst_of_first_frames_comes_back_before_other_streams_whole_chunks():
    """256 new turns' first frames arrive while 64 ongoing streams' chunks wait for the (busy) threads: every head is
    handed back before any of those chunks, at about one frame's encode each, and the bytes are those of the same calls
    made one after the other."""
    from gateway.audio import Encoder, OutputFormat

    rate, chunk, step = 48000, 7680, 960
    pcm = (0.3 * np.sin(np.arange(chunk) * 0.05) + 0.05 * np.random.default_rng(0).standard_normal(chunk))
    pcm = pcm.astype(np.float32)
    pool = OffloadPool(threads=1)  # one thread: the order of the hand-backs is the order of the encodes
    gate = threading.Event()
    done: list[str] = []

    def track(fut: asyncio.Future, name: str) -> asyncio.Future:
        fut.add_done_callback(lambda _: done.append(name))
        return fut

    try:
        blockers = [asyncio.ensure_future(pool.run(gate.wait, 10, urgency=900.0))]
        ongoing = [track(asyncio.ensure_future(pool.run(Encoder(OutputFormat(), rate).encode, pcm, urgency=900.0)),
                         "chunk") for _ in range(64)]
        await asyncio.sleep(0.05)
        encoders = [Encoder(OutputFormat(), rate) for _ in range(256)]
        heads = [track(asyncio.ensure_future(pool.run(e.encode_head, pcm, 1, step, urgency=0.0)), "head")
                 for e in encoders]
        await asyncio.sleep(0.05)
        gate.set()
        results = await asyncio.gather(*heads)
        await asyncio.gather(*blockers, *ongoing)
        rests = await asyncio.gather(*(pool.run(e.encode, pcm[used:], urgency=20.0)
                                       for e, (_, used) in zip(encoders, results, strict=True)))
    finally:
        gate.set()
        pool.shutdown()
    assert done == ["head"] * 256 + ["chunk"] * 64
    assert all(len(frames) == 1 and used == step for frames, used in results)
    reference = Encoder(OutputFormat(), rate)  # the same two calls, in one thread
    whole = reference.encode_head(pcm, 1, step)[0] + reference.encode(pcm[step:])
    assert all(head + rest == whole for (head, _), rest in zip(results, rests, strict=True))


def _thread_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="a per-thread nice value is Linux's")
async def test_the_encode_threads_run_at_a_lower_priority_than_the_loop():
    base = _thread_nice()
    pool = OffloadPool(threads=2, nice=5)
    try:
        seen = await asyncio.gather(*(pool.run(_thread_nice) for _ in range(8)))
    finally:
        pool.shutdown()
    assert set(seen) == {min(19, base + 5)}
    assert _thread_nice() == base  # the loop's thread keeps its priority


@pytest.mark.skipif(sys.platform != "linux", reason="a per-thread nice value is Linux's")
async def test_a_refused_priority_change_leaves_encoding_working(monkeypatch, caplog):
    def refuse(*args: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    base = _thread_nice()
    pool = OffloadPool(threads=1, nice=5)
    caplog.set_level(logging.DEBUG, logger="voxgate.offload")
    try:
        seen = await asyncio.gather(pool.run(_thread_nice), pool.run(int, "7"))
    finally:
        pool.shutdown()
    assert seen == [base, 7]
    assert "priority left unchanged" in caplog.text


def test_the_priority_setting_is_read_and_checked(monkeypatch):
    monkeypatch.setenv("VOXGATE_ENCODE_NICE", "3")
    assert OffloadPool(threads=1).nice == 3
    monkeypatch.setenv("VOXGATE_ENCODE_NICE", "20")
    with pytest.raises(ValueError, match="VOXGATE_ENCODE_NICE"):
        OffloadPool(threads=1)
