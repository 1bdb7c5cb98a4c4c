"""The segmenter's CPU per turn on one core, cut as a session cuts (gateway/turn_text.py, gateway/turn.py):
- `paragraph`: bench/gateway_load.py's paragraphs, each in one text.append + context.end: `push(limit=1)` (the
  first segment, in the handler), `release()` (the rest, in the callback after it), `end()`;
- `llm_deltas`: the same paragraphs as LLM deltas of 2-4 words: per delta the queued audio is set, the text pushed
  (the first one held to one segment and released after) and the segment timer's `next_deadline()` read (each
  text.append wakes it); then `end()`. `llm_deltas_queued`: the same with 2 s of audio queued after the first
  segment (later segments grow to whole sentences).
Each figure is the fastest of `--repeats` runs over every paragraph, per turn (and per delta), for normalisation
`auto` (the default) and `off`.

    python bench/segmenter_bench.py --repeats 50 --json bench/results/segmenter.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gateway_load import TEXTS, llm_deltas  # noqa: E402

from gateway.text.segmenter import ChunkingConfig, Segmenter  # noqa: E402

QUEUED_LATER_MS = 2000.0
CHUNKING = ChunkingConfig()  # a session's, made once


def paragraph(text: str, mode: str) -> None:
    segmenter = Segmenter(CHUNKING, normalize=mode)
    segmenter.set_queued_audio_ms(0.0)
    segmenter.push(text, limit=1)
    segmenter.release()
    segmenter.end()


def deltas(pieces: list[str], mode: str, queued_later_ms: float) -> None:
    segmenter = Segmenter(CHUNKING, normalize=mode)
    for piece in pieces:
        first = not segmenter.segments
        segmenter.set_queued_audio_ms(0.0 if first else queued_later_ms)
        segmenter.push(piece, limit=1 if first else None)
        if first:
            segmenter.release()
        segmenter.next_deadline()
    segmenter.end()


def fastest_us(run: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def measure(repeats: int) -> dict[str, dict[str, float]]:
    rng = random.Random(34)
    split = [llm_deltas(text, rng, (2, 4)) for text in TEXTS]
    per_turn = len(TEXTS)
    report: dict[str, dict[str, float]] = {}
    for mode in ("auto", "off"):
        us = fastest_us(lambda mode=mode: [paragraph(t, mode) for t in TEXTS], repeats)
        report[mode] = {"paragraph_us_per_turn": us / per_turn}
        for name, later in (("llm_deltas", 0.0), ("llm_deltas_queued", QUEUED_LATER_MS)):
            us = fastest_us(lambda mode=mode, later=later: [deltas(p, mode, later) for p in split], repeats)
            report[mode][f"{name}_us_per_turn"] = us / per_turn
            report[mode][f"{name}_us_per_delta"] = us / sum(len(p) for p in split)
        report[mode] = {k: round(v, 1) for k, v in report[mode].items()}
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=50, help="runs of each scenario; the fastest counts")
    ap.add_argument("--cpu", type=int, default=None, help="pin to this core (default: the first allowed one)")
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.cpu if args.cpu is not None else min(os.sched_getaffinity(0))})
    from gateway_proc import git_commit

    report = {"benchmark": "segmenter", "command": " ".join(["python", *sys.argv]), "git_commit": git_commit(),
              "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
              "turns": len(TEXTS), "words_per_turn": round(sum(len(t.split()) for t in TEXTS) / len(TEXTS), 1),
              "us": measure(args.repeats)}
    print(json.dumps(report["us"]))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
