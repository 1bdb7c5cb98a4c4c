"""An encoder process: the turns' `Encoder`s placed on it by the gateway (`gateway.encode_procs`), over one socket
(framing: `gateway.encode_wire`). It holds no GIL the gateway's event loop needs. It exits when the gateway closes its
end of the socket (or dies: the same end of file).

It serves the calls it holds earliest deadline first, and reads what the socket brought (without waiting) between
two steps of work: a call, or a slice of SLICE_FRAMES frames of a chunk's ENCODE (its answer is still one response
with all its packets, the same bytes as one uninterrupted encode). A turn's first frame, sent past the gateway's
window the moment it is asked for, waits for the slice in progress and the first frames ahead of it, not for the
chunks that came before it nor for the rest of the one being encoded. One encoder's calls stay in the order they came
(an encoder is a stream; another encoder's call between two slices does not touch its state). Opening, closing and
counting are done as they are read: a call read after an open finds its encoder, and a turn closed while its call
waits here (cancelled) costs no further encode: the call fails at once, and no one is waiting for it."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import pickle
import select
import signal
import socket
import sys
from collections.abc import Iterator

import numpy as np

from engine.worker_process import map_shared
from gateway import encode_wire as w
from gateway.audio import Encoder

READ_BYTES = 1 << 20
# an ENCODE is served this many frames at a time (~130 us each on the 2-core VM): a call that comes meanwhile with an
# earlier deadline (a turn's first frame) waits for one slice, not for a whole chunk; each slice costs a poll of the
# socket and a turn of the heap (a few us)
SLICE_FRAMES = 1


class Call:
    """One encoder call read off the socket, and how far it is served (an ENCODE goes a slice at a time)."""

    __slots__ = ("op", "urgent", "call_id", "encoder_id", "a1", "a2", "payload", "slices", "packets")

    def __init__(self, op: int, urgent: bool, call_id: int, encoder_id: int, a1: int, a2: int,
                 payload: memoryview) -> None:
        self.op, self.urgent, self.call_id, self.encoder_id = op, urgent, call_id, encoder_id
        self.a1, self.a2, self.payload = a1, a2, payload
        self.slices: Iterator[tuple[list[bytes], bool]] | None = None  # an ENCODE begun: its slices to come
        self.packets: list[bytes] = []  # the slices' packets so far


class Encoders:
    """The encoders open in this process, by the gateway's encoder id; an id whose open failed maps to the error."""

    def __init__(self) -> None:
        self.open: dict[int, Encoder | str] = {}

    def control(self, op: int, call_id: int, encoder_id: int, a1: int, payload: memoryview) -> bytes | None:
        """Open, close or count, done as it is read -> its response (None: the op has none)."""
        if op == w.OPEN:
            try:
                self.open[encoder_id] = Encoder(pickle.loads(payload), a1)
            except Exception as e:  # answered to the turn's first call: its turn ends with the reason
                self.open[encoder_id] = f"{type(e).__name__}: {e}"
            return None
        if op == w.CLOSE:
            self.open.pop(encoder_id, None)
            return None
        return w.response(call_id, [], len(self.open))  # COUNT

    def serve(self, call: Call) -> bytes | None:
        """Serve `call` one step further -> its whole response once it is done (None: an ENCODE has slices left).
        A call whose encoder was closed (its turn is over) fails at once, between two slices too: nobody waits."""
        encoder = self.open.get(call.encoder_id)
        if encoder is None:
            return w.failure(call.call_id, f"no encoder {call.encoder_id} in this process (closed, or never opened)")
        if isinstance(encoder, str):
            return w.failure(call.call_id, encoder)
        try:
            if call.op == w.ENCODE:
                if call.slices is None:  # reads the payload (resamples it all): its slot is free to reuse after
                    call.slices = encoder.encode_slices(np.frombuffer(call.payload, dtype=np.float32), SLICE_FRAMES)
                packets, more = next(call.slices)
                call.packets += packets
                return None if more else w.response(call.call_id, call.packets)
            if call.op == w.HEAD:
                packets, used = encoder.encode_head(np.frombuffer(call.payload, dtype=np.float32), call.a1, call.a2)
                return w.response(call.call_id, packets, used)
            if call.op == w.DRAIN:
                packets, padding = encoder.drain()
                return w.response(call.call_id, packets, padding)
            if call.op == w.FINISH:
                return w.response(call.call_id, encoder.finish())
        except Exception as e:  # the turn's call raises it, as the thread pool hands back an encoder's exception
            return w.failure(call.call_id, f"{type(e).__name__}: {e}")
        return w.failure(call.call_id, f"unknown op {call.op}")


_Key = tuple[float, int]  # a call's place in the heap: deadline, order read


class Pending:
    """The calls read and not done yet: earliest deadline first, then in the order read; a call never goes before an
    earlier one of its encoder (it takes that one's deadline if its own is earlier), one being served included."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Call]] = []
        self._order = itertools.count()
        self._last: dict[int, tuple[float, int]] = {}  # encoder id -> (its newest call's deadline, its calls not done)

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, deadline: float, call: Call) -> None:
        before, count = self._last.get(call.encoder_id, (deadline, 0))
        deadline = max(deadline, before)
        self._last[call.encoder_id] = (deadline, count + 1)
        heapq.heappush(self._heap, (deadline, next(self._order), call))

    def pop(self) -> tuple[_Key, Call]:
        """The next call to serve, and its place: `requeue` it there if it is not done, else `done`."""
        deadline, order, call = heapq.heappop(self._heap)
        return (deadline, order), call

    def requeue(self, key: _Key, call: Call) -> None:
        """A call served in part goes back to its place: only a call that comes before it there goes first."""
        heapq.heappush(self._heap, (key[0], key[1], call))

    def done(self, call: Call) -> None:
        deadline, count = self._last[call.encoder_id]
        if count == 1:
            del self._last[call.encoder_id]
        else:
            self._last[call.encoder_id] = (deadline, count - 1)


def read_requests(buf: bytes, shared: memoryview, encoders: Encoders, pending: Pending, out: list[bytes]) -> int:
    """Take every whole request out of `buf`: control ops done (their responses onto `out`), calls onto `pending`.
    -> the bytes taken."""
    view = memoryview(buf)
    pos = 0
    while len(buf) - pos >= w.REQUEST.size:
        op, urgent, slot, call_id, encoder_id, a1, a2, size, deadline = w.REQUEST.unpack_from(buf, pos)
        if slot == w.INLINE:
            end = pos + w.REQUEST.size + size
            if len(buf) < end:
                break
            payload = view[pos + w.REQUEST.size:end]  # keeps `buf` alive while the call waits
        else:  # the gateway reuses the slot once this call's answer is back: read before answering
            end = pos + w.REQUEST.size
            payload = shared[slot * w.SLOT_BYTES:slot * w.SLOT_BYTES + size]
        pos = end
        if op in (w.OPEN, w.CLOSE, w.COUNT):
            answer = encoders.control(op, call_id, encoder_id, a1, payload)
            if answer is not None:
                out.append(answer)
        else:
            pending.push(deadline, Call(op, bool(urgent), call_id, encoder_id, a1, a2, payload))
    return pos


def serve(sock: socket.socket, shared: memoryview) -> None:
    """Answer requests until the gateway's end closes. Between two steps of work (a call, or a slice of an ENCODE)
    what the socket brought is read, and the earliest deadline goes next. Responses to urgent calls go at once; the
    rest together when nothing is left to serve (one wakeup of the gateway's loop for several)."""
    encoders = Encoders()
    pending = Pending()
    readable = select.poll()
    readable.register(sock, select.POLLIN)
    # read into one buffer made once: `recv(READ_BYTES)` allocates READ_BYTES a call (~16 us on the 2-core VM, a
    # turn's first frame ~130), and a burst's first frames come a read each
    space = bytearray(READ_BYTES)
    buf = b""
    out: list[bytes] = []
    while True:
        # with calls to serve, only what has come already (a poll costs less than a recv that finds nothing)
        if not pending or readable.poll(0):
            try:
                size = sock.recv_into(space, READ_BYTES, socket.MSG_DONTWAIT if pending else 0)
            except BlockingIOError:
                size = -1
            except ConnectionError:
                return
            if size == 0:
                return
            if size > 0:  # a copy: a waiting call's inline payload is a view of `buf`
                buf = buf + space[:size] if buf else bytes(space[:size])
                buf = buf[read_requests(buf, shared, encoders, pending, out):]
        if pending:
            key, call = pending.pop()
            answer = encoders.serve(call)
            if answer is None:
                pending.requeue(key, call)
                continue
            pending.done(call)
            if call.urgent:  # first of what goes: the gateway hands answers over in order, so its turn runs first
                out.insert(0, answer)
            else:
                out.append(answer)
                if pending:
                    continue
        if out:
            sock.sendall(b"".join(out))
            out.clear()


def main(argv: list[str]) -> None:
    """`python -m gateway.encode_child FD SHARED NICE`: serve the socket inherited as FD, with the slots in the
    memory file SHARED, `NICE` levels below the gateway's CPU priority."""
    fd, shared_fd, nice = int(argv[0]), int(argv[1]), int(argv[2])
    # a Ctrl-C, or a service manager's SIGTERM to every process of the service, is the gateway's to act on: it drains
    # its turns (which need us), then stops us (end of file)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if nice > 0:
        with contextlib.suppress(OSError):  # not permitted: encode at the gateway's priority
            os.nice(nice)
    sock = socket.socket(fileno=fd)
    shared = map_shared(shared_fd, populate=True)  # as the gateway's side
    try:
        with contextlib.suppress(ConnectionError):  # the gateway went away mid-answer: nobody to answer to
            serve(sock, memoryview(shared))
    finally:
        sock.close()
    os._exit(0)  # nothing to flush or save: skip the interpreter's teardown, so the gateway's shutdown is quick


if __name__ == "__main__":
    main(sys.argv[1:])
