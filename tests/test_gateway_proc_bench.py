"""bench/gateway_proc.py and bench/proc_stats.py: what the benchmark's gateway process reports of itself, per process
(one gateway, or the host and each front of `--fronts N`), and that `GatewayProcess` reads it across all of them."""

import asyncio
import gc
import json
import urllib.request

import pytest

from bench.gateway_proc import GatewayProcess, aggregate, delta
from bench.proc_stats import GcWatch, ProcessProbe, pid_memory_mb
from gateway.client import VoxgateClient
from gateway.gc_policy import SERVED_THRESHOLD

pytestmark = pytest.mark.timeout(180)


def test_gc_watch_times_each_generations_collections():
    watch = GcWatch()
    try:
        for generation in (0, 1, 2, 2):
            gc.collect(generation)
        summary = watch.summary()
    finally:
        gc.callbacks.remove(watch._on_gc)
    assert [summary[f"gen{g}"]["pauses"] for g in range(3)] >= [1, 1, 2]  # more if allocations triggered some
    assert summary["gen2"]["ms_total"] >= summary["gen2"]["ms_max"] > 0
    assert summary["threshold"] == list(gc.get_threshold()) and summary["tracked"] > 0
    watch.reset()
    assert watch.summary()["gen2"]["pauses"] == 0


async def test_a_probe_snapshot_has_this_processs_cpu_lag_gc_and_memory():
    probe = ProcessProbe("front0")
    probe.start()
    await asyncio.sleep(0.1)
    snap = probe.snapshot()
    probe.stop()
    try:
        assert snap["role"] == "front0" and snap["cpu_s"] > 0 and snap["threads"]["MainThread"] > 0
        assert snap["loop_lag"]["n"] >= 3 and snap["rss_peak_mb"] >= snap["rss_mb"] > 0
        assert set(snap["gc"]) >= {"gen0", "gen1", "gen2", "young_net_allocs_per_s"}
    finally:
        gc.callbacks.remove(probe.gc._on_gc)
    assert pid_memory_mb(2**22 + 1) is None  # no such process


def _snap(role: str, cpu: float, lag_p99: float, pid: int) -> dict:
    return {"role": role, "pid": pid, "cpu_s": cpu, "wall_s": 100.0 + cpu, "threads": {"MainThread": cpu / 2},
            "loop_lag": {"p99_ms": lag_p99}, "gc": {}, "rss_mb": 1.0}


def test_aggregate_sums_processes_and_names_the_worst_front():
    one = aggregate([_snap("gateway", 2.0, 5.0, 10)], {"worker_cpu_s": 1.0})
    assert one["threads"] == {"MainThread": 1.0} and one["fronts"] == 1 and one["loop_lag"]["p99_ms"] == 5.0
    # the host's loop (it relays every chunk) is reported, but the worst front's lag is the one clients see
    before = aggregate([_snap("host", 1.0, 50.0, 10), _snap("front0", 2.0, 3.0, 11), _snap("front1", 3.0, 9.0, 12)],
                       {"worker_cpu_s": 4.0})
    assert (before["worst_front"], before["fronts"], before["cpu_s"]) == ("front1", 2, 6.0)
    assert before["threads"]["front1/MainThread"] == 1.5 and before["loop_lag"]["p99_ms"] == 9.0
    after = aggregate([_snap("host", 2.0, 1.0, 10), _snap("front0", 4.0, 1.0, 11), _snap("front1", 5.0, 1.0, 12)],
                      {"worker_cpu_s": 6.5})
    used = delta(before, after)
    assert used["processes_cpu_s"] == {"host": 1.0, "front0": 2.0, "front1": 2.0}
    assert (used["cpu_s"], used["engine_worker_cpu_s"], used["wall_s"]) == (5.0, 2.5, 1.0)
    # front1 restarted meanwhile (a new pid): its CPU counts from its start
    restarted = aggregate([_snap("host", 2.0, 1.0, 10), _snap("front0", 4.0, 1.0, 11), _snap("front1", 0.5, 1.0, 13)],
                          {"worker_cpu_s": 6.5})
    assert delta(before, restarted)["processes_cpu_s"]["front1"] == 0.5


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


async def test_fronts_each_report_their_own_figures_through_the_hosts_control_port(tiny_v2_dir):
    """`--fronts 2` over the real tiny engine: turns on the shared port; the control port's /bench/stats has the host
    and both fronts (each asked on its private port), their CPU adds up, and a reset reaches every front."""
    gw = await asyncio.to_thread(GatewayProcess, "--engine", "real", "--model", str(tiny_v2_dir), "--fronts", "2",
                                 timeout_s=150)
    try:
        assert gw.fronts == 2 and len(gw.front_pids) == 2 and gw.control != f"http://127.0.0.1:{gw.port}"
        assert set(gw.spy_pids()) == {"host", "front0"}
        for i in range(4):  # new connections: the kernel spreads them over the fronts
            async with await VoxgateClient.connect(gw.url) as client:
                await client.start(generation={"max_length": 2})
                await client.speak(f"Turn {i}.", f"t{i}", timeout=60)
        stats = await asyncio.to_thread(gw.stats)
        assert set(stats["processes"]) == {"host", "front0", "front1"}
        assert {p["pid"] for r, p in stats["processes"].items() if r != "host"} == set(gw.front_pids)
        assert stats["cpu_s"] == pytest.approx(sum(p["cpu_s"] for p in stats["processes"].values()), abs=1e-3)
        assert stats["worst_front"] in ("front0", "front1") and stats["engine"]["worker_cpu_s"] > 0
        assert all(p["loop_lag"]["n"] > 0 and "gen0" in p["gc"] for p in stats["processes"].values())
        assert stats["processes"]["host"]["gc"]["threshold"] == list(SERVED_THRESHOLD)
        await asyncio.to_thread(gw.reset)
        after = await asyncio.to_thread(gw.stats)
        assert all(p["loop_lag"]["n"] < stats["processes"][r]["loop_lag"]["n"] for r, p in after["processes"].items())
    finally:
        await asyncio.to_thread(gw.close)
    assert gw.proc.returncode == 0
