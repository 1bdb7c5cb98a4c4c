"""The engine's scheduler under the gateway's closed loop, on simulated time: a new turn's first audio and the later
segments' deadlines, with lean steps off and on (`VOXGATE_LEAN_STEPS`), in seconds on a CPU.

    python bench/scheduler_sim.py                         # 400 users; lean steps off, at 750 and at 2000 ms
    python bench/scheduler_sim.py --users 256 --mixed-full-rows 64 --lean 0,500 --json out.json

The real `engine.scheduler.Scheduler` picks every step (`schedule`, and `schedule_ahead` for the step launched behind
the one on the device, as `engine.worker.Worker.step` does); only the device is a model, fitted to the H200's step
times (`bench/results/`: random real-size VoxCPM2, 10 timesteps, fp32 VAE):

- a decode step of S sampling rows: the graph step, interpolated over (1, 7.9), (64, 19.9), (197, 45), (256, 60) ms
  (c=1, c=64, the closed-400 split half, c=256 in `2026-12-03-h200/`);
- a mixed step (any prompt chunk) adds 5.5 us per prefill position (s16b's bursts: 59 ms for 7,104 positions beside
  64 sampled rows; c=256: ~222 ms for 28,416 beside 256) and `--mixed-ms` (22: what the flat path costs over the
  graph; s16b: 64 decode rows on it took 41.5 ms against the graph's 19.9, padded to a 2,304-position LM graph;
  with 22 the gateway's closed 400 comes out at mixed steps 72 / 115 ms p50 / p99 and first-segment TTFB 198 / 271
  ms p50 / p90, measured 70 / 140 and 224 / 331); `--mixed-full-rows 64` makes that cost grow from none at 8 decode
  rows (s16b: 8 rows on the flat path took a graph step's time; the small LM graphs hold up to 63 sequences) to all
  of it at 64; `--mixed-ms 12` is a guess at what is left with the large LM graphs from 256 positions;
  `--mixed-floor-ms` bounds a mixed step below (a host-bound launch).

The gateway as `bench/gateway_load.py closed:N:mix` drives it: N users start over `--ramp` s and speak turns back to
back, each turn `--segments` segments of `--patches` patches (160 ms each); a turn's first segment is a text prompt
of `--first-positions`, each later one a continuation (`--later-positions`: the previous segment's audio and text)
sent when the previous one's last chunk arrives; the next turn starts when the last audio is sent (1.5 s ahead of
the listener). The gateway reports each turn's queued audio every 160 ms (`Buffered`; `--hint-at-submit`: also
when it sends a later segment). IPC 1 ms each way, 3 ms of host staging when no step was launched ahead.

Reported: first-segment TTFB (turn start -> first chunk at the gateway), later segments' TTFB, the server-caused gap
(the longest silence a turn's listener heard: a chunk arriving after the queued audio ran out), underrun turns with
a 200 ms client cushion, step times by kind, streams running and steps per second; turns started after the ramp.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import statistics
import sys
import types
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine import request as request_module
from engine import scheduler as scheduler_module
from engine.engine_config import EngineConfig
from engine.request import RequestSpec, SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler

P, D = 2, 4
PATCH_MS = 160.0
IPC_MS = 1.0
HOST_SYNC_MS = 3.0  # schedule + stage a step while the device waits (no step launched ahead)
HOST_AHEAD_MS = 1.0  # schedule_ahead while the device runs the step before
REPORT_MS = 160.0  # the gateway's reports: after each paced send (REPORT_INTERVAL_S 0.1, PACE_QUANTUM_MS 160)
MAX_LEAD_MS = 1500.0  # the gateway's lead over the listener: a turn is done when its last audio is sent
CUSHION_MS = 200.0
GRAPH_MS = ((1, 7.9), (64, 19.9), (197, 45.0), (256, 60.0))
PREFILL_US = 5.5


def interpolate(points: tuple[tuple[int, float], ...], x: float) -> float:
    """Piecewise linear through `points`, extended linearly past the last two."""
    xs = [p[0] for p in points]
    i = min(max(bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class Clock:
    """The scheduler's and the requests' `time.monotonic`: simulated seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@dataclass
class Step:
    seqs: list[ScheduledSeq]
    start: float
    end: float
    kind: str


@dataclass
class Turn:
    user: int
    index: int
    start: float
    segment: int = 0
    request_id: str = ""
    submitted: float = 0.0
    patches: int = 0
    first_audio: float | None = None
    play_end: float = 0.0  # when the listener's queued audio runs out (server's view)
    client_end: float = 0.0  # the same at the client, which starts playing CUSHION_MS after the first audio
    max_gap_ms: float = 0.0
    underrun: bool = False
    later_ttfb: list[float] = field(default_factory=list)
    next_report: float = 0.0
    last_patch: np.ndarray | None = None  # the latest patch: a later segment's prompt ends with it
    done: bool = False


class Sim:
    def __init__(self, args: argparse.Namespace, lean_ms: float):
        self.args = args
        self.clock = Clock()
        c = EngineConfig()
        self.s = Scheduler(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                           num_blocks=200_000, block_size=c.block_size, patch_ms=PATCH_MS, sit_out_ms=args.sit_out_ms,
                           max_prefill_tokens_while_speaking=c.max_prefill_tokens_while_speaking,
                           split_decodes_above=args.split_decodes_above or None, lean_ms=lean_ms)
        self.events: list[tuple[float, int, str, object]] = []  # (ms, seq, kind, payload)
        self.seq = itertools.count()
        self.turns: dict[str, Turn] = {}  # request id -> its turn
        self.active: list[Turn] = []
        self.finished: list[Turn] = []
        self.patch_values = itertools.count(1)  # every patch differs, as a model's do
        self.steps: list[Step] = []
        self.running: list[int] = []

    # ---- the device ------------------------------------------------------------------------------------------
    def step_ms(self, seqs: list[ScheduledSeq]) -> tuple[float, str]:
        prefill = sum(s.num_tokens for s in seqs if s.num_tokens > 1 or s.start < s.request.spec.prompt_len)
        rows = sum(s.emit for s in seqs)
        ms = interpolate(GRAPH_MS, max(rows, 1))
        if not prefill:
            return ms, "graph"
        mixed_ms = self.args.mixed_ms
        if self.args.mixed_full_rows:  # the flat path's cost grows with its decode rows: none up to 8 (s16b)
            decodes = sum(1 for s in seqs if s.num_tokens == 1 and s.start >= s.request.spec.prompt_len)
            mixed_ms *= min(1.0, max(0, decodes - 8) / max(1, self.args.mixed_full_rows - 8))
        ms += mixed_ms + PREFILL_US * prefill / 1000.0
        return max(ms, self.args.mixed_floor_ms), "mixed"

    def launch(self, seqs: list[ScheduledSeq], start: float) -> Step:
        ms, kind = self.step_ms(seqs)
        step = Step(seqs, start, start + ms, kind)
        self.steps.append(step)
        self.running.append(len(self.s.running))
        return step

    # ---- the gateway and its users ---------------------------------------------------------------------------
    def at(self, ms: float, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (ms, next(self.seq), kind, payload))

    def submit(self, turn: Turn, now: float) -> None:
        a = self.args
        first = turn.segment == 0
        n = a.first_positions if first else a.later_positions
        turn.request_id = f"u{turn.user}t{turn.index}s{turn.segment}"
        turn.submitted, turn.patches = now, 0
        self.turns[turn.request_id] = turn
        audio = [] if first else [(n - 1, turn.last_patch[None])]  # the previous segment's audio ends the prompt
        spec = RequestSpec(turn.request_id, list(range(n)), [0] * (n - 1) + [int(not first)], (P, D),
                           SamplingParams(max_length=a.patches, min_length=0), audio=audio, n_context=int(not first))
        self.at(now + IPC_MS, "add", spec)
        if not first and a.hint_at_submit:
            self.at(now + IPC_MS, "buffered", (turn.request_id, max(0.0, turn.play_end - now)))

    def start_turn(self, user: int, index: int, now: float) -> None:
        turn = Turn(user, index, now, next_report=now)
        self.active.append(turn)
        self.submit(turn, now)

    def chunk(self, rid: str, patch: np.ndarray, now: float) -> None:
        """A `patch` of `rid` reaches the gateway at `now`."""
        turn = self.turns.get(rid)
        if turn is None:
            return
        turn.patches += 1
        turn.last_patch = patch
        if turn.first_audio is None:
            turn.first_audio = now
            turn.play_end, turn.client_end = now, now + CUSHION_MS
        elif turn.patches == 1:
            turn.later_ttfb.append(now - turn.submitted)
        if now > turn.play_end:
            turn.max_gap_ms = max(turn.max_gap_ms, now - turn.play_end)
            turn.play_end = now
        if now > turn.client_end:
            turn.underrun = True
            turn.client_end = now
        turn.play_end += PATCH_MS
        turn.client_end += PATCH_MS
        if turn.patches < self.args.patches:
            return
        del self.turns[rid]
        turn.segment += 1
        if turn.segment < self.args.segments:
            self.submit(turn, now)
            return
        turn.done = True
        self.active.remove(turn)
        self.finished.append(turn)
        nxt = max(now, turn.play_end - MAX_LEAD_MS)
        if nxt < self.args.end_ms:
            self.at(nxt, "turn", (turn.user, turn.index + 1))

    def reports(self, now: float) -> None:
        """Every turn with audio out tells the engine its queue every REPORT_MS."""
        for turn in self.active:
            if turn.first_audio is not None and now >= turn.next_report:
                turn.next_report = now + REPORT_MS
                self.at(now + IPC_MS, "buffered", (turn.request_id, max(0.0, turn.play_end - now)))

    def deliver(self, until: float) -> None:
        """Gateway events up to `until` (ms), in order: user turns, and what reaches the worker."""
        while self.events and self.events[0][0] <= until:
            ms, _, kind, payload = heapq.heappop(self.events)
            self.clock.now = ms / 1000.0
            if kind == "add":
                self.s.add(payload)
            elif kind == "buffered":
                rid, queued = payload
                self.s.update_buffered(rid, queued)
            elif kind == "turn":
                self.start_turn(*payload, ms)
            elif kind == "chunks":
                for rid, patch in payload:
                    self.chunk(rid, patch, ms)

    # ---- the worker's loop (engine.worker.Worker.step) -------------------------------------------------------
    def run(self) -> None:
        a = self.args
        for u in range(a.users):
            self.at(a.ramp_ms * u / a.users, "turn", (u, 0))
        t = 0.0
        ahead: Step | None = None
        next_tick = 0.0
        while t < a.end_ms or self.active:
            if t > a.end_ms + 60_000:
                raise RuntimeError("the simulated engine never drained")
            while next_tick <= t:
                self.reports(next_tick)
                next_tick += 20.0
            self.deliver(t)
            self.clock.now = t / 1000.0
            if ahead is not None:
                current, ahead = ahead, None
            else:
                if not self.s.has_work:
                    t = min(self.events[0][0] if self.events else t + 20.0, next_tick)
                    continue
                seqs = self.s.schedule()
                if not seqs:
                    t += 1.0
                    continue
                current = self.launch(seqs, t + HOST_SYNC_MS)
            t += HOST_AHEAD_MS
            self.deliver(t)  # prompts already in the pipe join the step launched ahead
            self.clock.now = t / 1000.0
            nxt = self.s.schedule_ahead(current.seqs, admit=True, max_tokens=EngineConfig.max_num_batched_tokens)
            if nxt is not None:
                ahead = self.launch(nxt, current.end)
            t = max(t, current.end)
            self.deliver(t)
            self.clock.now = t / 1000.0
            seqs = current.seqs
            live = [s.request.status is request_module.Status.RUNNING for s in seqs]
            patches = [torch.full((P, D), float(next(self.patch_values))) if s.emit else None for s in seqs]
            self.s.postprocess(seqs, patches, [False] * len(seqs))
            out = [(s.request.request_id, p.numpy()) for s, p, alive in zip(seqs, patches, live, strict=True)
                   if p is not None and alive]
            if out:
                self.at(t + IPC_MS, "chunks", out)

    def summary(self, ramp_ms: float) -> dict:
        turns = [t for t in self.finished if t.start >= ramp_ms]
        ttfb = sorted(t.first_audio - t.start for t in turns)
        later = [x for t in turns for x in t.later_ttfb]
        gaps = sorted(t.max_gap_ms for t in turns)
        steady = [s for s in self.steps if s.start >= ramp_ms]
        wall_s = (steady[-1].end - steady[0].start) / 1000.0 if steady else 0.0

        def pct(xs: list[float], q: float) -> float | None:
            return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1) if xs else None

        def kind(k: str) -> dict:
            ms = sorted(s.end - s.start for s in steady if s.kind == k)
            return {"steps": len(ms), "ms_p50": pct(ms, 0.5), "ms_p99": pct(ms, 0.99)}

        running = [n for s, n in zip(self.steps, self.running, strict=True) if s.start >= ramp_ms]
        prefill = sum(q.num_tokens for s in steady for q in s.seqs
                      if q.num_tokens > 1 or q.start < q.request.spec.prompt_len)
        return {
            "turns": len(turns), "ttfb_ms_p50": pct(ttfb, 0.5), "ttfb_ms_p90": pct(ttfb, 0.9),
            "ttfb_ms_p99": pct(ttfb, 0.99), "later_ttfb_ms_mean": round(statistics.mean(later), 1) if later else None,
            "later_ttfb_ms_p99": pct(sorted(later), 0.99),
            "server_gap_ms_p99": pct(gaps, 0.99), "server_gap_ms_max": round(gaps[-1], 1) if gaps else None,
            "turns_with_gap": sum(g > 0 for g in gaps), "underrun_turns": sum(t.underrun for t in turns),
            "graph": kind("graph"), "mixed": kind("mixed"),
            "running_mean": round(statistics.mean(running), 1) if running else None,
            "steps_per_s": round(len(steady) / wall_s, 1) if wall_s else None,
            "prefill_positions_per_s": round(prefill / wall_s) if wall_s else None,
        }


def simulate(args: argparse.Namespace, lean_ms: float) -> dict:
    """One closed-loop run of the real scheduler on simulated time, lean steps at `lean_ms` (0: off); its summary."""
    sim = Sim(args, lean_ms)
    fake = types.SimpleNamespace(monotonic=sim.clock.monotonic)
    saved = scheduler_module.time, request_module.time
    scheduler_module.time = request_module.time = fake  # the scheduler's clock is the simulation's
    try:
        sim.run()
    finally:
        scheduler_module.time, request_module.time = saved
    return sim.summary(args.ramp_ms)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (`argv`, default sys.argv's), with the ramp and the end in ms."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=400)
    ap.add_argument("--ramp", type=float, default=6.0, help="seconds over which the users start")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of turns after the ramp")
    ap.add_argument("--segments", type=int, default=6, help="segments a turn")
    ap.add_argument("--patches", type=int, default=12, help="patches a segment (max_length)")
    ap.add_argument("--first-positions", type=int, default=30, help="prompt positions of a turn's first segment")
    ap.add_argument("--later-positions", type=int, default=85,
                    help="prompt positions of a later segment (the previous one's 12 patches and text, and its own)")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--sit-out-ms", type=float, default=EngineConfig.sit_out_ms)
    ap.add_argument("--split-decodes-above", type=int, default=EngineConfig.split_decodes_above, help="0: never")
    ap.add_argument("--mixed-ms", type=float, default=22.0, help="a mixed step's cost over a graph step of its rows "
                    "and its prefill positions")
    ap.add_argument("--mixed-full-rows", type=int, default=0, help="the mixed cost grows linearly from 8 decode "
                    "rows (none: s16b's 8-row flat step took a graph step's time) to this many (s16b: +21 ms at 64); "
                    "0: the same for any mixed step")
    ap.add_argument("--mixed-floor-ms", type=float, default=0.0, help="the least a mixed step takes (its host-bound "
                    "launch: a step of 64 decode rows on the flat path took 41 ms in s16b's bursts)")
    ap.add_argument("--lean", default="0,750,2000", help="VOXGATE_LEAN_STEPS values to run, comma-separated (0: off)")
    ap.add_argument("--hint-at-submit", action="store_true", help="the gateway also reports a later segment's queue "
                    "when it sends the segment (not only with its next send)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    args.ramp_ms, args.end_ms = 1000.0 * args.ramp, 1000.0 * (args.ramp + args.duration)
    return args


def main() -> None:
    args = parse_args()
    results = {}
    cols = ("ttfb_ms_p50", "ttfb_ms_p90", "ttfb_ms_p99", "later_ttfb_ms_mean", "server_gap_ms_p99",
            "server_gap_ms_max", "underrun_turns", "running_mean", "steps_per_s")
    print(f"{'lean ms':>8} {'turns':>5} " + " ".join(f"{c:>18}" for c in cols) + f" {'mixed p50/p99':>14}")
    for lean_ms in map(float, args.lean.split(",")):
        r = simulate(args, lean_ms)
        results[f"lean_{lean_ms:g}"] = r
        print(f"{lean_ms:>8g} {r['turns']:>5} " + " ".join(f"{r[c]!s:>18}" for c in cols)
              + f" {r['mixed']['ms_p50']!s:>6}/{r['mixed']['ms_p99']!s:<7}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "config": {
            k: v for k, v in vars(args).items() if k != "json"}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
