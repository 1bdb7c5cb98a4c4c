"""Opus encoding in child processes (`VOXGATE_ENCODE_PROCS`): each turn's `Encoder` lives in one encoder process
(`gateway.encode_child`) for the turn's life, and the turn holds a `ProcEncoder`, its proxy here.

Encode threads in the gateway process share its GIL with the event loop: each chunk takes and drops it several times
(numpy, the heap, the loop's wakeup), and at hundreds of streams those acquisitions convoy with the loop thread, which
drops the GIL at every syscall, so the loop waits while cores are free. A process has a GIL of its own.

The calls go over one socket pair per process, in a hand-written binary framing (`gateway.encode_wire`) read with
`loop.add_reader`: `multiprocessing.Queue` pickles every item and runs a feeder thread that takes the GIL per item,
the very cost this removes; here a chunk costs the parent a copy into memory both processes share, a header in one
write shared by the calls queued in one loop iteration, and its share of one read that brings back results for many
turns.

Earliest deadline first, as the thread pool (`gateway.offload`): each process's calls wait here in a heap by deadline
(queued at + urgency), and only WINDOW of them are in the process at a time, so a chunk queued for a listener with
audio left can still be overtaken here. An urgent call (its listener runs out within `URGENT` ms: a turn's first frame
has no audio before it) goes straight into the process, past the window, and the process serves the calls it holds
earliest deadline first, a chunk a frame at a time (`gateway.encode_child`): a first frame waits for the frame being
encoded there, not for a free place in the window, the chunks ahead of it or the rest of the one in progress. A turn
is placed on the process with the fewest open encoders. A process that dies (or answers nothing for STALL_S) fails its
own turns' calls (`EncoderProcessLost`, a protocol error the turn ends with) and is replaced; the others go on.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import heapq
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from engine.process_env import child_env
from engine.worker_process import shared_file
from gateway import encode_wire as w
from gateway.audio import OutputFormat
from gateway.offload import URGENT
from gateway.protocol import ErrorCode, ProtocolError
from gateway.settings import GatewaySettings

log = logging.getLogger("voxgate.encode_procs")

WINDOW = 4  # calls in one process at a time: enough to keep it busy while its results travel back
# a call unanswered this long (a chunk takes ~1 ms) means the process is wedged: it is killed and replaced like a dead
# one, so its turns end with an error instead of waiting for ever
STALL_S = 5.0
READ_BYTES = 1 << 16  # many responses (a chunk's ~1-3 kB); more would make each read allocate a large block
# an encoder process runs no BLAS: numpy need not start a thread per core in each of them
CHILD_THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class EncoderProcessLost(ProtocolError):
    """The process holding this turn's encoder stopped: its audio cannot go on (the turn ends with this error)."""

    def __init__(self, detail: str):
        super().__init__(ErrorCode.ENGINE_ERROR, f"the audio encoder process stopped ({detail}); retry the turn")


class EncodeFailed(RuntimeError):
    """The encoder raised in its process (the text is its exception's type and message)."""


# deadline, seq, op, encoder, a1, a2, payload, on_answer, fut
_Call = tuple[float, int, int, int, int, int, Any, Callable[[Any], None] | None, asyncio.Future]


class _Process:
    """One encoder process, its socket and its calls: waiting here (a heap), in the process (`sent`)."""

    def __init__(self, host: EncodeProcs, loop: asyncio.AbstractEventLoop):
        self.host, self.loop = host, loop
        mine, theirs = socket.socketpair()
        try:  # mapped now: a slot's first use (a burst's first chunks) takes no page fault per 4 KiB
            shared_fd, self.shared = shared_file(w.SLOTS * w.SLOT_BYTES, "voxgate-encode-slots", populate=True)
        except BaseException:  # no shared memory (e.g. /dev/shm full): nothing of this process is left open
            mine.close()
            theirs.close()
            raise
        try:
            self.proc = subprocess.Popen(  # this checkout's gateway first on the path (`child_env`), as the engine's
                [sys.executable, "-m", "gateway.encode_child", str(theirs.fileno()), str(shared_fd), str(host.nice)],
                pass_fds=(theirs.fileno(), shared_fd), stdin=subprocess.DEVNULL, env={**child_env(), **CHILD_THREADS})
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
            os.close(shared_fd)  # the mapping keeps the memory
        self.free_slots = list(range(w.SLOTS))  # a call in the process holds one while any is free, else goes inline
        mine.setblocking(False)
        self.sock = mine
        self.fd = mine.fileno()
        self.alive = True
        self.encoders = 0  # open encoders placed here
        self.queue: list[_Call] = []  # a heap: earliest (deadline, arrival) first
        # call id -> its future, slot, when it went out, whether it holds a place in the window and what its answer
        # is handed to as soon as it is read (`ProcEncoder.head_now`), for the calls in the process now
        self.sent: dict[int, tuple[asyncio.Future, int, float, bool, Callable[[Any], None] | None]] = {}
        self.windowed = 0  # calls in the process that hold a place in the window
        self.unsent = bytearray()  # what the socket did not take yet
        self.partial = b""  # the start of a response not yet whole
        loop.add_reader(self.fd, self.read)
        self._watch = loop.call_later(host.stall_s / 2, self._check_stall)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def submit(self, op: int, encoder_id: int, a1: int, a2: int, payload: Any, urgency: float,
               on_answer: Callable[[Any], None] | None = None) -> asyncio.Future:
        """Queue a call (`urgency`: ms until its listener runs out of audio); an urgent one goes to the process now.
        `on_answer` is called with the answer right where it is read, after the future's result is set."""
        fut = self.loop.create_future()
        if not self.alive:
            fut.set_exception(EncoderProcessLost(f"pid {self.pid} is gone"))
            return fut
        now = time.monotonic() * 1000.0
        call = (now + urgency, next(self.host.seq), op, encoder_id, a1, a2, payload, on_answer, fut)
        if urgency < URGENT:  # written now, not after this iteration's other tasks: the process may be idle already
            self._write(self._request(call, now, windowed=False))
        else:
            heapq.heappush(self.queue, call)
            self.host.wake(self)
        return fut

    def send_now(self, op: int, encoder_id: int, a1: int = 0, payload: bytes = b"") -> None:
        """A call without an answer (open, close): straight out, ahead of the heap (it concerns no queued call)."""
        self._write([w.request(op, False, 0, encoder_id, a1, 0, len(payload)), payload])

    def pump(self) -> None:
        """Move the most urgent queued calls into the process while the window has room (and any call that became
        urgent while it waited, past the window), in one write."""
        if not self.alive:
            return
        parts: list[Any] = []
        now = time.monotonic() * 1000.0
        while self.queue:
            urgent = self.queue[0][0] - now < URGENT
            if not urgent and self.windowed >= WINDOW:
                break
            call = heapq.heappop(self.queue)
            if call[-1].done():  # its turn was cancelled while the call waited
                continue
            parts += self._request(call, now, windowed=not urgent)
        if parts:
            self._write(parts)

    def _request(self, call: _Call, now: float, windowed: bool) -> list[Any]:
        """A call's request (header, and payload when inline), its samples put in a free slot; the call is out."""
        deadline, seq, op, encoder_id, a1, a2, payload, on_answer, fut = call
        call_id = seq & 0xFFFFFFFF
        size = 0 if payload is None else payload.nbytes
        slot = w.INLINE
        if size and size <= w.SLOT_BYTES and self.free_slots:
            slot = self.free_slots.pop()
            self.shared[slot * w.SLOT_BYTES:slot * w.SLOT_BYTES + size] = payload
        parts: list[Any] = [w.request(op, deadline - now < URGENT, call_id, encoder_id, a1, a2, size, slot, deadline)]
        if slot == w.INLINE and size:
            parts.append(payload)
        self.sent[call_id] = (fut, slot, now, windowed, on_answer)
        self.windowed += windowed
        return parts

    def _write(self, parts: list[Any]) -> None:
        if not self.alive:
            return
        if not self.unsent:
            try:
                done = self.sock.sendmsg(parts)
            except BlockingIOError:
                done = 0
            except OSError as e:
                self.lost(f"write: {e}")
                return
            total = sum(memoryview(p).nbytes for p in parts)
            if done == total:
                return
            rest = b"".join(parts)[done:]
            self.unsent += rest
            self.loop.add_writer(self.fd, self._writable)
        else:  # behind what is already waiting for the socket
            for p in parts:
                self.unsent += p

    def _check_stall(self) -> None:
        if not self.alive:
            return
        now = time.monotonic() * 1000.0
        if self.sent and now - min(sent[2] for sent in self.sent.values()) > self.host.stall_s * 1000.0:
            self.lost(f"no answer in {self.host.stall_s:g} s")
            return
        self._watch = self.loop.call_later(self.host.stall_s / 2, self._check_stall)

    def _writable(self) -> None:
        try:
            done = self.sock.send(self.unsent)
        except BlockingIOError:
            return
        except OSError as e:
            self.lost(f"write: {e}")
            return
        del self.unsent[:done]
        if not self.unsent:
            self.loop.remove_writer(self.fd)

    def read(self) -> None:
        """Take the answers the socket holds now (the loop's reader; `ProcEncoder.collect` between tasks)."""
        try:
            data = self.sock.recv(READ_BYTES)
        except BlockingIOError:
            return
        except OSError as e:
            self.lost(f"read: {e}")
            return
        if not data:
            self.lost("end of file")
            return
        try:
            self._answers(self.partial + data if self.partial else data)
        except Exception:  # a response that cannot be read: nothing after it can be trusted
            log.exception("encoder process %s: unreadable response", self.pid)
            self.lost("unreadable response")
            return
        self.pump()

    def _answers(self, data: bytes) -> None:
        """Hand every whole response in `data` to its call; keep the rest for the next read."""
        pos, header = 0, w.RESPONSE.size
        while len(data) - pos >= header:
            call_id, count, value, size = w.RESPONSE.unpack_from(data, pos)
            end = pos + header + size
            if len(data) < end:
                break
            fut, slot, _, windowed, on_answer = self.sent.pop(call_id, (None, w.INLINE, 0.0, False, None))
            if slot != w.INLINE:  # the process answered: it is done with the slot
                self.free_slots.append(slot)
            self.windowed -= windowed
            if fut is not None and not fut.done():
                if count == w.ERROR:
                    fut.set_exception(EncodeFailed(data[pos + header:end].decode("utf-8", "replace")))
                else:
                    result = (w.packets_of(data, pos + header, count), value)
                    fut.set_result(result)
                    if on_answer is not None:
                        self._hand_answer(on_answer, result)
            pos = end
        self.partial = data[pos:]

    def _hand_answer(self, on_answer: Callable[[Any], None], result: Any) -> None:
        try:
            on_answer(result)
        except Exception:  # the caller's bug: its future has the answer still, and the other answers must go on
            log.exception("encoder process %s: an answer's hook failed", self.pid)

    def lost(self, why: str) -> None:
        """The process is gone (or its socket broke, so it can serve nothing): kill and reap it, fail its calls,
        start a replacement."""
        if not self.alive:
            return
        self.detach()
        self.proc.kill()  # a no-op for one that has exited
        with contextlib.suppress(subprocess.TimeoutExpired):  # stuck in the kernel: Popen reaps it later
            self.proc.wait(1.0)
        why = f"pid {self.pid}: {why}, exit status {self.proc.returncode}"
        log.warning("encoder process lost (%s): its %d turns end; a new one starts", why, self.encoders)
        self.fail_calls(why)
        self.host.replace(self)

    def fail_calls(self, why: str) -> None:
        """Every call sent or waiting fails: the process that would answer is gone."""
        for fut in [*(sent[0] for sent in self.sent.values()), *(call[-1] for call in self.queue)]:
            if not fut.done():
                fut.set_exception(EncoderProcessLost(why))
        self.sent.clear()
        self.windowed = 0
        self.queue.clear()

    def detach(self) -> None:
        """Stop reading and writing; the process sees end of file and exits."""
        if not self.alive:
            return
        self.alive = False
        self._watch.cancel()
        if not self.loop.is_closed():
            self.loop.remove_reader(self.fd)
            self.loop.remove_writer(self.fd)
        self.sock.close()

    def kill(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the process to end, then kill it (a wedged one must not hold us)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("encoder process %s did not exit in %.1f s: killed", self.pid, timeout)
            self.proc.kill()
            self.proc.wait()


class ProcEncoder:
    """One turn's encoder in an encoder process (a `gateway.encode_site.TurnEncoder`). Its calls are awaited one
    after the other (an encoder is a stream), so at most one is out at a time: an urgent call, sent past the queue,
    cannot overtake one of its own encoder's still queued here. (A cancelled call may still be in the process: the
    process serves an encoder's calls in the order they came.)"""

    offloaded = True

    def __init__(self, process: _Process, encoder_id: int):
        self._process, self._id = process, encoder_id
        self._closed = False
        self._out: asyncio.Future | None = None  # the call out now, if any

    def _call(self, op: int, pcm: np.ndarray | None, urgency: float, a1: int = 0, a2: int = 0,
              on_answer: Callable[[Any], None] | None = None) -> asyncio.Future:
        """The call made now; its future, to await."""
        if not self._process.alive:
            raise EncoderProcessLost(f"pid {self._process.pid} is gone")
        if pcm is not None and np.ndim(pcm) != 1:
            raise ValueError(f"pcm: expected mono samples (1-D), got shape {np.shape(pcm)}")
        if self._out is not None and not self._out.done():
            raise RuntimeError("an encoder takes one call at a time: await the last one first")
        payload = None if pcm is None else memoryview(np.ascontiguousarray(pcm, dtype=np.float32)).cast("B")
        self._out = self._process.submit(op, self._id, a1, a2, payload, urgency, on_answer)
        return self._out

    def head_now(self, pcm: np.ndarray, frames: int, step: int, urgency: float,
                 on_answer: Callable[[tuple[list[bytes], int]], None] | None = None) -> asyncio.Future | None:
        """`encode_head`'s call made now, without a task: its future, to await (or cancel) later; None when it
        cannot be made now (the process is gone, a call is out, not mono samples): `encode_head` then says why.
        `on_answer` gets the answer as soon as it is read (not if it is an error, or the future was cancelled)."""
        if self._closed or not self._process.alive or np.ndim(pcm) != 1 or (
                self._out is not None and not self._out.done()):
            return None
        return self._call(w.HEAD, pcm, urgency, frames, step, on_answer)

    def collect(self) -> None:
        """Take what the process has answered so far, now, without waiting for the loop's next look at its socket:
        a burst's tasks all run in one loop iteration, and answers that came meanwhile are read only after it."""
        if self._process.alive:
            self._process.read()

    async def encode(self, pcm: np.ndarray, urgency: float) -> list[bytes]:
        packets, _ = await self._call(w.ENCODE, pcm, urgency)
        return packets

    async def encode_head(self, pcm: np.ndarray, frames: int, step: int, urgency: float) -> tuple[list[bytes], int]:
        result: tuple[list[bytes], int] = await self._call(w.HEAD, pcm, urgency, frames, step)
        return result

    async def drain(self, urgency: float) -> tuple[list[bytes], int]:
        result: tuple[list[bytes], int] = await self._call(w.DRAIN, None, urgency)
        return result

    async def finish(self, urgency: float) -> list[bytes]:
        packets, _ = await self._call(w.FINISH, None, urgency)
        return packets

    def close(self) -> None:
        """Free the encoder in its process (once; a no-op when the process is gone)."""
        if self._closed:
            return
        self._closed = True
        self._process.encoders -= 1
        self._process.send_now(w.CLOSE, self._id)


class EncodeProcs:
    """`procs` encoder processes serving the turns of one event loop (a `gateway.encode_site.EncodeSite`); started
    on the first `open`. `close()` stops them."""

    def __init__(self, procs: int, nice: int | None = None, stall_s: float = STALL_S):
        self.procs = max(1, procs)
        self.stall_s = stall_s
        self.nice = GatewaySettings.from_env().encode_nice if nice is None else nice
        self.seq = itertools.count(1)
        self._ids = itertools.count(1)
        self._processes: list[_Process] = []
        self._dirty: set[_Process] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    @property
    def pids(self) -> list[int]:
        """The live processes' ids (tests, diagnostics)."""
        return [p.pid for p in self._processes if p.alive]

    def start(self) -> None:
        """Start the processes not running yet (`open` does it too; a serving process does it at start)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError("EncodeProcs serves the event loop that started it")
        while len(self._processes) < self.procs:
            self._processes.append(_Process(self, loop))

    def open(self, fmt: OutputFormat, input_rate: int) -> ProcEncoder:
        """A new encoder for `fmt` from `input_rate` samples, in the process with the fewest open now."""
        if self.closed:
            raise EncoderProcessLost("the gateway is shutting down")
        if len(self._processes) < self.procs:
            self.start()
        process = min(self._processes, key=lambda p: p.encoders)
        encoder_id = next(self._ids) & 0xFFFFFFFF
        process.encoders += 1
        process.send_now(w.OPEN, encoder_id, input_rate, pickle.dumps(fmt))
        return ProcEncoder(process, encoder_id)

    def wake(self, process: _Process) -> None:
        """`process` has new calls: send them once every task made ready by the same event has queued its own."""
        if not self._dirty:
            assert self._loop is not None
            self._loop.call_soon(self._flush)
        self._dirty.add(process)

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for process in dirty:
            process.pump()

    def replace(self, process: _Process) -> None:
        """A lost process's place goes to a new one (its turns are not moved: their encoder state died with it)."""
        if process in self._processes:
            self._processes.remove(process)
        self._dirty.discard(process)
        if not self.closed and self._loop is not None and not self._loop.is_closed():
            self._processes.append(_Process(self, self._loop))

    async def open_counts(self) -> list[int]:
        """The encoders each live process holds, as it counts them (after every call sent before this one)."""
        futures = [p.submit(w.COUNT, 0, 0, 0, None, urgency=float("inf")) for p in self._processes if p.alive]
        return [value for _, value in await asyncio.gather(*futures)]

    def close(self, timeout: float = 2.0) -> None:
        """Stop the processes: each sees end of file and exits; one that has not within `timeout` seconds (in all)
        is killed. Calls still waiting fail."""
        self.closed = True
        processes, self._processes = self._processes, []
        for p in processes:
            p.detach()
        deadline = time.monotonic() + timeout
        for p in processes:
            p.kill(max(0.0, deadline - time.monotonic()))
            p.fail_calls("the gateway is shutting down")


_shared: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EncodeProcs] = weakref.WeakKeyDictionary()


def shared_procs(procs: int) -> EncodeProcs:
    """The running loop's encoder processes (made on first use; a closed set is replaced by a new one)."""
    loop = asyncio.get_running_loop()
    host = _shared.get(loop)
    if host is None or host.closed:
        host = _shared[loop] = EncodeProcs(procs)
    return host


def shared_pids() -> list[int]:
    """The running loop's live encoder processes (none before its first Opus turn, or with the thread pool)."""
    host = _shared.get(asyncio.get_running_loop())
    return [] if host is None else host.pids


def close_shared(timeout: float = 2.0) -> None:
    """Stop the running loop's encoder processes, if any (the server's shutdown; a new turn would start others)."""
    host = _shared.pop(asyncio.get_running_loop(), None)
    if host is not None:
        host.close(timeout)


def _close_all() -> None:
    for host in list(_shared.values()):
        host.close(timeout=1.0)


atexit.register(_close_all)  # no encoder process outlives the gateway, whatever way it ends
