"""Text normalisation's cost per segment (gateway.text.normalize) on one core: what `generation.normalize` adds to a
segment's TTFB, since a segment is normalised in the handler that releases it, right before its engine request.

Segments are what the real Segmenter releases for real text: the LLM fixtures (tests/data/llm_stream_*.txt) and
the LLM-style corpus (tests/data/normalize_corpus_*.txt, a number in nearly every sentence) in turns of eight
lines, fed in 1-4 character deltas. For each mode it reports, over those segments:
- `normalize_ms`: the normalisation of one segment (p50 / p90 / p99 / max, and the mean), cold: the span cache is
  cleared before each segment, so no number is ever served from an earlier one;
- `first_segment_ms`: the same for each turn's first segment alone (the one on the TTFB path);
- `push_us`: the segmenter's own cost per delta (cut checks included), normalisation off vs on;
- the share of segments that needed the grammar at all;
- `wall_of_numbers_ms`: one segment of 300 characters of prices and dates, the worst case the grammar budget
  (gateway.text.normalize.GRAMMAR_BUDGET_CHARS) bounds.

    python bench/normalize_bench.py --json bench/results/normalize.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gateway.text import normalize as spoken  # noqa: E402
from gateway.text.segmenter import ChunkingConfig, Segmenter, speak  # noqa: E402

DATA = ROOT / "tests" / "data"


def turns() -> list[str]:
    corpus = [(DATA / f"normalize_corpus_{name}.txt").read_text().splitlines() for name in ("en", "zh")]
    return [p.read_text() for p in sorted(DATA.glob("llm_stream_*.txt"))] + [
        "\n".join(lines[i:i + 8]) for lines in corpus for i in range(0, len(lines), 8)]


def deltas(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 4)
        out.append(text[i:i + n])
        i += n
    return out


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def segment_texts(texts: list[str]) -> list[tuple[int, str, str]]:
    """(turn, text as written, language) of every segment the segmenter releases."""
    out = []
    for k, text in enumerate(texts):
        segmenter = Segmenter(ChunkingConfig(), clock=Clock(), normalize="off")
        segments = [s for d in deltas(text, k) for s in segmenter.push(d)] + segmenter.end()
        lang = "zh" if spoken.contains_chinese(text) else "en"
        out += [(k, s.text, lang) for s in segments]
    return out


def percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)

    def at(q: float) -> float:
        return round(values[min(len(values) - 1, int(q * len(values)))], 4)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": round(values[-1], 4),
            "mean": round(statistics.fmean(values), 4), "n": len(values)}


def time_modes(segments: list[tuple[int, str, str]], repeats: int) -> dict[str, dict]:
    report = {}
    for mode in ("auto", "on"):
        per_segment, first, needed = [], [], 0
        seen_turns: set[int] = set()
        for turn, text, lang in segments:
            best = float("inf")
            for _ in range(repeats):
                spoken._cached_grammar.cache_clear()
                t0 = time.perf_counter()
                said = speak(text, mode, lang)
                best = min(best, time.perf_counter() - t0)
            ms = best * 1000.0
            per_segment.append(ms)
            needed += said != text
            if turn not in seen_turns:
                seen_turns.add(turn)
                first.append(ms)
        report[mode] = {"normalize_ms": percentiles(per_segment), "first_segment_ms": percentiles(first),
                        "segments_changed": round(needed / len(segments), 3)}
    return report


def time_wall(repeats: int) -> dict[str, float]:
    wall = " ".join(f"${i},{i:03d}.{i % 100:02d} on 2026-12-{i % 28 + 1:02d}" for i in range(20))[:300]
    out = {}
    for mode in ("auto", "on"):
        best = float("inf")
        for _ in range(repeats):
            spoken._cached_grammar.cache_clear()
            t0 = time.perf_counter()
            speak(wall, mode, "en")
            best = min(best, time.perf_counter() - t0)
        out[mode] = round(best * 1000.0, 2)
    return out


def time_push(texts: list[str]) -> dict[str, float]:
    out = {}
    for mode in ("off", "auto"):
        spent, n = 0.0, 0
        for k, text in enumerate(texts):
            segmenter = Segmenter(ChunkingConfig(), clock=Clock(), normalize=mode)
            for d in deltas(text, k):
                t0 = time.perf_counter()
                released = segmenter.push(d)
                elapsed = time.perf_counter() - t0
                if not released:  # the segmenter alone: pushes that normalised a segment are timed above
                    spent += elapsed
                    n += 1
        out[mode] = round(spent / n * 1e6, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", type=int, default=None, help="pin to this core (default: the first allowed one)")
    ap.add_argument("--repeats", type=int, default=3, help="timings per segment; the fastest counts")
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    args = ap.parse_args()
    cpu = args.cpu if args.cpu is not None else min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    t0 = time.perf_counter()
    spoken.preload()
    load_s = time.perf_counter() - t0
    texts = turns()
    segments = segment_texts(texts)
    from gateway_proc import git_commit

    report = {"command": " ".join(["python", *sys.argv]), "git_commit": git_commit(),
              "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": {"cpu": platform.processor() or platform.machine(), "cores_used": 1,
                          "platform": platform.platform(), "python": platform.python_version()},
              "grammar_load_s": round(load_s, 2), "turns": len(texts), "segments": len(segments),
              "modes": time_modes(segments, args.repeats), "push_us_per_delta": time_push(texts),
              "wall_of_numbers_ms": time_wall(args.repeats)}
    print(f"{len(segments)} segments from {len(texts)} turns; grammars loaded in {load_s:.2f} s")
    print(f"{'mode':6} {'changed':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} {'mean ms':>8}"
          f" {'1st p50':>8} {'1st p90':>8}")
    for mode, r in report["modes"].items():
        s, f = r["normalize_ms"], r["first_segment_ms"]
        print(f"{mode:6} {r['segments_changed']:>8} {s['p50']:>8} {s['p90']:>8} {s['p99']:>8} {s['max']:>8} "
              f"{s['mean']:>8} {f['p50']:>8} {f['p90']:>8}")
    print(f"segmenter push per delta (us): {report['push_us_per_delta']}")
    print(f"one 300-character segment of prices and dates (ms): {report['wall_of_numbers_ms']}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
