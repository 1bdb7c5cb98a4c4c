"""What one benchmark gateway process measures of itself (bench/gateway_proc.py runs it in the host and in every
front): event-loop lag, the cyclic garbage collector's pauses by generation, CPU seconds per thread and of child
processes (from /proc), resident memory. `ProcessProbe.snapshot()` is one process's figures as JSON."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from typing import Any

LAG_INTERVAL_S = 0.01


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of `values`, rounded to 0.01; None when empty."""
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 2)


class LoopLag:
    """Overshoot of a periodic timer: how long a ready callback waits for the event loop. Besides, the loop thread's
    CPU share while it lagged (near 1: it was busy running callbacks; near 0: it wanted to run and could not, waiting
    for the GIL or a core)."""

    LAGGING_MS = 20.0

    def __init__(self, interval_s: float = LAG_INTERVAL_S):
        self.interval_s = interval_s
        self.reset()

    def reset(self) -> None:
        self.samples: list[float] = []
        self.lagging_wall_s = self.lagging_cpu_s = 0.0

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
        return {"n": len(s), "p50_ms": pct(s, 0.5), "p90_ms": pct(s, 0.9), "p99_ms": pct(s, 0.99),
                "max_ms": round(max(s), 2) if s else None,
                "lagging_s": round(self.lagging_wall_s, 2),
                "loop_cpu_share_while_lagging": round(self.lagging_cpu_s / self.lagging_wall_s, 3)
                if self.lagging_wall_s else None}


class GcWatch:
    """The cyclic garbage collector's pauses per generation (through `gc.callbacks`) since the last reset: how
    many, how long, the longest, and the net young allocations that triggered them (a generation-0 collection runs
    each time allocations minus deallocations of tracked objects reach the first threshold)."""

    def __init__(self) -> None:
        self.reset()
        gc.callbacks.append(self._on_gc)

    def reset(self) -> None:
        self.pauses_ms: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self.cpu_ms: dict[int, float] = {0: 0.0, 1: 0.0, 2: 0.0}
        self.collected = 0
        self._started: float | None = None
        self._started_cpu = 0.0
        self._since = time.monotonic()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started, self._started_cpu = time.perf_counter(), time.thread_time()
        elif self._started is not None:
            gen = min(2, info.get("generation", 0))
            self.pauses_ms[gen].append((time.perf_counter() - self._started) * 1000.0)
            self.cpu_ms[gen] += (time.thread_time() - self._started_cpu) * 1000.0
            self.collected += info.get("collected", 0)
            self._started = None

    def summary(self) -> dict[str, Any]:
        wall = max(time.monotonic() - self._since, 1e-9)
        threshold = gc.get_threshold()
        # every collection of any generation starts from a full generation 0
        collections = sum(len(p) for p in self.pauses_ms.values())
        # tracked: the objects a full collection walks now (the frozen ones it skips); what a gen-2 pause scales with
        return {"threshold": list(threshold), "frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects()),
                "wall_s": round(wall, 2),
                "young_net_allocs_per_s": round(collections * threshold[0] / wall),
                "collected": self.collected,
                # cpu_ms_total: the collector's own CPU; a wall total far above it means the OS ran something else
                **{f"gen{g}": {"pauses": len(p), "ms_total": round(sum(p), 1), "cpu_ms_total": round(self.cpu_ms[g], 1),
                               "ms_p99": pct(p, 0.99),
                               "ms_max": round(max(p), 2) if p else None} for g, p in self.pauses_ms.items()}}


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


def pid_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a live process has used, from /proc; None once it has ended (or off Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def pid_memory_mb(pid: int) -> dict[str, float] | None:
    """A process's resident memory now and its peak (VmRSS, VmHWM), MiB; None once it has ended."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kb = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if k in ("VmRSS", "VmHWM")}
    except (OSError, ValueError):
        return None
    return {"rss_mb": round(kb.get("VmRSS", 0) / 1024, 1), "rss_peak_mb": round(kb.get("VmHWM", 0) / 1024, 1)}


def encode_procs_cpu() -> float:
    """CPU seconds of this process's live Opus encoder processes (VOXGATE_ENCODE_PROCS; 0 without them)."""
    from gateway.encode_procs import shared_pids

    return round(sum(pid_cpu_s(pid) or 0.0 for pid in shared_pids()), 4)


class ProcessProbe:
    """One gateway process's own figures: start `run()` in its event loop, read `snapshot()`, `reset()` starts a
    new window of lag samples and GC pauses (CPU seconds are totals: a benchmark subtracts two snapshots)."""

    def __init__(self, role: str):
        self.role = role
        self.lag = LoopLag()
        self.gc = GcWatch()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.lag.run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def reset(self) -> None:
        self.lag.reset()
        self.gc.reset()

    def snapshot(self) -> dict[str, Any]:
        threads = thread_cpu()
        # the Opus encoder processes are counted as this process's (their work was its threads' before)
        encoders = threads["voxgate-encode-procs"] = encode_procs_cpu()
        return {"role": self.role, "pid": os.getpid(), "cpu_s": round(time.process_time() + encoders, 4),
                "wall_s": time.monotonic(), "threads": threads, "loop_lag": self.lag.summary(),
                "gc": self.gc.summary(), **(pid_memory_mb(os.getpid()) or {})}
