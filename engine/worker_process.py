"""Start a worker as a plain `python -c` subprocess that inherits its pipes and its audio ring as file descriptors.

multiprocessing's spawn would re-run the caller's `__main__` in every worker (so a script without an
`if __name__ == "__main__":` guard starts a second engine inside the worker, and `python - < script.py` cannot be
re-read at all). The worker needs nothing from `__main__`: it imports `engine.worker` and reads its config from the
command pipe. Its ring is an anonymous shared file (memfd on Linux), not a named segment: nothing can leak when
either side dies. The named segments the pool does share (LoRA adapters, `engine.lora.SharedAdapter`) stay on this
process's resource tracker, which the worker is handed as spawn would: a worker attaching one registers it there,
not with a tracker of its own that would unlink it (and warn of a leak) when the worker exits. The tensor-parallel
followers start as plain subprocesses too (`engine.distributed`).
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import weakref
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from typing import Any

from engine.process_env import child_env

ENTRY = "from engine.worker_process import worker_main; worker_main()"


def shared_file(size: int, name: str = "voxgate-ring", populate: bool = False) -> tuple[int, mmap.mmap]:
    """An anonymous file of `size` bytes that a child can map by inheriting its descriptor (`pass_fds`), and this
    side's map (`map_shared`)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    else:  # no memfd (macOS): an unlinked temporary file serves the same way
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, size)
    return fd, map_shared(fd, size, populate)


def map_shared(fd: int, size: int = 0, populate: bool = False) -> mmap.mmap:
    """`fd`'s memory (`size` 0: all of it), shared; `populate`: every page made and mapped now where the system can
    (Linux), so that no first use pays a page fault per 4 KiB (on an event loop relaying a burst, each one counts)."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0))


class WorkerProcess:
    """A started worker process with the `multiprocessing.Process` surface the pool uses (`pid`, `sentinel`,
    `exitcode`, `is_alive`, `join`, `kill`). `sentinel` becomes readable when the process ends."""

    def __init__(self, args: list[str], pass_fds: list[int], name: str):
        life_r, life_w = os.pipe()  # the child holds the write end until it exits: EOF on life_r marks its end
        self.name = name
        self._popen = subprocess.Popen([sys.executable, "-c", ENTRY, *args, str(life_w)], env=child_env(),
                                       pass_fds=[*pass_fds, life_w])
        os.close(life_w)
        self.pid = self._popen.pid
        self.sentinel = life_r
        weakref.finalize(self, os.close, life_r)

    @property
    def exitcode(self) -> int | None:
        """The exit code (negative: the signal that ended it), None while it runs."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        """Wait for the end, at most `timeout` seconds; reaps the process once it has ended."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    def kill(self) -> None:
        self._popen.kill()


def start_worker(cfg: Any, ring_fd: int, ring_size: int, name: str) -> tuple[WorkerProcess, Connection, Connection]:
    """Start a worker on `cfg` (a `WorkerConfig`) writing audio into the shared file `ring_fd`: the process, the
    command pipe's sending end and the results pipe's receiving end."""
    tracker_fd = resource_tracker.getfd()  # started if it is not running yet
    cmd_r, cmd_w = os.pipe()
    res_r, res_w = os.pipe()
    try:
        process = WorkerProcess([str(cmd_r), str(res_w), str(ring_fd), str(ring_size), str(tracker_fd)],
                                [cmd_r, res_w, ring_fd, tracker_fd], name)
    except BaseException:
        for fd in (cmd_r, cmd_w, res_r, res_w):
            os.close(fd)
        raise
    finally:
        os.close(ring_fd)
    os.close(cmd_r)
    os.close(res_w)
    commands, results = Connection(cmd_w, readable=False), Connection(res_r, writable=False)
    # small: it fits the pipe's buffer, so this never waits on the child. The authkey lets the child fetch the
    # tensors torch's reductions pass as shared handles (multiprocessing's resource sharer checks it).
    commands.send((cfg, bytes(multiprocessing.current_process().authkey)))
    return process, commands, results


def worker_main() -> None:
    """Entry point of a worker subprocess: argv holds the inherited descriptors (see `start_worker`)."""
    from engine.ipc import AudioRing
    from engine.worker import run_worker

    # Ctrl-C in a terminal reaches the whole process group, and a service manager's SIGTERM often every process of
    # the service (systemd's default KillMode): the parent decides (it drains its turns, then stops its workers), so
    # the worker neither dies mid-drain (and is restarted) nor prints a second traceback; it ends with its parent
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    cmd_fd, res_fd, ring_fd, ring_size, tracker_fd, life_fd = map(int, sys.argv[1:7])
    for fd in (cmd_fd, res_fd, tracker_fd, life_fd):  # the worker's own subprocesses must not hold them open
        os.set_inheritable(fd, False)
    resource_tracker._resource_tracker._fd = tracker_fd  # the parent's tracker, as multiprocessing.spawn hands it
    ring = AudioRing(mmap.mmap(ring_fd, ring_size))
    os.close(ring_fd)
    commands, results = Connection(cmd_fd, writable=False), Connection(res_fd, readable=False)
    cfg, authkey = commands.recv()
    multiprocessing.current_process().authkey = authkey
    run_worker(cfg, commands, results, ring)
