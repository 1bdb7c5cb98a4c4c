"""Prometheus metrics of the gateway (served at /metrics). One registry per application, so several servers (tests)
can live in one process. The gateway fronts of one node (`gateway.fronts`) count in prometheus_client's multiprocess
mode: each front's /metrics then reports the whole node (every front's counts, the engine's gauges once)."""

from __future__ import annotations

import asyncio
import atexit
import weakref
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

# latency buckets (seconds) around what voice agents care about: tens to hundreds of milliseconds
_LATENCY = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
_RTF = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
# Latency observations are held back this long and put in the histograms together, one pass per event loop for every
# `GatewayMetrics` on it: observed where they are measured (a turn's first chunk, its first frame), each costs several
# microseconds of cold-cache loop time on the way to that turn's audio, and in a burst the next turn's first frame
# waits for it. A scrape of this process's metrics puts in what is held first.
HOLD_S = 0.05

_held: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[tuple[Histogram, float]]] = (
    weakref.WeakKeyDictionary())


class HeldHistogram:
    """A prometheus `Histogram` (`histogram`) whose `observe` on an event loop holds the value back (`HOLD_S`)."""

    __slots__ = ("histogram",)

    def __init__(self, histogram: Histogram):
        self.histogram = histogram

    def observe(self, value: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.histogram.observe(value)
            return
        held = _held.get(loop)
        if held is None:
            held = _held[loop] = []
            loop.call_later(HOLD_S, _flush, loop)
        held.append((self.histogram, value))


def _flush(loop: asyncio.AbstractEventLoop) -> None:
    for histogram, value in _held.pop(loop, ()):
        histogram.observe(value)


def flush_held() -> None:
    """Put every held observation in its histogram now."""
    for loop in list(_held):
        _flush(loop)


atexit.register(flush_held)  # a process that stops within HOLD_S of its last observations still counts them


class GatewayMetrics:
    """`node_dir`: the multiprocess directory the node's fronts count in (its PROMETHEUS_MULTIPROC_DIR, set before
    the front started); None: this process alone."""

    def __init__(self, registry: CollectorRegistry | None = None, node_dir: str | None = None):
        self.registry = registry or CollectorRegistry()
        self.node_dir = node_dir
        self._engine: _EngineCollector | None = None
        r = self.registry
        self.sessions = Gauge("voxgate_sessions", "Open WebSocket sessions", registry=r, multiprocess_mode="livesum")
        self.turns = Counter("voxgate_turns", "Turns (contexts) opened", registry=r)
        self.turns_done = Counter("voxgate_turns_finished", "Turns finished, by outcome", ["outcome"], registry=r)
        self.ttfb = HeldHistogram(Histogram("voxgate_ttfb_seconds", "First text of a turn -> first audio frame sent",
                                            buckets=_LATENCY, registry=r))
        self.engine_ttfb = HeldHistogram(Histogram("voxgate_engine_ttfb_seconds", "Engine request -> first audio chunk",
                                                   buckets=_LATENCY, registry=r))
        self.gap = HeldHistogram(Histogram("voxgate_playout_gap_seconds", "Estimated mid-turn silences the gateway "
                                           "caused", buckets=_LATENCY, registry=r))
        self.rtf = HeldHistogram(Histogram("voxgate_turn_rtf", "Engine time / audio time per turn", buckets=_RTF,
                                           registry=r))
        self.errors = Counter("voxgate_errors", "Errors sent to clients, by code", ["code"], registry=r)
        self.http_requests = Counter("voxgate_http_requests", "HTTP API requests", ["route", "status"], registry=r)

    def watch_engine(self, engine: Any) -> None:
        """Export the engine's own numbers (queue depth, KV use, ...) as gauges, read at scrape time."""
        self._engine = _EngineCollector(engine)
        self.registry.register(self._engine)

    def node_sessions(self, own: int) -> int:
        """Open sessions on the node: `own` (this process's), or with `node_dir` the sum over its live fronts (what
        `/readyz` reports, so a balancer sees the node full whichever front it asks)."""
        if self.node_dir is None:
            return own
        node = CollectorRegistry()
        MultiProcessCollector(node, path=self.node_dir)
        for family in node.collect():
            if family.name == "voxgate_sessions":
                return int(sum(sample.value for sample in family.samples))
        return own

    def render(self) -> bytes:
        """The Prometheus text: this process's metrics, or with `node_dir` every front's (and the engine's once)."""
        flush_held()
        if self.node_dir is None:
            return generate_latest(self.registry)
        node = CollectorRegistry()
        MultiProcessCollector(node, path=self.node_dir)
        if self._engine is not None:
            node.register(self._engine)
        return generate_latest(node)


class _EngineCollector:
    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self):
        try:
            stats = self.engine.stats()
        except Exception:  # a stopped or crashed engine must not break the scrape
            return
        stats = stats if isinstance(stats, dict) else getattr(stats, "__dict__", {})
        for name, value in _flatten(stats):
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            yield GaugeMetricFamily(f"voxgate_engine_{name}", f"engine stats: {name}", value=float(value))


def _flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in d.items():
        name = f"{prefix}{key}".replace(".", "_").replace("-", "_")
        if isinstance(value, dict):
            out += _flatten(value, name + "_")
        else:
            out.append((name, value))
    return out
