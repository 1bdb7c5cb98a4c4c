"""An encoder process: the turns' `Encoder`s placed on it by the gateway (`gateway.encode_procs`), one request at a
time in the order they arrive, over one socket (framing: `gateway.encode_wire`). It holds no GIL the gateway's event
loop needs. It exits when the gateway closes its end of the socket (or dies: the same end of file)."""

from __future__ import annotations

import contextlib
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

    def handle(self, op: int, call_id: int, encoder_id: int, a1: int, a2: int, payload: memoryview) -> bytes | None:
        """One request -> its whole response (None: the op has none)."""
        if op == w.OPEN:
            try:
                self.open[encoder_id] = Encoder(pickle.loads(payload), a1)
            except Exception as e:  # answered to the turn's first call: its turn ends with the reason
                self.open[encoder_id] = f"{type(e).__name__}: {e}"
            return None
        if op == w.CLOSE:
            self.open.pop(encoder_id, None)
            return None
        if op == w.COUNT:
            return w.response(call_id, [], len(self.open))
        encoder = self.open.get(encoder_id)
        if encoder is None:
            return w.failure(call_id, f"no encoder {encoder_id} in this process")
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


def serve(sock: socket.socket, shared: memoryview) -> None:
    """Answer requests until the gateway's end closes. Responses to urgent calls go at once, the rest together at the
    end of what one read brought (one wakeup of the gateway's loop for several)."""
    encoders = Encoders()
    buf = b""
    while True:
        try:
            data = sock.recv(READ_BYTES)
        except ConnectionError:
            return
        if not data:
            return
        buf = buf + data if buf else data
        view = memoryview(buf)
        pos, out = 0, []
        while len(buf) - pos >= w.REQUEST.size:
            op, urgent, slot, call_id, encoder_id, a1, a2, size = w.REQUEST.unpack_from(buf, pos)
            if slot == w.INLINE:
                end = pos + w.REQUEST.size + size
                if len(buf) < end:
                    break
                payload = view[pos + w.REQUEST.size:end]
            else:  # the gateway reuses the slot once this call's answer is back: read before answering
                end = pos + w.REQUEST.size
                payload = shared[slot * w.SLOT_BYTES:slot * w.SLOT_BYTES + size]
            answer = encoders.handle(op, call_id, encoder_id, a1, a2, payload)
            pos = end
            if answer is not None:
                out.append(answer)
                if urgent:
                    sock.sendall(b"".join(out))
                    out.clear()
        buf = buf[pos:]
        if out:
            sock.sendall(b"".join(out))


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
