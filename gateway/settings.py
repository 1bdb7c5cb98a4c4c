"""The gateway's environment switches, defined once in the engine's style (`engine.settings`).

Read when they are used (`GatewaySettings.from_env()`), so a test may set a variable first; what a serving loop's
hot path reads comes from `loop_settings()`, read once per event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine.settings import on_unless_zero, read_env, switch
from gateway.loop_local import LoopLocal


def optional_threads(raw: str) -> int | None:
    """Unset: None (the gateway sizes the pool from the cores); else at least 1."""
    return max(1, int(raw)) if raw else None


def procs_count(raw: str) -> int | None:
    """auto: None (the gateway sizes it from the cores); else an integer, at least 0."""
    if raw == "auto":
        return None
    value = int(raw)
    if value < 0:
        raise ValueError("must be auto or an integer >= 0")
    return value


def fronts_count(raw: str) -> int | None:
    """auto: None (sized from the cores: `gateway.fronts.front_count`); else an integer, at least 1."""
    if raw == "auto":
        return None
    value = int(raw)
    if value < 1:
        raise ValueError("must be auto or an integer >= 1")
    return value


def crash_limit(raw: str) -> tuple[int, float]:
    """N/S: more than N crashes within S seconds is too many (N an integer >= 0, S seconds > 0)."""
    count, slash, seconds = raw.partition("/")
    if not slash:
        raise ValueError("expected N/S, e.g. 5/60")
    limit, window_s = int(count), float(seconds)
    if limit < 0 or not 0 < window_s < float("inf"):
        raise ValueError("N must be >= 0 and S a number of seconds > 0")
    return limit, window_s


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """A parser of an integer in lo..hi."""
    def parse(raw: str) -> int:
        value = int(raw)
        if not lo <= value <= hi:
            raise ValueError(f"must be in {lo}..{hi}")
        return value
    return parse


@dataclass(frozen=True)
class GatewaySettings:
    """The gateway's environment switches (its options are `GatewayConfig`)."""

    encode_threads: int | None = switch(
        "VOXGATE_ENCODE_THREADS", "", "unset | integer", "the Opus encode pool's threads (unset: 3 per 4 cores, at "
        "most 12)", optional_threads)
    encode_procs: int | None = switch(
        "VOXGATE_ENCODE_PROCS", "auto", "0 | integer | auto", "Opus encoding in this many child processes, each with "
        "a GIL of its own (auto: 3 per 4 cores, at most 12, shared among the fronts, and at least 2 a front where it "
        "has 2 cores; 0: in the gateway process's thread pool)", procs_count)
    encode_nice: int = switch(
        "VOXGATE_ENCODE_NICE", "5", "0..19", "the Opus encode threads' (or processes') CPU priority below the rest of "
        "the gateway (Linux per-thread nice; 0: the same), so in a burst of encoding the event loop and the engine "
        "worker's host thread get a core first", int_in(0, 19))
    fronts: int | None = switch(
        "VOXGATE_FRONTS", "auto", "auto | integer >= 1", "gateway front processes sharing the port over one engine "
        "(`voxgate serve --fronts` overrides it; auto: 1 below 8 cores, else cores // 2, at most 8)", fronts_count)
    front_crashes: tuple[int, float] = switch(
        "VOXGATE_FRONT_CRASHES", "5/60", "N/S (N >= 0, S > 0)", "a node of several fronts restarts a front that dies, "
        "but when its fronts die more than N times within S seconds it stops (exit status 1): a front that keeps dying "
        "is broken, not unlucky", crash_limit)
    opus_batch: bool = switch(
        "VOXGATE_OPUS_BATCH", "1", "0 | 1", "encode a chunk's Opus frames in one C call; 0: frame by frame through "
        "opuslib", on_unless_zero)
    opus_head_complexity: int = switch(
        "VOXGATE_OPUS_HEAD_COMPLEXITY", "0", "0..10", "the Opus complexity, at most, of the frame that starts a "
        "listener's audio (a turn's first, `gateway.turn.HEAD_FRAMES`): in a burst of new turns each first frame "
        "waits for those ahead of it in its encoder, and complexity 0 halves libopus's time for it; the frames after "
        "it take the format's complexity; 10: as the rest", int_in(0, 10))
    burst_lane: bool = switch(
        "VOXGATE_BURST_LANE", "1", "0 | 1", "in a burst of new turns, every turn's engine request goes out before work "
        "that can wait a few ms (context.started, the rest of a paragraph's cuts, a turn's tasks: "
        "`gateway.loop_lanes`); 0: that work runs first in, first out with the message handlers", on_unless_zero)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GatewaySettings:
        """The switches as the environment sets them now."""
        settings: GatewaySettings = read_env(cls, environ)
        return settings


_of_loop: LoopLocal[GatewaySettings] = LoopLocal(lambda loop: GatewaySettings.from_env())


def loop_settings() -> GatewaySettings:
    """The switches as the environment set them when the running event loop first asked: what runs per turn (its
    encoder's place, the loop's lane) must not parse every switch each time (~10 us of the loop per turn)."""
    return _of_loop.get()
