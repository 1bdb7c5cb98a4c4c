"""Gateway load benchmark: N concurrent sessions speaking turns, paragraphs sent whole or streamed as LLM deltas.

A level is N sessions, either all at once (`64`: every session connects, then all send their first paragraph at the
same instant, `--turns` turns back to back) or in closed loop (`closed:400`: sessions start over `--ramp` seconds and
speak turns back to back for `--duration` seconds after it; only turns that start after the ramp are counted). Each
turn is a ~60-word paragraph, sent whole (one text.append + context.end) or as an LLM streams it (`llm`: a few words
every 30-50 ms) or half the sessions each way (`mix`); a level may name its own mode and output format (`256:llm`,
`closed:400:mix`, `256:whole:pcm_s16le`: against the same level in Opus, what the encode pool adds).

Measured on the client side: TTFB (first text sent -> first audio frame), inter-frame arrival gaps, late frames
against a simulated playout buffer (each frame plays at its pts after a fixed cushion from the first frame; a frame
that arrives after its play time is late, and playback waits for it), errors. From the server (`context.done`
metrics): its own TTFB minus the engine's (the gateway's overhead) and `max_gap_ms` (the silence it caused). With
--spawn-server, the gateway's CPU per stream-second (its process's CPU time / the sum of its turns' durations).
Prints a table last; --json writes the results with the commit, machine, date and command.

    python bench/gateway_load.py --sessions 1,8,32 --turns 3               # in-process server, demo or --model
    python bench/gateway_load.py --spawn-server --engine paced --tick-ms 60 --max-length 12 \
        --sessions 256,closed:256:mix --client-procs 2                     # the gateway alone over the stand-in
    python bench/gateway_load.py --url ws://host:8080/v1/stream --sessions 64 --mode whole

In-process, the gateway and the load clients share one process and one event loop (its CPU figure is both) unless
--client-procs moves the clients to child processes; with --spawn-server the gateway runs alone in a child process
(bench/gateway_proc.py) and its own CPU per stream-second, per thread, and its event-loop lag are reported
(`--engine paced`: over the stand-in engine of bench/paced_engine.py instead of the real one). With the real engine
it runs as `voxgate serve` would (--fronts N, or VOXGATE_FRONTS): with fronts, `gateway_processes` has each process's
CPU, loop lag, garbage-collector pauses per generation and memory (the host, which relays every chunk, and each
front), `gateway_loop_lag_ms` is the worst front's, and `link_ms_*` is the link's share of the engine TTFB.

Where time goes, in the JSON: the overhead split into the server's share and the rest (`server_overhead_ms_*`,
`outside_server_ms_*`; `text_queued_ms_*`: the server's share that the first text spent read but waiting for its
handler); `underrun_detail` (each late frame's turn, pts, segment, time since the turn and the level
started, and what the server saw of that segment); `segment_detail` (from context.done's `segment_log`: the audio
queued for the listener when each later segment went to the engine, how long after its predecessor's last chunk, the
engine's TTFB and its longest mid-segment waits with when they happened); `engine_steps` (the engine's step times and
Triton compiles during the level: a stall shared by every stream shows there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway.client import ServerError, VoxgateClient  # noqa: E402
from gateway.protocol import AudioFrame  # noqa: E402

# ~60-word paragraphs, as a voice agent's LLM answers
TEXTS = [
    "Sure thing, the quickest way is to restart the router first. Unplug it and wait about thirty seconds before you "
    "plug it back in. Once the lights settle you can connect again from your laptop. If that still does not work we "
    "can look at the wireless settings together. I will stay on the line while you check them for me.",
    "Your order shipped this morning from our warehouse in Denver. It should arrive at your door by Friday afternoon. "
    "The tracking number is in the email we just sent to you. If nobody is home the driver will leave it at the front "
    "desk. Is there anything else I can do for you today?",
    "I have moved your appointment to Tuesday at ten in the morning. You will see the same doctor as last time. "
    "Please arrive fifteen minutes early to fill in the new forms. Bring your insurance card and a list of the "
    "medicines you take. If you need to cancel please call us at least a day before.",
]
MODES = ("whole", "llm", "mix")
FORMATS = ("opus", "pcm_s16le", "mulaw", "alaw")


@dataclass(frozen=True)
class Level:
    """N sessions all at once, or in closed loop (turns back to back for the duration); the text mode and the output
    format (None: the command's --mode / --format)."""

    sessions: int
    closed: bool = False
    mode: str | None = None
    format: str | None = None

    @property
    def name(self) -> str:
        parts = ("closed" if self.closed else "", str(self.sessions), self.mode or "", self.format or "")
        return ":".join(x for x in parts if x)


def parse_levels(spec: str) -> list[Level]:
    """`64,256,closed:400,256:llm,256:whole:pcm_s16le`: comma-separated levels, each a session count with optional
    `closed` (else `once`), a mode (whole, llm, mix) and an output format (opus, pcm_s16le, mulaw, alaw)."""
    levels = []
    for item in spec.split(","):
        n, closed, mode, fmt = 0, False, None, None
        for part in item.strip().split(":"):
            if part.isdigit():
                n = int(part)
            elif part in ("closed", "once"):
                closed = part == "closed"
            elif part in MODES:
                mode = part
            elif part in FORMATS:
                fmt = part
            else:
                raise argparse.ArgumentTypeError(f"level {item!r}: {part!r} is not a session count, closed, once, "
                                                 f"a mode ({', '.join(MODES)}) or a format ({', '.join(FORMATS)})")
        if n < 1:
            raise argparse.ArgumentTypeError(f"level {item!r}: no session count")
        levels.append(Level(n, closed, mode, fmt))
    return levels


def _range(spec: str) -> tuple[float, float]:
    lo, _, hi = spec.partition(",")
    a, b = float(lo), float(hi or lo)
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected LOW[,HIGH] with 0 < LOW <= HIGH")
    return a, b


def llm_deltas(text: str, rng: random.Random, words: tuple[float, float]) -> list[str]:
    """The text cut into deltas of `words` (low, high) words each, as an LLM's tokens arrive grouped by the
    agent's framework; joined, they are the text."""
    pieces = re.findall(r"\S+\s*", text)
    out, i = [], 0
    while i < len(pieces):
        k = rng.randint(int(words[0]), int(words[1]))
        out.append("".join(pieces[i:i + k]))
        i += k
    return out


def session_mode(level_mode: str, index: int) -> str:
    """A session's text mode: `mix` sends whole paragraphs from even sessions and LLM deltas from odd ones."""
    if level_mode == "mix":
        return "whole" if index % 2 == 0 else "llm"
    return level_mode


@dataclass
class TurnResult:
    turn: str = ""
    mode: str = "whole"
    start_s: float = 0.0  # when its text went out, seconds since the level started (one clock for all processes)
    ttfb_ms: float | None = None
    wall_ms: float = 0.0  # first text sent -> context.done: the turn's stream time
    audio_ms: float = 0.0
    gaps_ms: list[float] = field(default_factory=list)
    underruns: int = 0
    underrun_ms: float = 0.0
    # where each underrun happened: pts, time since the turn started, since the level started, which segment
    underrun_events: list[dict] = field(default_factory=list)
    segment_pts: list[tuple[int, float]] = field(default_factory=list)  # (segment, pts_ms) from segment.started
    server_metrics: dict = field(default_factory=dict)
    error: str | None = None


async def _stream_text(client: VoxgateClient, text: str, cid: str, mode: str, rng: random.Random,
                       args: argparse.Namespace) -> None:
    if mode == "whole":
        await client.append(text, cid)
    else:
        for delta in llm_deltas(text, rng, args.delta_words):
            await client.append(delta, cid)
            await asyncio.sleep(rng.uniform(*args.delta_ms) / 1000.0)
    await client.end(cid)


async def _turn(client: VoxgateClient, text: str, cid: str, mode: str, rng: random.Random,
                args: argparse.Namespace) -> TurnResult:
    result = TurnResult(turn=cid, mode=mode)
    t0 = time.perf_counter()
    # time.monotonic is CLOCK_MONOTONIC, shared by the client processes: underruns of different processes line up
    result.start_s = time.monotonic() - args.level_t0
    sender = asyncio.create_task(_stream_text(client, text, cid, mode, rng, args))
    last_arrival = None
    play_start = None  # wall time at which pts 0 plays
    frame_ms = 0.0
    try:
        # one deadline for the turn, not a timer per message: the client's own per-frame cost lands in the TTFB
        # and gaps it measures
        async with asyncio.timeout(120):
            while True:
                event = await client.recv()
                now = time.perf_counter()
                if isinstance(event, AudioFrame):
                    if client.indexes.get(event.index) != cid:
                        continue
                    if result.ttfb_ms is None:
                        result.ttfb_ms = (now - t0) * 1000.0
                        play_start = now + args.cushion_ms / 1000.0
                    else:
                        result.gaps_ms.append((now - last_arrival) * 1000.0)
                    due = play_start + event.pts_ms / 1000.0
                    if now > due:  # the listener ran dry: playback resumes when this frame arrives
                        result.underruns += 1
                        result.underrun_ms += (now - due) * 1000.0
                        # by pts, not arrival: the previous segment's last frames (held for the resampler and
                        # the last-frame flag) go out after the next segment.started
                        seg, seg_pts = max((x for x in result.segment_pts if x[1] <= event.pts_ms),
                                           key=lambda x: x[1], default=(None, 0.0))
                        result.underrun_events.append({
                            "turn": cid, "late_ms": round((now - due) * 1000.0, 1), "pts_ms": event.pts_ms,
                            "since_turn_ms": round((now - t0) * 1000.0, 1),
                            "at_s": round(result.start_s + now - t0, 3), "segment": seg,
                            "into_segment_ms": round(event.pts_ms - seg_pts, 1)})
                        play_start += now - due
                    last_arrival = now
                    frame_ms = client.session["output"]["frame_ms"]
                    result.audio_ms = event.pts_ms + frame_ms
                elif event.get("type") == "error":
                    raise ServerError(event)
                elif event.get("type") == "segment.started" and event.get("context_id") == cid:
                    result.segment_pts.append((event["segment"], event["pts_ms"]))
                elif event.get("type") == "context.done" and event.get("context_id") == cid:
                    result.server_metrics = event["metrics"]
                    result.wall_ms = (time.perf_counter() - t0) * 1000.0
                    _join_segment_log(result)
                    return result
    except (ServerError, TimeoutError, ConnectionError, OSError) as e:
        result.error = str(e) or type(e).__name__
        return result
    finally:
        sender.cancel()


def _join_segment_log(result: TurnResult) -> None:
    """Add to each underrun what the server saw of its segment (context.done's `segment_log`): how much audio the
    listener had queued when the segment was submitted (`lead_ms`), its engine TTFB, its longest wait for a later
    chunk, and when the previous segment's last chunk came out of the engine."""
    log = {s["segment"]: s for s in result.server_metrics.get("segment_log") or []}
    for e in result.underrun_events:
        seg = log.get(e["segment"])
        if seg is None:
            continue
        prev = log.get(e["segment"] - 1) or {}
        e.update(seg_submit_ms=seg.get("submit_ms"), seg_lead_ms=seg.get("lead_ms"),
                 seg_engine_ttfb_ms=seg.get("engine_ttfb_ms"), seg_max_wait_ms=seg.get("max_wait_ms"),
                 prev_seg_done_ms=prev.get("done_ms"))


async def _session(url: str, index: int, level: Level, args: argparse.Namespace) -> list[TurnResult]:
    """Connect and start, wait for the level's go (plus this session's place in the ramp, closed loop), then turns
    back to back: `--turns` of them, or until the closed loop's end."""
    mode = session_mode(level.mode or args.mode, index)
    rng = random.Random(index)  # the same deltas at each run
    go = args.level_t0 + (args.ramp * index / level.sessions if level.closed else 0.0)
    end = args.level_t0 + args.ramp + args.duration
    results = []
    try:
        client = await VoxgateClient.connect(url, api_key=args.api_key)
    except Exception as e:
        return [TurnResult(mode=mode, error=f"connect: {e}")]
    async with client:
        try:
            generation = {"continuation": not args.no_continuation, "seed": index}
            if args.max_length:
                generation["max_length"] = args.max_length
            await client.start(output={"format": level.format or args.format}, generation=generation)
        except ServerError as e:
            return [TurnResult(mode=mode, error=str(e))]
        await asyncio.sleep(max(0.0, go - time.monotonic()))
        turn = 0
        while time.monotonic() < end if level.closed else turn < args.turns:
            result = await _turn(client, TEXTS[(index + turn) % len(TEXTS)], f"s{index}t{turn}", mode, rng, args)
            results.append(result)
            turn += 1
            if result.error is not None:
                break
    return results


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 1)


def _summary(level: Level, turns: list[TurnResult], wall_s: float, cpu_s: float, args: argparse.Namespace,
             gateway: dict | None = None) -> dict:
    done = [t for t in turns if t.error is None and t.ttfb_ms is not None]
    # closed loop: the steady state, turns that started after the ramp (all turns count towards the CPU figures:
    # the CPU was measured over the whole level)
    ok = [t for t in done if t.start_s >= args.ramp] if level.closed else done
    timed = [t for t in ok if t.server_metrics.get("ttfb_ms") is not None
             and t.server_metrics.get("engine_ttfb_ms") is not None]
    outside = [t.ttfb_ms - t.server_metrics["ttfb_ms"] for t in timed]
    overhead = [t.ttfb_ms - t.server_metrics["engine_ttfb_ms"] for t in timed]
    gaps = [g for t in ok for g in t.gaps_ms]
    later = [t.server_metrics.get("later_segment_engine_ttfb_ms") for t in ok]
    later = [x for x in later if x is not None]
    audio_s = sum(t.audio_ms for t in done) / 1000.0
    stream_s = sum(t.wall_ms for t in done) / 1000.0
    starts = [t.start_s for t in done if t.turn.endswith("t0")]
    modes = sorted({t.mode for t in ok})
    return {
        "level": level.name, "sessions": level.sessions, "closed_loop": level.closed,
        "mode": level.mode or args.mode, "format": level.format or args.format, "turns": len(turns),
        "errors": len(turns) - len(done), "error_examples": sorted({t.error for t in turns if t.error})[:3],
        **_latency(ok),
        "by_mode": {m: _latency([t for t in ok if t.mode == m]) for m in modes} if len(modes) > 1 else None,
        # what the gateway adds to first audio as the client sees it: client TTFB - engine TTFB, split into the
        # server's share (server_overhead: text read off the socket -> first audio written, minus the engine's) and
        # what lies around the server (client TTFB - server TTFB: the client's send and receive, the kernel's queues);
        # text_queued: the first text's wait between the socket read and its handler (a burst of other turns'), a
        # part of the server's share
        "gateway_overhead_ms_p50": _pct(overhead, 0.5), "gateway_overhead_ms_p90": _pct(overhead, 0.9),
        "outside_server_ms_p50": _pct(outside, 0.5), "outside_server_ms_p90": _pct(outside, 0.9),
        "server_ttfb_ms_p50": _pct([t.server_metrics["ttfb_ms"] for t in timed], 0.5),
        **{f"text_queued_ms_p{q}": _pct([m for t in timed if (m := t.server_metrics.get("text_queued_ms")) is not None],
                                        q / 100) for q in (50, 90)},
        "client_gap_ms_p50": _pct(gaps, 0.5), "client_gap_ms_p99": _pct(gaps, 0.99),
        "client_gap_ms_max": _pct(gaps, 1.0),
        "server_rtf_mean": round(statistics.mean(t.server_metrics["rtf"] for t in ok if t.server_metrics.get("rtf")),
                                 4) if ok else None,
        "later_segment_engine_ttfb_ms_mean": round(statistics.mean(later), 1) if later else None,
        # an at-once level's first turns should start together: how far apart they went out
        "first_turn_start_spread_ms": round(1000.0 * (max(starts) - min(starts)), 1) if starts else None,
        "underrun_detail": _underrun_detail(ok), "segment_detail": _segment_detail(ok),
        "waves": None if level.closed else _waves(timed),
        "audio_s": round(audio_s, 2), "stream_s": round(stream_s, 2), "wall_s": round(wall_s, 2),
        "streams_mean": round(stream_s / wall_s, 1) if wall_s else None,
        "audio_s_per_s": round(audio_s / wall_s, 2) if wall_s else None,
        # this process's CPU (the in-process gateway and the load clients together) per second of audio delivered
        "process_cpu_ms_per_audio_s": round(1000.0 * cpu_s / audio_s, 2) if audio_s else None,
        **_gateway_summary(gateway, audio_s, stream_s),
    }


def _latency(turns: list[TurnResult]) -> dict:
    """The issue's figures over these turns: client TTFB, the server's overhead (its TTFB - the engine's), the
    silence the server caused (`max_gap_ms` per turn) and the frames that came after their play time."""
    ttfb = [t.ttfb_ms for t in turns if t.ttfb_ms is not None]
    engine = [t.server_metrics["engine_ttfb_ms"] for t in turns if t.server_metrics.get("engine_ttfb_ms") is not None]
    timed = [t.server_metrics for t in turns if t.server_metrics.get("ttfb_ms") is not None
             and t.server_metrics.get("engine_ttfb_ms") is not None]
    server_side = [m["ttfb_ms"] - m["engine_ttfb_ms"] for m in timed]
    link = [m["link_ms"] for m in timed if m.get("link_ms") is not None]
    link_request = [m["link_request_ms"] for m in timed if m.get("link_request_ms") is not None]
    # LLM deltas: the first segment leaves once the segmenter has a clause (or its max delay passed); that wait for
    # text is in the server's TTFB, so the overhead is also given without it (the first segment's submit time)
    text_wait = [m["segment_log"][0]["submit_ms"] for m in timed if m.get("segment_log")]
    after_text = [m["ttfb_ms"] - m["engine_ttfb_ms"] - m["segment_log"][0]["submit_ms"] for m in timed
                  if m.get("segment_log")]
    # of after_text, the first frame's encode call (Opus: its hop to the encoder process and its wait there)
    first_encode = [m["first_encode_ms"] for m in timed if m.get("first_encode_ms") is not None]
    # of after_text, the wait of the delivered first chunk for its turn's task (a burst's other turns ahead of it)
    chunk_queued = [m["chunk_queued_ms"] for m in timed if m.get("chunk_queued_ms") is not None]
    server_gaps = [t.server_metrics["max_gap_ms"] for t in turns if t.server_metrics.get("max_gap_ms") is not None]
    return {
        "turns_counted": len(turns),
        "ttfb_ms_p50": _pct(ttfb, 0.5), "ttfb_ms_p90": _pct(ttfb, 0.9), "ttfb_ms_p99": _pct(ttfb, 0.99),
        "engine_ttfb_ms_p50": _pct(engine, 0.5), "engine_ttfb_ms_p90": _pct(engine, 0.9),
        "server_overhead_ms_p50": _pct(server_side, 0.5), "server_overhead_ms_p90": _pct(server_side, 0.9),
        # --fronts: the link's share of the engine TTFB (request front -> host + first chunk host -> front)
        "link_ms_p50": _pct(link, 0.5), "link_ms_p90": _pct(link, 0.9),
        "link_request_ms_p50": _pct(link_request, 0.5), "link_request_ms_p90": _pct(link_request, 0.9),
        "text_wait_ms_p50": _pct(text_wait, 0.5), "text_wait_ms_p90": _pct(text_wait, 0.9),
        "server_overhead_after_text_ms_p50": _pct(after_text, 0.5),
        "server_overhead_after_text_ms_p90": _pct(after_text, 0.9),
        "first_encode_ms_p50": _pct(first_encode, 0.5), "first_encode_ms_p90": _pct(first_encode, 0.9),
        "chunk_queued_ms_p50": _pct(chunk_queued, 0.5), "chunk_queued_ms_p90": _pct(chunk_queued, 0.9),
        "server_gap_ms_p99": _pct(server_gaps, 0.99), "server_gap_ms_max": _pct(server_gaps, 1.0),
        "server_gap_turns_over_100ms": sum(g > 100.0 for g in server_gaps),
        "late_frames": sum(t.underruns for t in turns), "late_ms_total": round(sum(t.underrun_ms for t in turns)),
        "underrun_turns": sum(t.underruns > 0 for t in turns),
    }


def _waves(turns: list[TurnResult], gap_ms: float = 10.0) -> list[dict]:
    """An at-once level's turns grouped by the engine step that gave them their first chunk: the engine admits a
    burst in one prefill step or spreads it over several (its timing decides), and a front's k-th first chunk of one
    step waits for the k - 1 ahead of it, so the gateway's share is compared wave by wave. A turn's first chunk
    reached its front at about its text's send time + the text's wait + the engine's TTFB (one clock for every
    client process); a pause of over `gap_ms` between two of them starts a new wave."""
    at = sorted((t.start_s * 1000.0 + t.server_metrics["segment_log"][0]["submit_ms"]
                 + t.server_metrics["engine_ttfb_ms"], t) for t in turns if t.server_metrics.get("segment_log"))
    waves: list[list[TurnResult]] = []
    last = None
    for ms, t in at:
        if last is None or ms - last > gap_ms:
            waves.append([])
        waves[-1].append(t)
        last = ms
    out = []
    for wave in waves:
        m = [t.server_metrics for t in wave]
        out.append({"turns": len(wave), "engine_ttfb_ms_p50": _pct([x["engine_ttfb_ms"] for x in m], 0.5),
                    "server_overhead_ms_p50": _pct([x["ttfb_ms"] - x["engine_ttfb_ms"] for x in m], 0.5),
                    "text_wait_ms_p50": _pct([x["segment_log"][0]["submit_ms"] for x in m], 0.5),
                    "after_text_ms_p50": _pct([x["ttfb_ms"] - x["engine_ttfb_ms"] - x["segment_log"][0]["submit_ms"]
                                               for x in m], 0.5),
                    "first_encode_ms_p50": _pct([x["first_encode_ms"] for x in m if "first_encode_ms" in x], 0.5),
                    "chunk_queued_ms_p50": _pct([x["chunk_queued_ms"] for x in m
                                                 if x.get("chunk_queued_ms") is not None], 0.5)})
    return out


def _underrun_detail(turns: list[TurnResult], max_turns: int = 40) -> dict:
    """Where underruns happened: in a turn's first segment (engine TTFB / start-up) or a later one (the next segment
    came too late), how far into the turn, and when in the level (turns of different sessions that underrun at the
    same `at_s` point to a stall shared by all streams: the engine or the gateway's loop, not one turn's pipeline)."""
    events = [e for t in turns for e in t.underrun_events]
    if not events:
        return {"events": 0}
    by_turn = []
    for t in sorted((t for t in turns if t.underrun_events), key=lambda t: -t.underrun_ms)[:max_turns]:
        worst = max(t.underrun_events, key=lambda e: e["late_ms"])
        by_turn.append({"turn": t.turn, "start_s": round(t.start_s, 3), "underruns": t.underruns,
                        "underrun_ms": round(t.underrun_ms, 1), "segments": len(t.segment_pts),
                        "first": t.underrun_events[0], "worst": worst})
    return {
        "events": len(events),
        "in_first_segment": sum(e["segment"] == 0 for e in events),
        "in_later_segments": sum((e["segment"] or 0) > 0 for e in events),
        "late_ms_in_first_segment": round(sum(e["late_ms"] for e in events if e["segment"] == 0)),
        "late_ms_in_later_segments": round(sum(e["late_ms"] for e in events if (e["segment"] or 0) > 0)),
        "since_turn_ms_p50": _pct([e["since_turn_ms"] for e in events], 0.5),
        "at_s_of_worst_per_turn": sorted(b["worst"]["at_s"] for b in by_turn),
        "turns": by_turn,
    }


def _segment_detail(turns: list[TurnResult]) -> dict:
    """From the server's `segment_log`: how much audio the listener had queued when each later segment was
    submitted (`lead_ms`: the time the engine had for it), engine TTFB, and the longest wait for a chunk after the
    first (an engine that fell behind mid-segment), with when the longest of those waits happened."""
    logs = [(t, s) for t in turns for s in t.server_metrics.get("segment_log") or []]
    later = [s for _, s in logs if s["segment"] > 0]
    waits = [s["max_wait_ms"] for _, s in logs]
    stalls = sorted(({"turn": t.turn, "segment": s["segment"], "wait_ms": s["max_wait_ms"],
                      "at_s": round(t.start_s + (s.get("max_wait_end_ms") or 0.0) / 1000.0, 3)}
                     for t, s in logs if s["max_wait_ms"] >= 300.0), key=lambda x: x["at_s"])
    lead = [s["lead_ms"] for s in later]
    # how long after the previous segment's last chunk left the engine each later segment was submitted (the
    # gateway's own dead time: its continuation prompt was known from then on), and the least audio queued at a
    # submission that waited (> 50 ms) for the listener rather than for the engine
    delays: list[tuple[float, float]] = []
    for t in turns:
        log = {s["segment"]: s for s in t.server_metrics.get("segment_log") or []}
        for k, s in log.items():
            prev = log.get(k - 1)
            if k > 0 and prev is not None and prev.get("done_ms") is not None:
                delays.append((s["submit_ms"] - prev["done_ms"], s["lead_ms"]))
    return {
        "segments": len(logs), "later_segments": len(later),
        "later_lead_ms_min": _pct(lead, 0.0), "later_lead_ms_p10": _pct(lead, 0.1),
        "later_lead_ms_p50": _pct(lead, 0.5),
        "submit_after_prev_done_ms_p50": _pct([d for d, _ in delays], 0.5),
        "submit_after_prev_done_ms_p90": _pct([d for d, _ in delays], 0.9),
        "submit_after_prev_done_ms_max": _pct([d for d, _ in delays], 1.0),
        "lead_ms_min_when_submit_waited": _pct([lead for d, lead in delays if d > 50.0], 0.0),
        "later_engine_ttfb_ms_p50": _pct([s["engine_ttfb_ms"] for s in later if s.get("engine_ttfb_ms")], 0.5),
        "later_engine_ttfb_ms_max": _pct([s["engine_ttfb_ms"] for s in later if s.get("engine_ttfb_ms")], 1.0),
        "chunk_wait_ms_p99": _pct(waits, 0.99), "chunk_wait_ms_max": _pct(waits, 1.0),
        "waits_over_300ms": stalls[:40],
    }


def _step_detail(before: list[dict], after: list[dict]) -> dict | None:
    """Engine step times between two snapshots of the workers' `step_hist` (engine.worker.StepStats), by step kind:
    count, p50, p99 and max wall ms and device ms (a wall far above the device time: the host is the bottleneck).
    A max near the longest underrun means the engine itself stalled."""
    try:
        from engine.worker import hist_percentile
    except ImportError:
        return None
    hists: dict[str, dict[int, int]] = {}
    for b, a in zip(before, after, strict=False):
        for name, counts in (a.get("step_hist") or {}).items():
            old = {int(k): v for k, v in ((b.get("step_hist") or {}).get(name) or {}).items()}
            diff = hists.setdefault(name, {})
            for bucket, c in counts.items():
                n = c - old.get(int(bucket), 0)
                if n:
                    diff[int(bucket)] = diff.get(int(bucket), 0) + n
    out: dict[str, Any] = {}
    for name, h in sorted(hists.items()):
        kind, _, clock = name.rpartition("_")  # "<kind>_wall" / "<kind>_gpu": host wall clock / device time
        if h and clock in ("wall", "gpu"):
            row = out.setdefault(kind, {"steps": sum(h.values())} if clock == "wall" else {})
            row.update({f"{clock}_ms_p50": _round(hist_percentile(h, 50)),
                        f"{clock}_ms_p99": _round(hist_percentile(h, 99)),
                        f"{clock}_ms_max": _round(hist_percentile(h, 100))})
    if not out:
        return None
    # a Triton compile mid-level (a shape the warm-up did not cover) stalls every stream for its duration
    for key in ("triton_compiles", "prefill_tokens"):
        out[key] = sum((a.get(key) or 0) - (b.get(key) or 0) for b, a in zip(before, after, strict=False))
    return out


def _machine_busy_s() -> float | None:
    """CPU seconds every core of this machine has been busy since boot (/proc/stat), or None off Linux: the level's
    share shows whether the gateway, the engine's host thread and the clients contend for cores."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _gateway_summary(gateway: dict | None, audio_s: float, stream_s: float) -> dict:
    """--spawn-server: the gateway's own CPU (per stream-second, per audio second, per thread and per process: the
    host, each front with its encoder processes), the engine worker's CPU, the worst front's event-loop lag, and per
    process its loop lag, garbage-collector pauses by generation and resident memory."""
    if gateway is None:
        return {}
    used = gateway["used"]
    out = {"gateway_cpu_ms_per_stream_s": round(1000.0 * used["cpu_s"] / stream_s, 2) if stream_s else None,
           "gateway_cpu_ms_per_audio_s": round(1000.0 * used["cpu_s"] / audio_s, 2) if audio_s else None,
           "gateway_cores_used": round(used["cpu_s"] / used["wall_s"], 3) if used.get("wall_s") else None,
           "gateway_threads_cpu_s": used["threads_cpu_s"], "gateway_loop_lag_ms": gateway["loop_lag"],
           "gateway_lag_ms_p99": (gateway["loop_lag"] or {}).get("p99_ms")}
    if "processes" in gateway:
        cpu = used.get("processes_cpu_s", {})
        host = gateway["processes"].get("host")  # with fronts: the engine's process, relaying every chunk
        out.update(gateway_fronts=gateway.get("fronts"), gateway_worst_front=gateway.get("worst_front"),
                   host_loop_lag_ms_p99=host["loop_lag"]["p99_ms"] if host else None,
                   engine_worker_cpu_s=used.get("engine_worker_cpu_s"),
                   gateway_processes={role: {"cpu_s": cpu.get(role), "loop_lag_ms": p["loop_lag"], "gc": p["gc"],
                                             "rss_mb": p.get("rss_mb"), "rss_peak_mb": p.get("rss_peak_mb")}
                                      for role, p in gateway["processes"].items()})
    return out


def _client_proc(conn: Any, url: str, indexes: list[int], level: Level, args: argparse.Namespace) -> None:
    """--client-procs: one process's share of the sessions; its turns go back through `conn`."""
    if args.client_nice:  # the load stands in for clients on other machines: it yields the cores to the gateway
        os.nice(args.client_nice)

    async def run() -> list[list[TurnResult]]:
        return await asyncio.gather(*(_session(url, i, level, args) for i in indexes))

    conn.send([asdict(t) for s in asyncio.run(run()) for t in s])
    conn.close()


def _sessions_in_processes(url: str, level: Level, args: argparse.Namespace) -> list[TurnResult]:
    ctx = mp.get_context("spawn")
    workers = []
    n = level.sessions
    for p in range(min(args.client_procs, n)):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_client_proc, args=(send, url, list(range(p, n, args.client_procs)), level, args),
                           daemon=True)
        proc.start()
        send.close()
        workers.append((proc, recv))
    turns = []
    for proc, recv in workers:
        try:
            turns += [TurnResult(**t) for t in recv.recv()]
        except EOFError:
            turns.append(TurnResult(error="a client process died"))
        proc.join(10)
    return turns


async def _level(url: str, level: Level, args: argparse.Namespace) -> list[TurnResult]:
    if args.client_procs:  # off this process (and its event loop, which may be the gateway's)
        return await asyncio.to_thread(_sessions_in_processes, url, level, args)
    per_session = await asyncio.gather(*(_session(url, i, level, args) for i in range(level.sessions)))
    return [t for s in per_session for t in s]


async def _run(args: argparse.Namespace) -> list[dict]:
    runner = engine = proc = None
    url = args.url
    if args.spawn_server:
        from gateway_proc import GatewayProcess

        engine_args = ["--engine", "real", *(["--model", args.model] if args.model else [])] \
            if args.engine == "real" else ["--engine", "paced", *(["--tick-ms", str(args.tick_ms)] if args.tick_ms
                                                                 else []),
                                           *(["--ms-per-char", "1000"] if args.max_length else []),
                                           "--compile-stall-ms", str(args.compile_stall_ms)]
        profile = ["--profile", args.profile] if args.profile else []
        seqs = [] if args.max_num_seqs is None else ["--max-num-seqs", str(args.max_num_seqs)]
        gc_threshold = ["--gc-threshold", args.gc_threshold] if args.gc_threshold else []
        fronts = ["--fronts", args.fronts] if args.fronts else []
        proc = await asyncio.to_thread(GatewayProcess, *engine_args, *profile, *seqs, *gc_threshold, *fronts)
        url = proc.url
    elif url is None:
        from engine import Engine
        from gateway.server import ServerConfig, create_app, start_server

        engine = Engine.from_pretrained(args.model, **({} if args.max_num_seqs is None else
                                                       {"max_num_seqs": args.max_num_seqs}))
        await engine.wait_for_ready()
        if engine.model_info().is_demo:
            print("note: tiny demo model (random weights): timings are the gateway's, the audio is not speech",
                  file=sys.stderr)
        config = ServerConfig(web_client_dir=None)
        runner, port = await start_server(create_app(engine, config))
        url = f"ws://127.0.0.1:{port}/v1/stream"
    results = []
    try:
        if not args.no_warmup:
            await _warm_up(url, args)
        for level in args.sessions:
            if proc is not None:
                await asyncio.to_thread(proc.reset)
                before = await asyncio.to_thread(proc.stats)
            steps0 = _worker_stats(engine)
            t0, cpu0, machine0 = time.perf_counter(), time.process_time(), _machine_busy_s()
            # the instant the level's turns begin: client processes start and sessions connect meanwhile
            args.level_t0 = time.monotonic() + args.start_delay
            spy = None
            if proc is not None and args.py_spy:  # sampled in the level's steady state: after the ramp
                spy = asyncio.create_task(_spy(proc.spy_pids(), level, args))
            turns = await _level(url, level, args)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            gateway = None
            if proc is not None:
                from gateway_proc import delta

                after = await asyncio.to_thread(proc.stats)
                gateway = {"used": delta(before, after), "loop_lag": after["loop_lag"],
                           **{k: after[k] for k in ("processes", "fronts", "worst_front") if k in after}}
                steps = _step_detail(before["engine"].get("workers", []), after["engine"].get("workers", []))
            else:
                if runner is not None and args.client_procs:  # this process is the gateway alone
                    gateway = {"used": {"cpu_s": cpu, "wall_s": wall, "threads_cpu_s": None}, "loop_lag": None}
                steps = _step_detail(steps0, _worker_stats(engine))
            busy = _machine_busy_s()
            machine = None if busy is None or machine0 is None else round((busy - machine0) / wall, 2)
            results.append({**_summary(level, turns, wall, cpu, args, gateway), "engine_steps": steps,
                            "machine_cores_busy": machine, **({"py_spy": await spy} if spy is not None else {})})
            print(_table(results[-1:], header=len(results) == 1), file=sys.stderr, flush=True)  # progress
    finally:
        if proc is not None:
            await asyncio.to_thread(proc.close)
        if runner is not None:
            await runner.cleanup()
        if engine is not None:
            await engine.stop()
    return results


async def _spy(pids: dict[str, int], level: Level, args: argparse.Namespace) -> dict:
    """--py-spy: the gateway's processes (the host, and one front when there are fronts) sampled at the same time
    for that many seconds each way (GIL holder, then every thread): in closed loop from 2 s after the ramp (the
    steady state), else from just before the turns begin (the burst)."""
    from py_spy import record

    await asyncio.sleep(args.start_delay + (2.0 + args.ramp if level.closed else -0.2))
    tag = level.name.replace(":", "_")
    spies = await asyncio.gather(*(record(pid, args.py_spy, Path(args.py_spy_dir), f"{tag}_{role}")
                                   for role, pid in pids.items()))
    return spies[0] if len(pids) == 1 else dict(zip(pids, spies, strict=True))


async def _warm_up(url: str, args: argparse.Namespace) -> None:
    """One short turn before the first level, so a fresh gateway's first-time costs (codec set-up, first engine
    requests of a shape) are no level's."""
    async with await VoxgateClient.connect(url, api_key=args.api_key) as client:
        await client.start(output={"format": args.format}, generation={"max_length": args.max_length or 4})
        await client.speak("Warming up. One more clause.", "warmup", timeout=120)


def _worker_stats(engine: Any) -> list[dict]:
    """The in-process engine's workers' stats (their step-time histograms); [] without one."""
    return [] if engine is None else [w.get("stats", {}) for w in engine.health()["workers"]]


def _table(results: list[dict], header: bool = True) -> str:
    cols = [("level", "level"), ("turns_counted", "turns"), ("ttfb_ms_p50", "TTFB p50"), ("ttfb_ms_p90", "p90"),
            ("engine_ttfb_ms_p50", "engine p50"), ("engine_ttfb_ms_p90", "p90"),
            ("server_overhead_ms_p50", "server +ms p50"), ("server_overhead_ms_p90", "p90"),
            ("server_gap_ms_p99", "server gap p99"), ("server_gap_ms_max", "max"),
            ("late_frames", "late frames"), ("late_ms_total", "late ms"), ("underrun_turns", "underrun turns"),
            ("link_ms_p50", "link p50"), ("gateway_cpu_ms_per_stream_s", "gateway CPU ms/stream s"),
            ("gateway_lag_ms_p99", "front lag p99"), ("streams_mean", "streams"),
            ("errors", "errors")]
    lines = [" | ".join(h for _, h in cols)] if header else []
    lines += [" | ".join(str(r.get(k)) for k, _ in cols) for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running gateway (default: start one in-process)")
    ap.add_argument("--spawn-server", action="store_true", help="start the gateway in a child process "
                    "(bench/gateway_proc.py) and report its own CPU and event-loop lag")
    ap.add_argument("--model", help="model for the in-process server (default: demo / VoxCPM2 on GPU)")
    ap.add_argument("--engine", choices=("real", "paced"), default="real", help="--spawn-server: the real engine, or "
                    "the paced stand-in (bench/paced_engine.py: a patch per request per tick, no model)")
    ap.add_argument("--tick-ms", type=float, help="--engine paced: ms per patch (default 160: real time; 60 is the "
                    "real engine's RTF of ~0.37 at 256 streams); with --max-length every segment speaks exactly "
                    "that many patches")
    ap.add_argument("--max-num-seqs", type=int, help="real engine: concurrent requests (default: the engine's)")
    ap.add_argument("--compile-stall-ms", type=float, default=0.0, help="--engine paced: the first step serving a "
                    "continuation segment stalls this long, once (as a kernel compiled mid-serving would)")
    ap.add_argument("--fronts", help="--spawn-server, real engine: the gateway's front processes (N or auto; "
                    "default: the served default, VOXGATE_FRONTS)")
    ap.add_argument("--gc-threshold", help="--spawn-server: the gateway's garbage-collector thresholds, "
                    "GEN0[,GEN1[,GEN2]] (default: as served)")
    ap.add_argument("--api-key")
    ap.add_argument("--client-procs", type=int, default=0, help="run the sessions in this many client processes "
                    "(default 0: in this process, sharing the event loop with an in-process gateway)")
    ap.add_argument("--client-nice", type=int, default=0, help="--client-procs: run them this many nice levels below "
                    "the gateway (0..19), so that clients sharing the gateway's machine, which stand in for clients "
                    "on other machines, take the cores the gateway leaves idle rather than its own share")
    ap.add_argument("--sessions", type=parse_levels, default=parse_levels("1,4"),
                    help="comma-separated levels: N (all at once), closed:N (closed loop), optionally :whole, :llm "
                    "or :mix (default: --mode) and a format (default: --format), e.g. 64,256:pcm_s16le,closed:400:mix")
    ap.add_argument("--turns", type=int, default=2, help="turns per session of an at-once level")
    ap.add_argument("--ramp", type=float, default=6.0, help="closed loop: seconds over which the sessions start "
                    "(turns that start during it are not counted)")
    ap.add_argument("--duration", type=float, default=20.0, help="closed loop: seconds of turns after the ramp")
    ap.add_argument("--start-delay", type=float, default=3.0, help="seconds from a level's start to its first "
                    "turns, for the client processes to start and connect (at once means at once)")
    ap.add_argument("--mode", choices=MODES, default="llm", help="text as LLM deltas, whole paragraphs, or half the "
                    "sessions each way")
    ap.add_argument("--delta-words", type=_range, default=(2, 4), help="llm: words per delta, LOW,HIGH")
    ap.add_argument("--delta-ms", type=_range, default=(30, 50), help="llm: ms between deltas, LOW,HIGH")
    ap.add_argument("--format", default="opus", choices=FORMATS, help="output format (a level may name its own)")
    ap.add_argument("--cushion-ms", type=float, default=200.0, help="client playout start-up cushion")
    ap.add_argument("--no-warmup", action="store_true", help="no short turn before the first level")
    ap.add_argument("--no-continuation", action="store_true", help="no previous-segment prompt (TTFB cost)")
    ap.add_argument("--max-length", type=int, help="patches per segment at most (random checkpoints whose stop head "
                    "never fires would otherwise speak to the length cap)")
    ap.add_argument("--profile", help="--spawn-server: cProfile the gateway's event loop, pstats written here (it "
                    "slows the loop: read it for where time goes, not for the latency figures)")
    ap.add_argument("--py-spy", type=float, default=0.0, help="--spawn-server: sample the gateway this many seconds "
                    "a level with py-spy (who holds the GIL, what each thread does); 0: not")
    ap.add_argument("--py-spy-dir", default=".", help="where py-spy's raw stacks go")
    ap.add_argument("--json", help="write results here")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if args.engine == "paced" and not args.spawn_server:
        ap.error("--engine paced needs --spawn-server")
    results = asyncio.run(_run(args))
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "level_t0")}
    config["sessions"] = [level.name for level in args.sessions]
    if args.json:
        from datetime import UTC, datetime

        from gateway_proc import git_commit, machine_info

        doc = {"benchmark": "gateway end to end (bench/gateway_load.py)",
               "command": " ".join(["python", "bench/gateway_load.py", *argv]), "git_commit": git_commit(),
               "machine": machine_info(),
               "date": datetime.now(UTC).isoformat(timespec="seconds"), "config": config, "results": results}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2))
    else:
        print(json.dumps(results))
    print(_table(results))
    return 0 if all(r["errors"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
