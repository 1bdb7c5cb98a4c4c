"""The gateway in a process of its own, for benchmarks: its CPU is then the gateway's alone, not the load clients'.

    python bench/gateway_proc.py --engine paced             # the paced stand-in engine (bench/paced_engine.py)
    python bench/gateway_proc.py --engine real [--model DIR] # the real engine (tiny demo model on CPU)

It prints one JSON line {"port": N} once it listens, serves the real gateway app (`gateway.server.create_app`) plus
two benchmark-only routes, and exits when its stdin closes (the parent died) or on SIGTERM/SIGINT:
- GET /bench/stats: process CPU seconds, CPU seconds per thread (the event loop is "MainThread"), event-loop lag
  percentiles since the last reset (a 10 ms timer's overshoot), the engine's counters and its workers' step-time
  histograms;
- POST /bench/reset: start a new lag window.
--profile PATH: cProfile of the event loop's thread while serving (it slows the loop: for where time goes, not for
latency figures). `GatewayProcess` starts and stops it from a benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
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

LAG_INTERVAL_S = 0.01


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 2)


class LoopLag:
    """Overshoot of a periodic timer: how long a ready callback waits for the event loop. Besides, the loop thread's
    CPU share while it lagged (near 1: it was busy running callbacks; near 0: it wanted to run and could not, waiting
    for the GIL or a core) and the cyclic garbage collector's pauses."""

    LAGGING_MS = 20.0

    def __init__(self, interval_s: float = LAG_INTERVAL_S):
        self.interval_s = interval_s
        self.reset()
        gc.callbacks.append(self._on_gc)

    def reset(self) -> None:
        self.samples: list[float] = []
        self.lagging_wall_s = self.lagging_cpu_s = 0.0
        self.gc_pauses_ms: dict[int, list[float]] = {1: [], 2: []}  # by generation
        self._gc_started: float | None = None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None and info.get("generation", 0) >= 1:
            self.gc_pauses_ms[min(2, info["generation"])].append((time.perf_counter() - self._gc_started) * 1000.0)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t, cpu = loop.time(), time.thread_time()
            await asyncio.sleep(self.interval_s)
            lag = (loop.time() - t - self.interval_s) * 1000.0
            self.samples.append(lag)
            if lag >= self.LAGGING_MS:
                self.lagging_wall_s += loop.time() - t
                self.lagging_cpu_s += time.thread_time() - cpu

    def summary(self) -> dict[str, Any]:
        s = self.samples
        return {"n": len(s), "p50_ms": _pct(s, 0.5), "p90_ms": _pct(s, 0.9), "p99_ms": _pct(s, 0.99),
                "max_ms": round(max(s), 2) if s else None,
                "lagging_s": round(self.lagging_wall_s, 2),
                "loop_cpu_share_while_lagging": round(self.lagging_cpu_s / self.lagging_wall_s, 3)
                if self.lagging_wall_s else None,
                **{f"gc_gen{g}": {"pauses": len(p), "ms_total": round(sum(p), 1),
                                  "ms_max": round(max(p), 2) if p else None} for g, p in self.gc_pauses_ms.items()}}


def thread_cpu() -> dict[str, float]:
    """CPU seconds of every Python thread of this process, by name (same-named threads summed)."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        if t.ident is None:
            continue
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, AttributeError):  # ended meanwhile, or not POSIX
            continue
        name = t.name.rsplit("_", 1)[0] if t.name.startswith(("voxgate-offload", "asyncio")) else t.name
        out[name] = round(out.get(name, 0.0) + cpu, 4)
    return out


def encode_procs_cpu() -> float:
    """CPU seconds of the gateway's live encoder processes (VOXGATE_ENCODE_PROCS), from /proc (0 without them)."""
    from gateway.encode_procs import shared_pids

    total = 0.0
    for pid in shared_pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return round(total, 4)


async def _serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    from gateway.protocol import Limits
    from gateway.server import ServerConfig, create_app, start_server
    from gateway.session import SessionConfig

    if args.engine == "paced":
        from paced_engine import PacedEngine

        engine: Any = PacedEngine(tick_ms=args.tick_ms, ms_per_char=args.ms_per_char,
                                  compile_stall_ms=args.compile_stall_ms)
    else:
        from engine import Engine

        engine = Engine(args.model, **({} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}))
        await engine.wait_for_ready()
    limits = Limits(idle_timeout_s=3600.0)
    config = ServerConfig(session=SessionConfig(limits=limits), max_sessions=args.max_sessions,
                          max_sessions_per_key=args.max_sessions, web_client_dir=None)
    app = create_app(engine, config)
    lag = LoopLag()

    async def stats(_: web.Request) -> web.Response:
        e = engine.stats()
        threads = thread_cpu()
        encoders = threads["voxgate-encode-procs"] = encode_procs_cpu()  # counted as the gateway's (as threads are)
        body = {"cpu_s": time.process_time() + encoders, "wall_s": time.monotonic(), "threads": threads,
                "loop_lag": lag.summary(), "pid": os.getpid(),
                "engine": {"in_flight": e.in_flight, "running": e.running, "steps": e.steps,
                           "chunks": getattr(engine, "chunks", None)}}
        late = getattr(engine, "late_ticks_ms", None)
        if late is not None:
            body["engine"]["late_tick_ms_p99"] = _pct(late, 0.99)
        # each worker's step-time histograms (engine.worker.StepStats): a benchmark subtracts two snapshots to see
        # whether a step stalled while it ran (an engine-wide stall starves every stream at once)
        body["engine"]["workers"] = [w.get("stats", {}) for w in engine.health().get("workers", [])]
        return web.json_response(body)

    async def reset(_: web.Request) -> web.Response:
        lag.reset()
        late = getattr(engine, "late_ticks_ms", None)
        if late is not None:
            late.clear()
        return web.json_response({"ok": True})

    app.router.add_get("/bench/stats", stats)
    app.router.add_post("/bench/reset", reset)
    runner, port = await start_server(app, args.host, args.port)
    # the text normalisation grammars load in a thread at start-up (seconds of pure Python, holding the GIL): done
    # before the port is announced, so no level measures it
    from gateway.text import normalize

    await asyncio.to_thread(normalize.preload)
    monitor = asyncio.create_task(lag.run())
    # what exists now (modules, the engine's config, the app) lives as long as the process: keep the cyclic
    # garbage collector from walking it again and again
    gc.collect()
    gc.freeze()
    print(json.dumps({"port": port, "pid": os.getpid()}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not sys.stdin.buffer.read1(1) else None)
    profiler = None
    if args.profile:  # the event loop's thread only (cProfile is per thread): where its time goes, per call
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    await stop.wait()
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    monitor.cancel()
    await runner.cleanup()
    await engine.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("paced", "real"), default="paced")
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
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    asyncio.run(_serve(ap.parse_args(argv)))
    return 0


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
        self.port, self.pid = info["port"], info["pid"]
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"ws://127.0.0.1:{self.port}/v1/stream"

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.base + "/bench/stats", timeout=30) as r:
            return json.loads(r.read())

    def reset(self) -> None:
        req = urllib.request.Request(self.base + "/bench/reset", method="POST")
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
    """CPU used between two `stats()` snapshots: process total, per thread, and seconds of wall time."""
    threads = {k: round(v - before["threads"].get(k, 0.0), 3) for k, v in after["threads"].items()}
    return {"cpu_s": round(after["cpu_s"] - before["cpu_s"], 3), "wall_s": round(after["wall_s"] - before["wall_s"], 3),
            "threads_cpu_s": {k: v for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v > 0.0005}}


if __name__ == "__main__":
    sys.exit(main())
