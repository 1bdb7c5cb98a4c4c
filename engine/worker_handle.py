"""One worker process seen from the pool: start it (`engine.worker_process`), talk to it over two pipes, read its
audio ring, notice its end.

Two threads per worker: a sender, so the event loop never blocks on a full pipe, and a reader, which turns each step
into `AudioChunk`s (one copy out of the shared audio ring) and also watches the process sentinel, so a crash wakes it
at once. What the reader receives is handled on the event loop: the handle keeps the worker's readiness and latest
stats and answers its own calls; steps, request failures, fatal errors and the process's end go to the pool.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from engine import ipc
from engine.api import AudioChunk
from engine.config import ModelConfig
from engine.errors import EngineError, InvalidAudio, WorkerCallFailed, WorkerCrashed
from engine.ipc import AudioRing
from engine.worker import WorkerConfig
from engine.worker_process import shared_file, start_worker

RING_SECONDS = 20.0  # shared-memory audio ring per worker, in seconds of audio at the model's rate
RESTART_WINDOW_S = 60.0
MAX_RESTARTS_PER_WINDOW = 5


class WorkerHandle:
    """One worker process and the two threads that talk to it.

    `on_event(handle, msg)` gets the worker's steps (as `ipc.StepAudio`), `ipc.Failed` and `ipc.Fatal` messages;
    `on_exit(handle, error)` is called once when the process ends unless `close` ended it."""

    def __init__(self, index: int, cfg: WorkerConfig, config: ModelConfig, loop: asyncio.AbstractEventLoop,
                 on_event: Callable[[WorkerHandle, ipc.StepAudio | ipc.Failed | ipc.Fatal], None],
                 on_exit: Callable[[WorkerHandle, WorkerCrashed], None]):
        self.index, self.cfg = index, cfg
        self._sample_rate = config.sample_rate
        self._loop, self._on_event, self._on_exit = loop, on_event, on_exit
        ring_floats = int(RING_SECONDS * config.sample_rate) + cfg.max_num_seqs * config.samples_per_patch
        size = AudioRing.size_for(ring_floats)
        ring_fd, shared = shared_file(size)
        self.ring = AudioRing(shared)
        self.process, self.cmd_send, self.results = start_worker(cfg, ring_fd, size, f"voxgate-worker-{index}")
        self.info: dict[str, Any] = {}
        self.stats: dict[str, int] = {}
        self.ready = asyncio.Event()
        self.alive = True
        self.in_flight: set[str] = set()
        self._calls: dict[int, tuple[asyncio.Future, type[EngineError]]] = {}  # call id -> (reply, its failure)
        self._call_ids = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ready_flag = threading.Event()
        self._closed = False
        threading.Thread(target=self._send_loop, daemon=True, name=f"voxgate-send-{index}").start()
        threading.Thread(target=self._read_loop, daemon=True, name=f"voxgate-read-{index}").start()
        # an engine its program never stopped: stop the worker and unmap the ring at exit
        atexit.register(self.close, 2.0)

    def send(self, msg: ipc.Command) -> None:
        """Queue a message for the worker (sent once it is ready)."""
        self._outbox.put(msg)

    def call(self, command: Callable[..., ipc.Command], *args: Any) -> asyncio.Future:
        """Send `command(call id, *args)`, a message the worker replies to; the future gets the reply. A failed
        `ipc.Encode` raises `InvalidAudio` (the audio could not be encoded), any other failed call
        `WorkerCallFailed`."""
        call = next(self._call_ids)
        fut = self._loop.create_future()
        self._calls[call] = fut, InvalidAudio if command is ipc.Encode else WorkerCallFailed
        self.send(command(call, *args))
        return fut

    def tell(self, command: Callable[..., ipc.Command], *args: Any) -> None:
        """Send `command(call id, *args)`, a message the worker replies to, without waiting for the reply."""
        self.send(command(next(self._call_ids), *args))

    def fail_calls(self, error: BaseException) -> None:
        """Fail every call still waiting for its reply."""
        calls, self._calls = self._calls, {}
        for fut, _ in calls.values():
            if not fut.done():
                fut.set_exception(error)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker (killed if it takes longer than `timeout`) and free its ring. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self.alive = False
        self.send(ipc.Stop())
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1.0)
        self._outbox.put(None)
        self.ring.close()

    # ---- threads -----------------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        # Everything queued goes as one list in one pipe message: this thread waits for the GIL behind the event
        # loop once per message, so a burst of requests costs one wait, not one each. None (from close) ends it.
        self._ready_flag.wait()
        while True:
            batch = [self._outbox.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self._outbox.get_nowait())
            stop = None in batch
            if stop:
                batch = batch[:batch.index(None)]
            try:
                if batch:
                    self.cmd_send.send(batch)
            except (OSError, ValueError):  # the process died; the reader reports it
                return
            if stop:
                return

    def _read_loop(self) -> None:
        while True:
            ready = wait([self.results, self.process.sentinel])
            if self.results in ready:
                try:
                    msg = self.results.recv()
                except (EOFError, OSError):
                    break
                if isinstance(msg, ipc.Ready):
                    self._ready_flag.set()
                elif isinstance(msg, ipc.Step):
                    msg = self._read_step(msg)
                if not self._to_loop(self._on_message, msg):
                    break
            elif self.process.sentinel in ready:
                break
        self._outbox.put(None)
        self._to_loop(self._ended)

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> bool:
        """Run `fn(*args)` on the event loop; False once that loop is closed (its program ended without stopping
        the engine: nobody is left to tell)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True

    def _read_step(self, msg: ipc.Step) -> ipc.StepAudio:
        audio = msg.audio
        if isinstance(audio, tuple):  # a span of the shared ring: one copy out, then the slot is free again
            audio = self.ring.read(*audio)
        # AudioChunk's fields in order: keywords would cost this thread (which takes the GIL from the event loop)
        # a third more per chunk
        out = [AudioChunk(audio[c.start:c.end], self._sample_rate, c.index, c.latents, c.is_last, c.stop_reason,
                          c.request_id, c.step)
               for c in msg.chunks]
        return ipc.StepAudio(chunks=out, stats=msg.stats)

    # ---- on the event loop -------------------------------------------------------------------------------
    def _on_message(self, msg: ipc.Ready | ipc.Stats | ipc.Reply | ipc.StepAudio | ipc.Failed | ipc.Fatal) -> None:
        match msg:
            case ipc.Ready(info=info):
                self.info = info
                self.ready.set()
            case ipc.Stats(stats=stats):
                self.stats = stats
            case ipc.Reply(call=call, ok=ok, value=value):
                fut, failure = self._calls.pop(call, (None, WorkerCallFailed))
                if fut is not None and not fut.done():
                    if ok:
                        fut.set_result(value)
                    else:
                        fut.set_exception(failure(value))
            case _:
                if isinstance(msg, ipc.StepAudio):
                    self.stats = msg.stats
                self._on_event(self, msg)

    def _ended(self) -> None:
        if not self.alive:  # closed on purpose
            return
        self.alive = False
        error = WorkerCrashed(f"worker {self.index} ({self.cfg.device}) exited with code {self.process.exitcode}")
        self.fail_calls(error)
        self.close(0.0)  # the process is gone: its ring (the reader, which called this, is done with it) and exit hook
        self._on_exit(self, error)


class CrashWindow:
    """Counts crashes over the last `window_s` (a worker's: `RESTART_WINDOW_S`): more than a limit there
    (`MAX_RESTARTS_PER_WINDOW`) and a process that keeps dying is broken, not unlucky."""

    def __init__(self, window_s: float = RESTART_WINDOW_S) -> None:
        self.window_s = window_s
        self._times: list[float] = []

    def add(self) -> int:
        """Record a crash now; the number of crashes in the window, this one included."""
        now = time.monotonic()
        self._times = [t for t in self._times if now - t < self.window_s] + [now]
        return len(self._times)
