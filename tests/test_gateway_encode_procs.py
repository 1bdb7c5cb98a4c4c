"""Opus encoding in encoder processes (`gateway.encode_procs`): the bytes of the in-process encoder (the order calls
are served in: `test_gateway_encode_procs_order.py`), a killed process fails only its own turns and is replaced, a
closed turn frees its encoder there, and shutdown (or the gateway's death) leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

from gateway.audio import Encoder, OutputFormat
from gateway.encode_procs import EncodeFailed, EncodeProcs, EncoderProcessLost, ProcEncoder
from gateway.encode_wire import SLOT_BYTES

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
RATE = 48000
CHUNK = RATE * 160 // 1000


def speech(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * 140 * t) * (1 + np.sin(2 * np.pi * 3 * t))
    return (tone + 0.05 * np.random.default_rng(seed).standard_normal(len(t))).astype(np.float32)


SOURCE = speech(1.0, RATE)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def procs() -> AsyncIterator[EncodeProcs]:
    """Two encoder processes shared by the tests that leave them as they found them (every encoder closed)."""
    host = EncodeProcs(2, nice=0)
    yield host
    host.close()


shared_loop = pytest.mark.asyncio(loop_scope="module")  # the tests that use `procs`


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for a parent that is gone too counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.parametrize("model_rate", [48000, 16000])  # 16 kHz: soxr's blocks make the head split uneven
@shared_loop
async def test_the_packets_are_the_in_process_encoders(procs, model_rate):
    fmt = OutputFormat()
    pcm = speech(1.0, model_rate)
    chunk, step = model_rate * 160 // 1000, model_rate * fmt.frame_ms // 1000
    remote, local = procs.open(fmt, model_rate), Encoder(fmt, model_rate)
    got: list[bytes] = []
    want: list[bytes] = []
    for i, start in enumerate(range(0, len(pcm), chunk)):
        piece = pcm[start:start + chunk]
        if i % 3 == 0:  # a chunk that starts the listener's audio: head, then the rest
            head, used = await remote.encode_head(piece, 1, step, 0.0)
            assert (head, used) == local.encode_head(piece, 1, step)
            got += head + await remote.encode(piece[used:], 20.0)
            want += head + local.encode(piece[used:])
        else:
            got += await remote.encode(piece, 300.0)
            want += local.encode(piece)
        if i == 3:  # a flush mid-turn
            assert await remote.drain(100.0) == local.drain()
    big = speech(3.0, model_rate, seed=1)  # more than a shared slot holds: it goes through the socket
    assert big.nbytes > SLOT_BYTES
    got += await remote.encode(big, 500.0)
    want += local.encode(big)
    got += await remote.finish(0.0)
    want += local.finish()
    assert len(want) > 190 and got == want
    remote.close()


async def test_a_killed_process_fails_only_its_turns_and_is_replaced():
    procs = EncodeProcs(2, nice=0)
    try:
        await _kill_one_of(procs)
    finally:
        procs.close()


async def _kill_one_of(procs: EncodeProcs) -> None:
    a, b = procs.open(OutputFormat(), RATE), procs.open(OutputFormat(), RATE)
    assert isinstance(a, ProcEncoder) and a._process is not b._process  # the least-loaded process each
    reference = Encoder(OutputFormat(), RATE)
    assert await b.encode(SOURCE[:CHUNK], 100.0) == reference.encode(SOURCE[:CHUNK])
    await a.encode(SOURCE[:CHUNK], 100.0)
    victim = a._process.pid
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(EncoderProcessLost, match="encoder process stopped"):
        await a.encode(SOURCE[CHUNK:2 * CHUNK], 100.0)
    with pytest.raises(EncoderProcessLost):  # and every later call of that turn
        await a.finish(0.0)
    a.close()
    # the other turn goes on, byte for byte
    assert await b.encode(SOURCE[CHUNK:2 * CHUNK], 100.0) == reference.encode(SOURCE[CHUNK:2 * CHUNK])
    assert await b.finish(0.0) == reference.finish()
    b.close()
    assert len(procs.pids) == 2 and victim not in procs.pids and gone(victim)  # replaced, and reaped
    c = procs.open(OutputFormat(), RATE)
    assert await c.encode(SOURCE[:CHUNK], 100.0) == Encoder(OutputFormat(), RATE).encode(SOURCE[:CHUNK])
    c.close()


async def test_a_wedged_process_is_replaced_and_its_turns_fail():
    procs = EncodeProcs(2, nice=0, stall_s=0.5)
    try:
        a, b, c = (procs.open(OutputFormat(), RATE) for _ in range(3))
        await asyncio.gather(*(e.encode(SOURCE[:CHUNK], 100.0) for e in (a, b, c)))
        assert isinstance(a, ProcEncoder) and isinstance(c, ProcEncoder) and c._process is a._process
        wedged = a._process.pid
        os.kill(wedged, signal.SIGSTOP)  # alive, but answers nothing
        t0 = time.monotonic()
        windowed = asyncio.ensure_future(c.encode(SOURCE[CHUNK:2 * CHUNK], 1000.0))  # a listener with audio left
        with pytest.raises(EncoderProcessLost, match="no answer in 0.5 s"):  # urgent: sent past the window
            await a.encode(SOURCE[CHUNK:2 * CHUNK], 100.0)
        with pytest.raises(EncoderProcessLost, match="no answer in 0.5 s"):
            await windowed
        assert time.monotonic() - t0 < 3.0
        assert await b.encode(SOURCE[CHUNK:2 * CHUNK], 100.0)  # the other process's turn goes on
        assert gone(wedged) and len(procs.pids) == 2
    finally:
        procs.close()


@shared_loop
async def test_closing_and_cancelling_turns_frees_their_encoders(procs):
    encoders = [procs.open(OutputFormat(), RATE) for _ in range(5)]
    await asyncio.gather(*(e.encode(SOURCE[:CHUNK], 100.0) for e in encoders))
    assert sorted(await procs.open_counts()) == [2, 3]
    cancelled = asyncio.ensure_future(encoders[0].encode(SOURCE[CHUNK:2 * CHUNK], 100.0))
    await asyncio.sleep(0)
    cancelled.cancel()  # a turn cancelled while its call is out
    for e in encoders:
        e.close()
    assert await procs.open_counts() == [0, 0]


@shared_loop
async def test_an_encoder_that_cannot_be_made_fails_its_calls_with_the_reason(procs):
    broken = procs.open(OutputFormat(), 0)
    with pytest.raises(EncodeFailed, match="sample_rate"):
        await broken.encode(SOURCE[:CHUNK], 0.0)
    with pytest.raises(ValueError, match="mono"):
        await broken.encode(np.zeros((2, 10), np.float32), 0.0)
    broken.close()
    assert await procs.open_counts() == [0, 0]


async def test_shutdown_stops_every_process_even_a_wedged_one():
    host = EncodeProcs(2, nice=0)
    encoders = [host.open(OutputFormat(), RATE) for _ in range(2)]
    await asyncio.gather(*(e.encode(SOURCE[:CHUNK], 100.0) for e in encoders))
    pids = host.pids
    os.kill(pids[0], signal.SIGSTOP)  # wedged: it will not read its end of file
    waiting = asyncio.ensure_future(next(e for e in encoders if e._process.pid == pids[0]).encode(SOURCE, 100.0))
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    host.close(timeout=0.5)
    assert time.monotonic() - t0 < 3.0
    assert all(gone(pid) for pid in pids)
    with pytest.raises(EncoderProcessLost, match="shutting down"):
        await waiting
    with pytest.raises(EncoderProcessLost):
        host.open(OutputFormat(), RATE)


def test_the_processes_end_with_a_gateway_that_dies():
    """SIGKILL of the gateway runs no clean-up: its encoder processes see their socket's end of file and exit."""
    program = textwrap.dedent("""
        import asyncio, time
        from gateway.audio import OutputFormat
        from gateway.encode_procs import EncodeProcs

        async def main():
            host = EncodeProcs(1, nice=0)
            await host.open(OutputFormat(), 48000).finish(0.0)
            print(host.pids[0], flush=True)
            time.sleep(60)

        asyncio.run(main())
    """)
    gateway = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert gateway.stdout is not None
        child = int(gateway.stdout.readline())
        gateway.kill()
        gateway.wait()
        deadline = time.monotonic() + 10.0
        while not gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(child)
    finally:
        gateway.kill()


@pytest.mark.parametrize("setting, started", [("2", 2), ("0", 0)])
async def test_a_serving_process_starts_its_encoders_before_its_first_turn(monkeypatch, setting, started):
    from gateway.encode_procs import close_shared, shared_pids
    from gateway.encode_site import start_encoders

    monkeypatch.setenv("VOXGATE_ENCODE_PROCS", setting)
    start_encoders()
    try:
        assert len(shared_pids()) == started  # running now, with no turn opened (0: Opus in the thread pool)
    finally:
        close_shared()
    assert shared_pids() == []


async def test_a_process_that_cannot_get_its_shared_memory_leaves_nothing_open(monkeypatch):
    """No shared memory for the slots (a full /dev/shm): the start fails with the OS's error, and neither the socket
    pair nor anything else of the process it was starting stays open."""
    import gateway.encode_procs as encode_procs

    def no_shared_memory(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(encode_procs, "shared_file", no_shared_memory)
    before = sorted(os.listdir("/proc/self/fd"))
    host = EncodeProcs(1)
    with pytest.raises(OSError, match="No space left") as caught:
        host.start()
    assert host.pids == []
    # closed, not waiting for the garbage collector: the traceback (held here, as a logger's would be) keeps the frame
    assert caught.traceback and sorted(os.listdir("/proc/self/fd")) == before
    host.close()
