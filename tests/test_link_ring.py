"""A step's audio host -> front through the link's shared-memory ring (`gateway.link.ring`): handed over on a real
socket, equal to the inline path bit for bit, inline when full, and released with the link (also when the front is
killed -9)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engine.errors import EngineError
from engine.ipc import AudioRing
from gateway.link import EngineHost, connect, ring, wire
from gateway.store import LocalStore

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


def maps() -> int:
    """The link rings this process has mapped now."""
    return Path("/proc/self/maps").read_text().count("voxgate-ring")


def step_rows(rng: np.random.Generator, step: int, n: int = 3, samples: int = 640) -> list[wire.ChunkRow]:
    return [(f"r{i}", rng.standard_normal(samples).astype(np.float32), step, rng.standard_normal((4, 3)),
             False, None, step, (1.0, 2.0) if step == 0 else None) for i in range(n)]


async def ring_pair(floats: int) -> tuple[AudioRing, AudioRing, socket.socket, socket.socket]:
    """A host's and a front's view of one ring, handed over on a real socket pair."""
    host_sock, front_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    front_sock.setblocking(False)
    host_ring = ring.offer(host_sock, floats)
    front_ring = await ring.receive(front_sock)
    assert host_ring is not None and front_ring is not None
    return host_ring, front_ring, host_sock, front_sock


def through(msg: wire.Chunks, front_ring: AudioRing | None) -> list[wire.ChunkRow]:
    """`msg` framed, read back as a front reads it, and unpacked."""
    [(_, [back])] = wire.Reader().feed(wire.frame([msg], 0.0))
    return list(wire.unpack_chunks(wire.with_audio(back, front_ring)))


async def test_ring_path_equals_inline_path_bit_for_bit_across_wraps():
    host_ring, front_ring, *socks = await ring_pair(3 * 640 * 2 + 100)  # two steps fit, the third wraps
    try:
        rng = np.random.default_rng(1)
        for step in range(7):
            rows = step_rows(rng, step)
            msg = wire.pack_chunks(rows, host_ring)
            assert type(msg.audio) is tuple  # in the ring, not the frame
            assert len(wire.frame([msg], 0.0)) < 640 * 4  # the frame carries spans and latents, not the samples
            via_ring, inline = through(msg, front_ring), through(wire.pack_chunks(rows), None)
            for got, want, row in zip(via_ring, inline, rows, strict=True):
                assert got[1].dtype == want[1].dtype == np.float32
                assert got[1].tobytes() == want[1].tobytes() == row[1].tobytes()
                np.testing.assert_array_equal(got[3], want[3])
                assert got[:1] + got[2:3] + got[4:] == want[:1] + want[2:3] + want[4:]
    finally:
        host_ring.close()
        front_ring.close()
        for s in socks:
            s.close()


async def test_a_full_ring_sends_the_step_inline_and_takes_the_ring_again_once_read():
    host_ring, front_ring, *socks = await ring_pair(3 * 640 * 2)
    try:
        rng = np.random.default_rng(2)
        steps = [step_rows(rng, i) for i in range(4)]
        sent = [wire.pack_chunks(rows, host_ring) for rows in steps[:3]]  # the front reads nothing meanwhile
        assert [type(m.audio) for m in sent] == [tuple, tuple, np.ndarray]
        too_big = wire.pack_chunks(step_rows(rng, 9, n=7), host_ring)  # more than the whole ring
        assert type(too_big.audio) is np.ndarray
        for msg, rows in zip(sent, steps, strict=False):  # every step arrives whole either way
            assert [r[1].tobytes() for r in through(msg, front_ring)] == [r[1].tobytes() for r in rows]
        after = wire.pack_chunks(steps[3], host_ring)  # read: the ring has room again
        assert type(after.audio) is tuple
        assert [r[1].tobytes() for r in through(after, front_ring)] == [r[1].tobytes() for r in steps[3]]
    finally:
        host_ring.close()
        front_ring.close()
        for s in socks:
            s.close()


async def test_no_ring_when_disabled_and_a_span_without_a_ring_is_a_typed_error():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.setblocking(False)
        assert ring.offer(a, 0) is None
        assert await ring.receive(b) is None
    with pytest.raises(EngineError):
        wire.with_audio(wire.Chunks([("r", 4, 0, False, None, 0, None)], (0, 4), []), None)


async def test_steps_cross_a_real_link_through_the_ring_and_match_an_inline_link(engine, tmp_path):
    audio = {}
    for name, ring_s in (("ring", ring.RING_S), ("inline", 0.0)):
        host = EngineHost(engine, LocalStore(), tmp_path / f"{name}.sock", ring_s=ring_s)
        await host.start()
        front = await connect(host.path, 1)
        try:
            chunks = [c async for c in front.engine.generate("Through shared memory.", seed=3, max_length=6)]
            assert chunks[-1].is_last
            audio[name] = np.concatenate([c.audio for c in chunks])
            [conn] = host._links.values()
            assert (conn.ring is not None and conn.ring.write_pos > 0) == (name == "ring")
        finally:
            await front.close()
            await host.close()
    assert audio["ring"].shape == audio["inline"].shape and audio["ring"].dtype == np.float32
    np.testing.assert_allclose(audio["ring"], audio["inline"], rtol=0, atol=1e-5)  # engine state, not the link


async def test_the_ring_is_unmapped_on_both_sides_when_the_link_closes(engine, tmp_path):
    before = maps()
    host = EngineHost(engine, LocalStore(), tmp_path / "close.sock")
    await host.start()
    front = await connect(host.path, 1)
    assert maps() == before + 2  # the host's map and the front's (both in this process here)
    [conn] = host._links.values()
    await front.close()
    deadline = time.monotonic() + 5
    while maps() != before:
        assert time.monotonic() < deadline, maps()
        await asyncio.sleep(0.02)
    assert conn.ring is None
    await host.close()


FRONT = """
import asyncio, sys
from gateway.link import connect

async def main():
    await connect(sys.argv[1], 1)
    print("linked", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_front_killed_9_leaves_no_ring_behind(engine, tmp_path):
    before = maps()
    host = EngineHost(engine, LocalStore(), tmp_path / "kill.sock")
    await host.start()
    front = subprocess.Popen([sys.executable, "-c", FRONT, host.path], env=dict(os.environ), stdout=subprocess.PIPE)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(front.stdout.readline), 60)
        assert line.strip() == b"linked"
        assert maps() == before + 1 and host.fronts() == 1
        front.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 5
        while maps() != before or host._links:
            assert time.monotonic() < deadline, maps()
            await asyncio.sleep(0.02)
    finally:
        front.kill()
        front.wait()
        front.stdout.close()
        await host.close()
