"""The shared-memory audio ring of one host -> front link, and how its descriptor reaches the front.

A step's audio for a front is ~1 MB at 32 streams: more than a unix socket's send buffer, so inline it crosses in
several write/read rounds, each waiting for both event loops, and is copied ~6 times. Through the ring (the
`engine.ipc.AudioRing` the worker -> pool path uses) the host writes it once and the `Chunks` frame carries only
its span; the front copies it out as the frame arrives and advances the shared read cursor.

The ring is an anonymous memfd (nothing on disk, no privileges): right after accepting a front's connection the
host sends one byte with the descriptor attached (`SCM_RIGHTS`), before asyncio takes the socket; the front reads
that byte with `recvmsg` before it does. The byte is `RING` with a descriptor, or `NO_RING` without one (the host
could not make a ring: the link works inline). Each side maps the file and closes its descriptor at once, so the
memory goes when both have unmapped it: on close, or when a process dies (even by `kill -9`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket

from engine.ipc import AudioRing
from engine.worker_process import map_shared, shared_file

log = logging.getLogger("voxgate.link")

# A new ring's pages are made and mapped on both sides when the link opens, not by the first pass of audio through
# it: there, each 4 KiB page costs a page fault to the host's write and another to the front's read (a step of 32
# streams is ~250 pages), on the event loops that relay a burst's first chunks.
RING = b"R"
NO_RING = b"-"
# seconds of audio per stream of a front's share of the engine's slots. The front copies each step out as it
# arrives, so the ring only holds what its event loop has not come round to yet; a few seconds covers a front
# busy for that long (a burst of turns' setup, a collector pass) before a step has to travel inline.
RING_S = 2.0


def ring_floats(sample_rate: int, max_num_seqs: int, fronts: int, seconds: float = RING_S) -> int:
    """Samples a front's ring holds: `seconds` of audio for each of its share of `max_num_seqs` streams."""
    share = math.ceil(max_num_seqs / max(1, fronts))
    return int(seconds * sample_rate) * max(1, share)


def offer(sock: socket.socket, floats: int) -> AudioRing | None:
    """At the host, on a just-accepted connection: make a ring of `floats` samples and send its descriptor (or
    `NO_RING` when `floats` is 0 or no ring can be made). The host's side of the ring, or None."""
    ring = fd = None
    if floats > 0:
        try:
            fd, shared = shared_file(AudioRing.size_for(floats), populate=True)  # see RING
            ring = AudioRing(shared)
        except OSError as e:  # no memory for it: the link still works, inline
            log.warning("no audio ring for a front link (%s): its audio travels inline", e)
            if fd is not None:
                os.close(fd)
            fd = None
    try:
        if fd is None:
            sock.send(NO_RING)
        else:
            socket.send_fds(sock, [RING], [fd])  # one byte on a fresh socket: never blocks
    except OSError:
        if ring is not None:
            ring.close()
        raise
    finally:
        if fd is not None:
            os.close(fd)
    return ring


async def receive(sock: socket.socket) -> AudioRing | None:
    """At the front, on a connected non-blocking socket: wait for the host's first byte and map the ring it
    carries (None: the host sent none). `ConnectionResetError` if the host closed first."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: readable.done() or readable.set_result(None))
    try:
        await readable
    finally:
        loop.remove_reader(sock.fileno())
    data, fds, _, _ = socket.recv_fds(sock, 1, 1)
    try:
        if not data:
            raise ConnectionResetError("the engine host closed the link before its handshake")
        if data != RING or not fds:
            return None
        return AudioRing(map_shared(fds[0], os.fstat(fds[0]).st_size, populate=True))  # see RING
    finally:
        for fd in fds:
            os.close(fd)
