"""An encoder process: the turns' `Encoder`s placed on it by the gateway (`gateway.encode_procs`), over one socket
(framing: `gateway.encode_wire`). It holds no GIL the gateway's event loop needs. It exits when the gateway closes its
end of the socket (or dies: the same end of file).

It serves the calls it holds earliest deadline first, one at a time, and reads what the socket brought (without
waiting) before each: a turn's first frame, sent past the gateway's window the moment it is asked for, waits for the
one encode in progress, not for the chunks that came before it. One encoder's calls stay in the order they came (an
encoder is a stream). Opening, closing and counting are done as they are read: a call read after an open finds its
encoder, and a turn closed while its call waits here (cancelled) costs no encode: the call fails at once, and no one
is waiting for it."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import mmap
import os
import pickle
import signal
import socket
import sys

import numpy as np

from gateway import encode_wire as w
from gateway.audio import Encoder

READ_BYTES = 1 << 20


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

    def handle(self, op: int, call_id: int, encoder_id: int, a1: int, a2: int, payload: memoryview) -> bytes:
        """One encoder call -> its whole response."""
        encoder = self.open.get(encoder_id)
        if encoder is None:
            return w.failure(call_id, f"no encoder {encoder_id} in this process (closed, or never opened)")
        if isinstance(encoder, str):
            return w.failure(call_id, encoder)
        try:
            pcm = np.frombuffer(payload, dtype=np.float32)
            if op == w.ENCODE:
                return w.response(call_id, encoder.encode(pcm))
            if op == w.HEAD:
                packets, used = encoder.encode_head(pcm, a1, a2)
                return w.response(call_id, packets, used)
            if op == w.DRAIN:
                packets, padding = encoder.drain()
                return w.response(call_id, packets, padding)
            if op == w.FINISH:
                return w.response(call_id, encoder.finish())
        except Exception as e:  # the turn's call raises it, as the thread pool hands back an encoder's exception
            return w.failure(call_id, f"{type(e).__name__}: {e}")
        return w.failure(call_id, f"unknown op {op}")


_Call = tuple[int, bool, int, int, int, int, memoryview]  # op, urgent, call id, encoder, a1, a2, payload


class Pending:
    """The calls read but not served yet: earliest deadline first, then in the order read; a call never goes before an
    earlier one of its encoder (it takes that one's deadline if its own is earlier)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, _Call]] = []
        self._order = itertools.count()
        self._last: dict[int, tuple[float, int]] = {}  # encoder id -> (its newest call's deadline here, its calls here)

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, deadline: float, call: _Call) -> None:
        encoder_id = call[3]
        before, count = self._last.get(encoder_id, (deadline, 0))
        deadline = max(deadline, before)
        self._last[encoder_id] = (deadline, count + 1)
        heapq.heappush(self._heap, (deadline, next(self._order), call))

    def pop(self) -> _Call:
        call = heapq.heappop(self._heap)[2]
        deadline, count = self._last[call[3]]
        if count == 1:
            del self._last[call[3]]
        else:
            self._last[call[3]] = (deadline, count - 1)
        return call


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
            pending.push(deadline, (op, bool(urgent), call_id, encoder_id, a1, a2, payload))
    return pos


def serve(sock: socket.socket, shared: memoryview) -> None:
    """Answer requests until the gateway's end closes. Responses to urgent calls go at once; the rest together when
    nothing is left to serve (one wakeup of the gateway's loop for several)."""
    encoders = Encoders()
    pending = Pending()
    buf = b""
    out: list[bytes] = []
    while True:
        try:  # with calls to serve, only what has come already: the next call is chosen among all of them
            data = sock.recv(READ_BYTES, socket.MSG_DONTWAIT if pending else 0)
        except BlockingIOError:
            data = None
        except ConnectionError:
            return
        if data is not None:
            if not data:
                return
            buf = buf + data if buf else data
            buf = buf[read_requests(buf, shared, encoders, pending, out):]
        if pending:
            op, urgent, call_id, encoder_id, a1, a2, payload = pending.pop()
            answer = encoders.handle(op, call_id, encoder_id, a1, a2, payload)
            if urgent:  # first of what goes: the gateway hands answers over in order, so its turn runs first
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
    shared = mmap.mmap(shared_fd, 0)
    try:
        with contextlib.suppress(ConnectionError):  # the gateway went away mid-answer: nobody to answer to
            serve(sock, memoryview(shared))
    finally:
        sock.close()
    os._exit(0)  # nothing to flush or save: skip the interpreter's teardown, so the gateway's shutdown is quick


if __name__ == "__main__":
    main(sys.argv[1:])
