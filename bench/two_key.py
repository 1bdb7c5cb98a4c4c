"""engine_bench.py's two-key level (`--extra twokey:N`): does one API key's burst delay another key's first audio?

On one engine, with N the level:
- speaking: key A's N streams are all speaking; key B opens one new stream, `PROBES` times: the TTFB any new stream
  gets at that load, the reference;
- burst: key A opens N streams at once and key B one stream right behind them (the same event-loop pass, so B's
  request reaches the worker last), `REPEATS` times; B's TTFB and A's. Once with the keys as tenants (the engine's
  fair share) and once all as the shared tenant (first come, first served), for comparison.
Issue 27 asks B's burst TTFB (median) within 1.5x of the speaking reference (median): `within_1_5x`. The engine needs
room for N + 1 streams (`--max-num-seqs` above N), else B waits for a free slot, not for the scheduler.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Callable

from engine import Engine

PROBES = 5
REPEATS = 3
HOLD_PATCHES = 600  # A's streams in the speaking phase: long enough to outlast the probes


async def _stream(engine: Engine, text: str, tenant: str | None, seed: int, patches: int, timesteps: int,
                  first: Callable[[], None] | None = None, ttfb_only: bool = False) -> float:
    """One request; its TTFB in ms. `first` is called at its first chunk; `ttfb_only` closes it there."""
    start = time.perf_counter()
    gen = engine.generate(text, seed=seed, max_length=patches, min_length=patches, timesteps=timesteps,
                          tenant=tenant)
    ttfb = None
    try:
        async for _ in gen:
            if ttfb is None:
                ttfb = 1000.0 * (time.perf_counter() - start)
                if first is not None:
                    first()
                if ttfb_only:
                    break
    finally:
        await gen.aclose()
    assert ttfb is not None
    return ttfb


async def _speaking_reference(engine: Engine, text: str, n: int, patches: int, timesteps: int) -> list[float]:
    """B's TTFB while A's n streams speak."""
    speaking = [0]
    all_speaking = asyncio.Event()

    def spoke() -> None:
        speaking[0] += 1
        if speaking[0] == n:
            all_speaking.set()

    hold = [asyncio.create_task(_stream(engine, text, "key-a", i, HOLD_PATCHES, timesteps, spoke)) for i in range(n)]
    try:
        await all_speaking.wait()
        probes = []
        for i in range(PROBES):
            await asyncio.sleep(0.3)
            probes.append(await _stream(engine, text, "key-b", 10**6 + i, patches, timesteps, ttfb_only=True))
        return probes
    finally:
        for task in hold:
            task.cancel()
        await asyncio.gather(*hold, return_exceptions=True)


async def _burst(engine: Engine, text: str, n: int, patches: int, timesteps: int, tenants: bool,
                 seed: int) -> tuple[float, list[float]]:
    """A's n streams and B's one, sent in one pass; (B's TTFB, A's TTFBs)."""
    a, b = ("key-a", "key-b") if tenants else (None, None)
    streams = [asyncio.create_task(_stream(engine, text, a, seed + i, patches, timesteps)) for i in range(n)]
    probe = asyncio.create_task(_stream(engine, text, b, seed + n, patches, timesteps))
    return await probe, await asyncio.gather(*streams)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))], 1)


async def run_two_key(engine: Engine, text: str, n: int, patches: int, timesteps: int) -> dict:
    """The two-key level's measurements (module docstring)."""
    print(f"  two keys at {n}: B's first audio while A's {n} speak ...", file=sys.stderr)
    speaking = await _speaking_reference(engine, text, n, patches, timesteps)
    burst: dict[str, dict] = {}
    for tenants in (True, False):
        b_ttfb, a_ttfb = [], []
        for rep in range(REPEATS):
            print(f"  two keys at {n}: burst {rep + 1}/{REPEATS} ({'tenants' if tenants else 'shared'}) ...",
                  file=sys.stderr)
            b, a = await _burst(engine, text, n, patches, timesteps, tenants, seed=(rep + 2) * 10**7)
            b_ttfb.append(round(b, 1))
            a_ttfb += a
            await asyncio.sleep(0.3)
        burst["tenants" if tenants else "shared"] = {
            "b_ttfb_ms": b_ttfb, "b_ttfb_ms_median": round(statistics.median(b_ttfb), 1),
            "a_ttfb_ms_p50": _pct(a_ttfb, 50), "a_ttfb_ms_p90": _pct(a_ttfb, 90)}
    reference = statistics.median(speaking)
    ratio = burst["tenants"]["b_ttfb_ms_median"] / reference
    return {"mode": "twokey", "concurrency": n, "speaking_b_ttfb_ms": [round(x, 1) for x in speaking],
            "speaking_b_ttfb_ms_median": round(reference, 1), "burst": burst, "ratio": round(ratio, 3),
            "within_1_5x": ratio <= 1.5}


def row(level: dict) -> str:
    """One line of the bench's table for a two-key level."""
    t, s = level["burst"]["tenants"], level["burst"]["shared"]
    return (f"two keys at {level['concurrency']}: B's TTFB (median ms) while A's streams speak "
            f"{level['speaking_b_ttfb_ms_median']}, behind A's burst {t['b_ttfb_ms_median']} with tenants "
            f"({level['ratio']}x, within 1.5x: {level['within_1_5x']}; A p50 / p90 {t['a_ttfb_ms_p50']} / "
            f"{t['a_ttfb_ms_p90']}), {s['b_ttfb_ms_median']} as one shared tenant (A p50 / p90 {s['a_ttfb_ms_p50']} "
            f"/ {s['a_ttfb_ms_p90']})")
