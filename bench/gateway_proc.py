"""The gateway in a process of its own, for benchmarks: its CPU is then the gateway's alone, not the load clients'.

    python bench/gateway_proc.py --engine paced             # the paced stand-in engine (bench/paced_engine.py)
    python bench/gateway_proc.py --engine real [--model DIR] # the real engine (tiny demo model on CPU)
    python bench/gateway_proc.py --engine real --fronts 4    # as `voxgate serve --fronts 4`: host + 4 fronts

It prints one JSON line {"port": N, "pid": ..., "control_port": ...} once it serves the real gateway app
(`gateway.server.create_app`; with --fronts N > 1, `gateway.fronts.serve_fronts` with the engine in this process and
N front processes on the port) plus two benchmark-only routes, and exits when its stdin closes (the parent died) or on
SIGTERM/SIGINT. On the control port (the gateway's own port with one process; a private one of the host with fronts,
which asks every front on its private port: bench/front_probe.py):
- GET /bench/stats: per process (the host, each front) CPU seconds (each front's with its Opus encoder processes),
  CPU seconds per thread (the event loop is "MainThread"), event-loop lag percentiles since the last reset (a 10 ms
  timer's overshoot), the garbage collector's pauses per generation, resident memory; their sum, the worst front's
  lag, the engine's counters, its workers' step-time histograms and their processes' CPU seconds;
- POST /bench/reset: start a new lag and GC window in every process.
--profile PATH: cProfile of the event loop's thread while serving (the host's, with fronts; it slows the loop: for
where time goes, not for latency figures). `GatewayProcess` starts and stops it from a benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from front_probe import FRONTS_DIR_ENV, SETTINGS, ask_fronts, bench_routes, live_fronts  # noqa: E402
from proc_stats import ProcessProbe, pct, pid_cpu_s  # noqa: E402


def _engine_body(engine: Any) -> dict[str, Any]:
    """The engine's counters, its workers' step-time histograms and its worker processes' CPU seconds."""
    e = engine.stats()
    body: dict[str, Any] = {"in_flight": e.in_flight, "running": e.running, "steps": e.steps,
                            "chunks": getattr(engine, "chunks", None)}
    late = getattr(engine, "late_ticks_ms", None)
    if late is not None:
        body["late_tick_ms_p99"] = pct(late, 0.99)
    workers = engine.health().get("workers", [])
    # each worker's step-time histograms (engine.worker.StepStats): a benchmark subtracts two snapshots to see
    # whether a step stalled while it ran (an engine-wide stall starves every stream at once)
    body["workers"] = [w.get("stats", {}) for w in workers]
    body["worker_cpu_s"] = round(sum(pid_cpu_s(w["pid"]) or 0.0 for w in workers if w.get("pid")), 3)
    return body


def aggregate(processes: list[dict[str, Any]], engine: dict[str, Any]) -> dict[str, Any]:
    """One /bench/stats answer from every gateway process's `ProcessProbe.snapshot()` (the host first): CPU summed
    (threads named `role/thread` when there are several processes), the worst front's loop lag (the host's is in
    `processes`: with fronts it relays every chunk but serves no client)."""
    several = len(processes) > 1
    threads: dict[str, float] = {}
    for p in processes:
        for name, cpu in p["threads"].items():
            threads[f"{p['role']}/{name}" if several else name] = cpu
    fronts = [p for p in processes if p["role"] != "host"] or processes
    worst = max(fronts, key=lambda p: p["loop_lag"]["p99_ms"] or 0.0)
    return {"pid": processes[0]["pid"], "wall_s": processes[0]["wall_s"],
            "cpu_s": round(sum(p["cpu_s"] for p in processes), 4), "threads": threads,
            "loop_lag": worst["loop_lag"], "worst_front": worst["role"], "fronts": len(fronts),
            "processes": {p["role"]: p for p in processes}, "engine": engine}


def _make_engine(args: argparse.Namespace) -> Any:
    if args.engine == "paced":
        from paced_engine import PacedEngine

        return PacedEngine(tick_ms=args.tick_ms, ms_per_char=args.ms_per_char, compile_stall_ms=args.compile_stall_ms)
    from engine import Engine

    return Engine(args.model, **({} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}))


def _server_config(args: argparse.Namespace) -> Any:
    from gateway.protocol import Limits
    from gateway.server import ServerConfig
    from gateway.session import SessionConfig

    return ServerConfig(session=SessionConfig(limits=Limits(idle_timeout_s=3600.0)), max_sessions=args.max_sessions,
                        max_sessions_per_key=args.max_sessions, web_client_dir=None)


def _stop_when_stdin_closes(stop: Any) -> None:
    """Call `stop()` once, when stdin reads end-of-file: the benchmark that started this process ended (or died)."""
    loop = asyncio.get_running_loop()

    def readable() -> None:
        if not sys.stdin.buffer.read1(1):
            loop.remove_reader(sys.stdin.fileno())
            stop()

    loop.add_reader(sys.stdin.fileno(), readable)


def _start_profile(args: argparse.Namespace) -> Any:
    """--profile: cProfile of the event loop's thread (cProfile is per thread): where its time goes, per call."""
    if not args.profile:
        return None
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _save_profile(profiler: Any, args: argparse.Namespace) -> None:
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)


async def _serve(args: argparse.Namespace) -> int:
    """One gateway process (the paced engine always; the real one with one front)."""
    from gateway.encode_site import start_encoders
    from gateway.gc_policy import settle_gc
    from gateway.server import create_app, start_server
    from gateway.text import normalize

    engine = _make_engine(args)
    if args.engine == "real":
        await engine.wait_for_ready()
    app = create_app(engine, _server_config(args))
    probe = ProcessProbe("gateway")

    async def stats() -> dict[str, Any]:
        return aggregate([probe.snapshot()], _engine_body(engine))

    async def reset() -> None:
        probe.reset()
        late = getattr(engine, "late_ticks_ms", None)
        if late is not None:
            late.clear()

    bench_routes(app, stats, reset)
    runner, port = await start_server(app, args.host, args.port)
    # the text normalisation grammars load in a thread at start-up (seconds of pure Python, holding the GIL): done
    # before the port is announced, so no level measures it
    await asyncio.to_thread(normalize.preload)
    probe.start()
    start_encoders()
    settle_gc(args.gc_threshold)
    print(json.dumps({"port": port, "pid": os.getpid(), "control_port": port, "fronts": 1}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    _stop_when_stdin_closes(stop.set)
    profiler = _start_profile(args)
    await stop.wait()
    _save_profile(profiler, args)
    probe.stop()
    await runner.cleanup()
    await engine.stop()
    return 0


async def _serve_fronts(args: argparse.Namespace, fronts: int) -> int:
    """The real engine in this process (the host) served to `fronts` front processes on the port, as `voxgate serve
    --fronts N` runs (`gateway.fronts.serve_fronts`); every front gets the /bench routes (front_probe.front_hook),
    and this process answers for all of them on a private control port."""
    import shutil
    import tempfile

    from aiohttp import web

    from gateway.fronts import FrontArgs, serve_fronts
    from gateway.gc_policy import settle_gc
    from gateway.store import open_store

    engine = _make_engine(args)
    await engine.wait_for_ready()
    store = open_store(None, None)  # in memory, as a benchmark needs
    probe = ProcessProbe("host")
    directory = Path(tempfile.mkdtemp(prefix="gateway-proc-fronts-"))
    (directory / SETTINGS).write_text(json.dumps({"gc_threshold": args.gc_threshold}))
    os.environ[FRONTS_DIR_ENV] = str(directory)  # the fronts inherit it (multiprocessing's spawn copies os.environ)

    async def stats() -> dict[str, Any]:
        answers = await ask_fronts(directory, "GET", "/bench/stats")
        return aggregate([probe.snapshot(), *answers], _engine_body(engine))

    async def reset() -> None:
        probe.reset()
        await ask_fronts(directory, "POST", "/bench/reset")

    control = web.Application()
    bench_routes(control, stats, reset)
    runner = web.AppRunner(control, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    control_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    profiler = None

    def announce(port: int) -> None:
        nonlocal profiler
        probe.start()
        settle_gc(args.gc_threshold)
        print(json.dumps({"port": port, "pid": os.getpid(), "control_port": control_port, "fronts": fronts,
                          "front_pids": [f["pid"] for f in live_fronts(directory)]}), flush=True)
        # stdin's end is taken as SIGTERM, which serve_fronts handles: every front drains, then the link closes
        _stop_when_stdin_closes(lambda: os.kill(os.getpid(), signal.SIGTERM))
        profiler = _start_profile(args)

    try:
        code = await serve_fronts(engine, store, fronts=fronts, host=args.host, port=args.port,
                                  front_args=FrontArgs(config=_server_config(args)),
                                  app_hook="front_probe:front_hook", announce=announce)
    finally:
        _save_profile(profiler, args)
        probe.stop()
        await runner.cleanup()
        await engine.stop()
        await store.close()
        shutil.rmtree(directory, ignore_errors=True)
    return code


def _gc_threshold(spec: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in spec.split(","))
    if not 1 <= len(values) <= 3 or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected GEN0[,GEN1[,GEN2]], integers >= 0")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("paced", "real"), default="paced")
    ap.add_argument("--fronts", help="real engine: gateway front processes over the engine, N or auto, as `voxgate "
                    "serve --fronts` (default: VOXGATE_FRONTS, else auto); the paced engine is always served by one "
                    "process")
    ap.add_argument("--model", help="real engine: model dir (default: the tiny demo model without a GPU)")
    ap.add_argument("--max-num-seqs", type=int, help="real engine: concurrent requests (default: the engine's)")
    ap.add_argument("--tick-ms", type=float, default=None, help="paced engine: ms between chunks (default 160: "
                    "real time)")
    ap.add_argument("--ms-per-char", type=float, default=65.0, help="paced engine: audio per character of text "
                    "(large: every segment runs to max_length, like a checkpoint whose stop head never fires)")
    ap.add_argument("--compile-stall-ms", type=float, default=0.0, help="paced engine: the first step that serves "
                    "a continuation request takes this much longer, once (a kernel compiled mid-serving)")
    ap.add_argument("--max-sessions", type=int, default=10000)
    ap.add_argument("--profile", help="cProfile the event loop while serving; pstats written here at exit")
    ap.add_argument("--gc-threshold", type=_gc_threshold, help="the collector's thresholds after start-up, "
                    "GEN0[,GEN1[,GEN2]] (default: gateway.gc_policy's, as served)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    fronts = 1
    if args.engine == "real":
        from gateway.fronts import front_count

        try:
            fronts = front_count(args.fronts)
        except ValueError as e:
            ap.error(f"--fronts: {e}")
    return asyncio.run(_serve_fronts(args, fronts) if fronts > 1 else _serve(args))


class GatewayProcess:
    """Start bench/gateway_proc.py as a child; `url`, `stats()`, `reset()`; `close()` (or `with`) stops it."""

    def __init__(self, *args: str, cwd: Path = ROOT, timeout_s: float = 900.0):  # a GPU engine loads for minutes
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], cwd=cwd,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        line = _readline(self.proc, timeout_s)
        if not line:
            self.close()
            raise RuntimeError("the gateway process did not start (see its stderr above)")
        info = json.loads(line)
        self.port, self.pid, self.fronts = info["port"], info["pid"], info.get("fronts", 1)
        self.front_pids: list[int] = info.get("front_pids", [])
        # /bench on the control port answers for every process (with fronts, the shared port reaches one of them)
        self.control = f"http://127.0.0.1:{info.get('control_port', self.port)}"
        self.url = f"ws://127.0.0.1:{self.port}/v1/stream"

    def spy_pids(self) -> dict[str, int]:
        """The processes worth sampling: the host (the gateway itself with one front), and one front."""
        return {"host": self.pid, "front0": self.front_pids[0]} if self.front_pids else {"gateway": self.pid}

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.control + "/bench/stats", timeout=30) as r:
            return json.loads(r.read())

    def reset(self) -> None:
        req = urllib.request.Request(self.control + "/bench/reset", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> GatewayProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def git_commit() -> str | None:
    """The VOXGATE_COMMIT that bench/gpu_run.sh is given (a `git archive` snapshot on the device machine, which
    may sit inside another checkout); else HEAD, marked when the gateway, bench or engine client files differ."""
    if os.environ.get("VOXGATE_COMMIT"):
        return os.environ["VOXGATE_COMMIT"]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "gateway", "bench", "engine/engine.py",
                                "engine/api.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("VOXGATE_COMMIT")
    return commit.stdout.strip() + (" (+ uncommitted changes)" if dirty.stdout.strip() else "")


def machine_info() -> dict[str, Any]:
    """Where a benchmark ran: cores, platform, Python, and the GPUs when nvidia-smi answers."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version()}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if smi.returncode == 0:
            info["gpus"] = smi.stdout.strip().splitlines()
    return info


def save_probe(out: Path | None, started: float, device: str, **fields: Any) -> dict:
    """A GPU probe's report (bench/fp8_bench.py, pdl_gemm_bench.py, persistent_gemm_bench.py): device, commit, date,
    command and seconds since `started` (perf_counter), then `fields`; written to `out` as JSON when given."""
    report = {"device": device, "git_commit": git_commit(), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(sys.argv), "seconds": round(time.perf_counter() - started, 1), **fields}
    if out:
        out.write_text(json.dumps(report, indent=2))
    return report


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)  # type: ignore
    reader.start()
    reader.join(timeout_s)
    return result[0].strip() if result else ""


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """CPU used between two `stats()` snapshots: the gateway's processes in total, per thread, per process (a front
    restarted meanwhile counts from 0), the engine's worker processes, and seconds of wall time."""
    threads = {k: round(v - before["threads"].get(k, 0.0), 3) for k, v in after["threads"].items()}
    old = before.get("processes", {})
    procs = {role: round(p["cpu_s"] - (old[role]["cpu_s"] if old.get(role, {}).get("pid") == p["pid"] else 0.0), 3)
             for role, p in after.get("processes", {}).items()}
    worker = (after.get("engine", {}).get("worker_cpu_s") or 0.0) - (before.get("engine", {}).get("worker_cpu_s")
                                                                     or 0.0)
    return {"cpu_s": round(sum(procs.values()) if procs else after["cpu_s"] - before["cpu_s"], 3),
            "wall_s": round(after["wall_s"] - before["wall_s"], 3),
            "threads_cpu_s": {k: v for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v > 0.0005},
            "processes_cpu_s": procs, "engine_worker_cpu_s": round(worker, 3)}


if __name__ == "__main__":
    sys.exit(main())
