"""Where a burst's first-audio time goes: the client's side (`engine_bench.py --timeline`) lined up with the worker's
DEBUG log (`VOXGATE_LOG=DEBUG`: each request's arrival, each step's start and length, each publish).

For every batch level of at least `--min-concurrency` requests, in ms from the level's first request start:
the spread of the starts (the callers' own `generate` work: tokenizing, building the spec), when the requests
reached the worker, the prefill step (start, host launch, wall, GPU), when its audio was published and when the
clients had it.

    python bench/burst_timeline.py bursts.json bursts.log
"""

from __future__ import annotations

import argparse
import json
import re

ADD = re.compile(r"add \S+ at ([\d.]+)")
STEP = re.compile(r"step (\d+) \w+ at ([\d.]+): wall ([\d.]+) ms, gpu ([\d.-]+) ms, prefill (\d+) tokens"
                  r".*?(?:audio ([\d.-]+) ms)?$")
RECEIVED = re.compile(r"received (\d+) commands \(\d+ bytes\) at ([\d.]+), unpickled in ([\d.]+) ms")
AHEAD = re.compile(r"step (\d+) launched ahead in ([\d.]+) ms")
PUBLISHED = re.compile(r"published step \d+ at ([\d.]+): (\d+) chunks")


def bursts(result: dict, log: list[str], min_concurrency: int) -> list[dict]:
    """One row per burst (see the module docstring); times in ms from its first request's start."""
    adds = [float(m.group(1)) for line in log if (m := ADD.search(line))]
    steps = [(float(m.group(2)), float(m.group(3)), m.group(4), int(m.group(5)), int(m.group(1)), m.group(6))
             for line in log if (m := STEP.search(line))]
    ahead = {int(m.group(1)): float(m.group(2)) for line in log if (m := AHEAD.search(line))}
    received = [(float(m.group(2)), float(m.group(3))) for line in log if (m := RECEIVED.search(line))]
    published = [(float(m.group(1)), int(m.group(2))) for line in log if (m := PUBLISHED.search(line))]
    rows = []
    for level in result["levels"]:
        n = level["concurrency"]
        if level["mode"] != "batch" or n < min_concurrency or not level.get("timeline"):
            continue
        starts = [s for s, _ in level["timeline"]]
        t0, firsts = starts[0], sorted(s + ttfb / 1e3 for s, ttfb in level["timeline"])
        arrived = [a for a in adds if t0 <= a <= firsts[-1]][:n]
        prefill = next((s for s in steps if s[3] and t0 <= s[0] <= firsts[-1]), None)
        if prefill is None or not arrived:
            continue
        collected = prefill[0] + prefill[1] / 1e3
        publish = next((p for p in published if p[0] >= collected - 5e-4), None)
        ms = lambda t, t0=t0: round(1e3 * (t - t0), 1)  # noqa: E731
        # the pipe message(s) that brought the burst (logged from s11 on): when it arrived, unpickling it
        got = [r for r in received if starts[0] <= r[0] <= arrived[-1]]
        rows.append({"concurrency": n, "starts_ms": ms(starts[-1]), "arrived_ms": [ms(arrived[0]), ms(arrived[-1])],
                     "received_ms": [ms(got[0][0]), round(sum(u for _, u in got), 2), len(got)] if got else None,
                     "prefill_start_ms": ms(prefill[0]), "prefill_wall_ms": prefill[1],
                     # host time launching the prefill step itself (s15: 26-54 ms, at times longer than its GPU work)
                     "prefill_launch_ms": ahead.get(prefill[4]),
                     "prefill_gpu_ms": float(prefill[2]) if prefill[2] != "-" else None,
                     "prefill_tokens": prefill[3], "collected_ms": ms(collected),
                     # when the prefill step's audio was back, from its start on the device (None before s11)
                     "prefill_audio_ms": float(prefill[5]) if prefill[5] not in (None, "-") else None,
                     # host time launching the step after it (while it ran): a stall here delays its audio
                     "next_launch_ms": ahead.get(prefill[4] + 1),
                     "published_ms": ms(publish[0]) if publish else None,
                     "first_audio_ms": [ms(firsts[0]), ms(firsts[-1])], "ttfb_ms": level["ttfb_ms"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", help="engine_bench.py JSON written with --timeline")
    parser.add_argument("log", help="the same run's stderr with VOXGATE_LOG=DEBUG")
    parser.add_argument("--min-concurrency", type=int, default=8)
    args = parser.parse_args()
    with open(args.result) as f:
        result = json.load(f)
    with open(args.log) as f:
        log = f.read().splitlines()
    print("| c | starts end | received (ms, unpickle ms, messages) | adds handled | prefill start "
          "| launch | wall / GPU / audio | next launch | collected | published "
          "| clients have it | TTFB p50 / p90 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in bursts(result, log, args.min_concurrency):
        print(f"| {r['concurrency']} | {r['starts_ms']} | {r['received_ms']} "
              f"| {r['arrived_ms'][0]}-{r['arrived_ms'][1]} "
              f"| {r['prefill_start_ms']} | {r['prefill_launch_ms']} "
              f"| {r['prefill_wall_ms']:.1f} / {r['prefill_gpu_ms']} / "
              f"{r['prefill_audio_ms']} | {r['next_launch_ms']} | {r['collected_ms']} "
              f"| {r['published_ms']} | {r['first_audio_ms'][0]}-{r['first_audio_ms'][1]} "
              f"| {r['ttfb_ms']['p50']:.1f} / {r['ttfb_ms']['p90']:.1f} |")


if __name__ == "__main__":
    main()
