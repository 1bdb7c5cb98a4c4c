"""`voxgate serve --fronts N`: N gateway processes ("fronts") serve one port over the one engine of this process.

Each front has its own event loop (a burst of turns is spread over N loops): it connects to the `EngineHost` this
process runs (`gateway.link`), builds the normal application over the link's engine and store, and listens on the
shared port with SO_REUSEPORT (the kernel spreads the connections). This process (the host) restores stored voices and
adapters into the engine once, starts the fronts, restarts one that dies, and on SIGTERM/SIGINT has every front drain
as one gateway does, then closes the link. A front whose host goes away (even SIGKILLed) exits within seconds: its
control pipe to the host reads end-of-file. The node's /metrics is every front's (prometheus_client multiprocess mode),
its session limit holds across fronts (a store lease per session under the node's own owner id, next to the per-key
ones), and each response says which front answered (`X-Voxgate-Front`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.gateway_config import GatewayConfig
from gateway.gc_policy import settle_gc
from gateway.offload import usable_cores
from gateway.settings import GatewaySettings, fronts_count

if TYPE_CHECKING:
    from aiohttp import web

    from gateway.server import ServerConfig
    from gateway.store import Store

log = logging.getLogger("voxgate.fronts")

FRONT_HEADER = "X-Voxgate-Front"  # which front (0..N-1) answered a request
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own variable: a front counts in that directory
START_TIMEOUT_S = 300.0  # a front that is not serving by then is stuck (imports and the link take seconds)
ORPHAN_EXIT_S = 2.0  # a front whose host is gone closes what it can within this, then exits regardless
STOP_GRACE_S = 10.0  # beyond the drain's shutdown_timeout_s, before a front that has not exited is killed


def front_count(flag: str | int | None) -> int:
    """How many fronts serve: `--fronts` when given, else VOXGATE_FRONTS; auto: one below 8 cores (laptops, CI),
    else half the cores, at most 8 (at 256 sessions opened at once, 8 fronts on 16 cores cut a turn's wait for
    its handler to half of 4 fronts', and cost nothing at steady load)."""
    value = fronts_count(str(flag)) if flag is not None else GatewaySettings.from_env().fronts
    if value is not None:
        return value
    cores = usable_cores()
    return 1 if cores < 8 else min(8, cores // 2)


@dataclass(frozen=True)
class FrontArgs:
    """What every front builds its application from (pickled into the front processes)."""

    config: ServerConfig
    # the rest as `voxgate serve` takes them (defaults: GatewayConfig's)
    api_keys_file: str | None = GatewayConfig.api_keys_file
    api_keys_from_store: bool = GatewayConfig.api_keys_from_store
    log_level: str = GatewayConfig.log_level
    log_json: bool = GatewayConfig.log_json


class FrontsError(Exception):
    """A front could not start (the message says which and why)."""


@dataclass
class _Front:
    index: int
    process: Any  # multiprocessing.Process (spawn context)
    control: Connection  # the host's end of the front's control pipe
    pid: int = 0


class Fronts:
    """The host's side: start N fronts on host:port over `engine` and `store`, restart one that dies, stop them."""

    def __init__(self, engine: Any, store: Store, *, fronts: int, host: str, port: int, front_args: FrontArgs,
                 app_hook: str | None = None):
        self.engine, self.store, self.count, self.host, self.port = engine, store, fronts, host, port
        self.app_hook = app_hook
        self._dir = Path(tempfile.mkdtemp(prefix="voxgate-fronts-"))  # mode 0700: the link's socket lives here
        self._metrics_dir = self._dir / "metrics"
        self._metrics_dir.mkdir()
        # the node's sessions also hold leases under an owner id of its own, so max_sessions holds across fronts
        config = replace(front_args.config, node_lease_owner=f"voxgate-node:{uuid.uuid4().hex}")
        self.args = replace(front_args, config=config)
        self._context = multiprocessing.get_context("spawn")  # never fork a process with CUDA and threads
        self._fronts: list[_Front | None] = [None] * fronts
        self._reserved: socket.socket | None = None
        self._link_host: Any = None
        # more than this many front crashes within the window stop the node
        self._max_crashes, crash_window_s = GatewaySettings.from_env().front_crashes
        self._crashes = _crash_window(crash_window_s)
        self._stopping = False
        self.failure: str | None = None  # set when a front kept dying: the node stops

    async def start(self, progress: Callable[[str], None] = log.info) -> int:
        """Restore stored items into the engine, serve the link, start every front and wait until each serves;
        returns the port. FrontsError (everything started is stopped) when one cannot start."""
        from gateway.link import EngineHost
        from gateway.voices import Catalog

        try:
            self._reserved = _reserve_port(self.host, self.port)
            self.port = self._reserved.getsockname()[1]
            if not self.store.shared:  # a shared store's items are loaded on first use
                await Catalog(self.engine, self.store).restore(progress)
            self._link_host = EngineHost(self.engine, self.store, self._dir / "link.sock", fronts=self.count)
            await self._link_host.start()
            spawns = [asyncio.create_task(self._spawn(i)) for i in range(self.count)]
            try:
                await asyncio.gather(*spawns)
            finally:  # one could not start: the others stop waiting (close stops their processes)
                for task in spawns:
                    task.cancel()
                await asyncio.gather(*spawns, return_exceptions=True)
        except BaseException:
            await self.close()
            raise
        self._reserved.close()  # every front listens: the port no longer needs holding
        self._reserved = None
        return self.port

    async def _spawn(self, index: int) -> None:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(
            target=run_front, name=f"voxgate-front-{index}", daemon=False,
            args=(index, self.count, str(self._dir / "link.sock"), str(self._metrics_dir), self.host, self.port,
                  self.args, self.app_hook, theirs))
        with _environ(METRICS_DIR_ENV, str(self._metrics_dir)):  # read by prometheus_client when the front imports it
            process.start()
        theirs.close()
        front = _Front(index, process, ours)
        self._fronts[index] = front
        try:
            message = await asyncio.wait_for(_receive(ours), START_TIMEOUT_S)
        except TimeoutError:
            message = ("error", f"not serving after {START_TIMEOUT_S:.0f} s")
        if not message or message[0] != "ready":
            _kill(process)
            why = message[1] if message else f"exited with code {process.exitcode} while starting"
            raise FrontsError(f"front {index}: {why}")
        front.pid = message[1]
        log.info("front %d serving (pid %d)", index, front.pid)

    async def supervise(self, stop: asyncio.Event) -> None:
        """Restart a front that exits until `stop` is set; fronts dying more than N times within S seconds
        (`GatewaySettings.front_crashes`) set `failure` and `stop` (the node is broken, not unlucky)."""
        watchers = [asyncio.create_task(self._watch(i, stop)) for i in range(self.count)]
        try:
            await stop.wait()
        finally:
            self._stopping = True
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)

    async def _watch(self, index: int, stop: asyncio.Event) -> None:
        while not stop.is_set():
            front = self._fronts[index]
            assert front is not None
            await _readable(front.process.sentinel)
            front.process.join()
            if self._stopping:
                return
            front.control.close()
            _forget_metrics(front.pid, self._metrics_dir)
            crashes = self._crashes.add()
            if crashes > self._max_crashes:
                self.failure = (f"fronts died {crashes} times within {self._crashes.window_s:g} s (more than "
                                f"{self._max_crashes}: broken, not unlucky)")
                log.error("front %d (pid %d) exited with code %s; not restarting it: %s", index, front.pid,
                          front.process.exitcode, self.failure)
                stop.set()
                return
            log.error("front %d (pid %d) exited with code %s; restarting it", index, front.pid,
                      front.process.exitcode)
            try:
                await self._spawn(index)
            except FrontsError as e:
                log.error("%s", e)  # counted as the next crash when the watch comes round

    async def close(self) -> None:
        """Every front drains (SIGTERM: turns in progress get shutdown_timeout_s) and exits; then the link closes and
        the temporary directory goes. Fronts that do not exit in time are killed."""
        self._stopping = True
        running = [f for f in self._fronts if f is not None and f.process.is_alive()]
        for front in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(front.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.args.config.shutdown_timeout_s + STOP_GRACE_S
        for front in running:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_readable(front.process.sentinel), max(0.0, deadline - time.monotonic()))
            # its sentinel closes as the process ends, a moment before the process can be reaped
            await asyncio.to_thread(front.process.join, 2.0)
            if front.process.is_alive():
                log.error("front %d (pid %d) did not exit in time: killed", front.index, front.pid)
                _kill(front.process)
            if front.process.exitcode:
                log.warning("front %d (pid %d) exited with code %s", front.index, front.pid, front.process.exitcode)
        for front in self._fronts:
            if front is not None:
                front.control.close()
        if self._link_host is not None:
            await self._link_host.close()
            self._link_host = None
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None
        shutil.rmtree(self._dir, ignore_errors=True)


async def serve_fronts(engine: Any, store: Store, *, fronts: int, host: str, port: int, front_args: FrontArgs,
                       app_hook: str | None = None, announce: Callable[[int], None] | None = None,
                       progress: Callable[[str], None] = log.info) -> int:
    """Serve host:port with `fronts` gateway processes over `engine` and `store` (both started, owned by the caller)
    until SIGTERM or SIGINT, then drain every front and close the link. `announce(port)` runs once every front serves;
    `app_hook` ("module:function") is called with each front's application before it serves (extra routes). Returns
    the exit status: 0, or 1 when a front kept dying. FrontsError when they cannot start."""
    node = Fronts(engine, store, fronts=fronts, host=host, port=port, front_args=front_args, app_hook=app_hook)
    bound = await node.start(progress)
    settle_gc()  # this loop relays every front's audio: the collector as a front runs it
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if announce is not None:
            announce(bound)
        await node.supervise(stop)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if node.failure is None:
            progress(f"draining {fronts} fronts (/readyz 503, new sessions refused, turns in progress get up to "
                     f"{front_args.config.shutdown_timeout_s:g} s)")
        await node.close()
    if node.failure is not None:
        log.error("stopping: %s", node.failure)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------------- a front


def run_front(index: int, fronts: int, link_path: str, metrics_dir: str, host: str, port: int, args: FrontArgs,
              app_hook: str | None, control: Connection) -> None:
    """A front process's body (the spawn target): serve until SIGTERM/SIGINT or until the host goes away."""
    from gateway.log_setup import setup_logging

    setup_logging(args.log_level, args.log_json)
    try:
        code = asyncio.run(_serve_front(index, fronts, link_path, metrics_dir, host, port, args, app_hook, control))
    except KeyboardInterrupt:
        code = 0
    sys.exit(code)


async def _serve_front(index: int, fronts: int, link_path: str, metrics_dir: str, host: str, port: int,
                       args: FrontArgs, app_hook: str | None, control: Connection) -> int:
    from gateway.auth import Auth
    from gateway.encode_site import start_encoders
    from gateway.http.readiness import drain
    from gateway.link import connect
    from gateway.metrics import GatewayMetrics
    from gateway.offload import share_cores
    from gateway.server import create_app, start_server

    share_cores(fronts)
    stop, host_lost = asyncio.Event(), asyncio.Event()

    def lost() -> None:
        host_lost.set()
        stop.set()

    try:
        link = await connect(link_path, index, on_lost=lost)
    except Exception as e:  # the host is gone or refused us: say why, the host logs it
        control.send(("error", f"cannot connect to the engine host: {e}"))
        return 1
    try:
        auth = Auth.from_options(args.api_keys_file, args.api_keys_from_store)
        app = create_app(link.engine, args.config, auth=auth,
                         metrics=GatewayMetrics(node_dir=metrics_dir), compat=True, store=link.store)
        app.on_response_prepare.append(_tag(index))
        if app_hook:
            _hook(app_hook)(app)
        runner, _ = await start_server(app, host, port, shutdown_timeout_s=args.config.shutdown_timeout_s + 5,
                                       reuse_port=True)
    except Exception as e:
        control.send(("error", f"cannot start: {e}"))
        await link.close()
        return 1
    start_encoders()
    settle_gc()
    control.send(("ready", os.getpid()))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host_gone = asyncio.create_task(_receive(control))  # the host sends nothing: this ends when its end closes
    host_gone.add_done_callback(lambda task: task.cancelled() or lost())
    await stop.wait()
    if host_lost.is_set():  # no engine to drain towards: close what closes quickly, then go
        log.error("front %d: the engine host went away; exiting", index)
        loop.call_later(ORPHAN_EXIT_S, os._exit, 1)
    else:
        host_gone.cancel()
        await drain(app)  # still listening: the other fronts serve on, refused handshakes are retried
    await runner.cleanup()
    await link.close()
    return 1 if host_lost.is_set() else 0


def _tag(index: int) -> Callable[[web.Request, web.StreamResponse], Any]:
    value = str(index)

    async def tag(_: web.Request, response: web.StreamResponse) -> None:
        response.headers[FRONT_HEADER] = value

    return tag


def _hook(spec: str) -> Callable[[web.Application], Any]:
    """The function "module:function" names (ValueError when it does not)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"app hook {spec!r}: expected module:function")
    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------------------------------------------- helpers


def _crash_window(window_s: float) -> Any:
    """The engine workers' crash counter (`CrashWindow`), over `window_s`, for the fronts (imported here, in the host
    alone: a front imports this module and loads no torch)."""
    from engine.worker_handle import CrashWindow

    return CrashWindow(window_s)


async def _readable(fd: int) -> None:
    """Until `fd` is readable (a process sentinel once the process ended, a pipe with data or at its end)."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


async def _receive(conn: Connection) -> Any:
    """The next message on a control pipe; None at its end (the other process closed it or exited)."""
    await _readable(conn.fileno())
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _kill(process: Any) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    process.join(5)


def _forget_metrics(pid: int, metrics_dir: Path) -> None:
    """A dead front's sessions gauge leaves the node's sum (its counters stay: they are the node's history)."""
    from prometheus_client import multiprocess

    if pid:
        multiprocess.mark_process_dead(pid, str(metrics_dir))


def _reserve_port(host: str, port: int) -> socket.socket:
    """Hold host:port for the fronts (port 0: a free one): OSError when another server listens there. A plain bind
    first, so a server already listening with SO_REUSEPORT is not silently joined; then a SO_REUSEPORT bind that the
    fronts' listening sockets share (it takes no connections: it never listens)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
        address = (address[0], probe.getsockname()[1], *address[2:])
    held = socket.socket(family, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        held.bind(address)
    except OSError:
        held.close()
        raise
    return held


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """`name`=`value` in this process's environment for the block (a spawned child inherits it)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
