"""Gateway load benchmark: N concurrent sessions speaking turns, text streamed at LLM speed or sent whole.

Measured on the client side: TTFB (first text sent -> first audio frame), inter-frame arrival gaps, underruns
against a simulated playout clock (playback starts at the first frame plus a cushion and runs in real time; a frame
that arrives after its play time is an underrun, and playback waits for it), errors. Prints a table; --json writes
the results.

    python bench/gateway_load.py --sessions 1,8,32 --turns 3               # in-process server, demo or --model
    python bench/gateway_load.py --spawn-server --sessions 32,64 --mode whole  # gateway in its own process
    python bench/gateway_load.py --url ws://host:8080/v1/stream --sessions 64 --mode whole

In-process, the gateway and the load clients share one process and one event loop (its CPU figure is both) unless
--client-procs moves the clients to child processes; with --spawn-server the gateway runs alone in a child process
(bench/gateway_proc.py) and its own CPU per audio second, per thread, and its event-loop lag are reported
(`--engine paced`: over the stand-in engine of bench/paced_engine.py instead of the real one).

Where time goes, in the JSON: the overhead split into the server's share and the rest (`server_overhead_ms_*`,
`outside_server_ms_*`); `underrun_detail` (each underrun's turn, pts, segment, time since the turn and the level
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

TEXTS = [
    "Hello world.",
    "Sure, I can help with that. The quickest way is to restart the router, wait for the lights to settle, and "
    "then connect again. If that does not work, we can look at the settings together.",
    "Your order number 4521 shipped on March 3rd, and it should arrive by Friday. Is there anything else I can "
    "do for you today?",
]


@dataclass
class TurnResult:
    turn: str = ""
    start_s: float = 0.0  # when its text went out, seconds since the level started (one clock for all processes)
    ttfb_ms: float | None = None
    audio_ms: float = 0.0
    gaps_ms: list[float] = field(default_factory=list)
    underruns: int = 0
    underrun_ms: float = 0.0
    # where each underrun happened: pts, time since the turn started, since the level started, which segment
    underrun_events: list[dict] = field(default_factory=list)
    segment_pts: list[tuple[int, float]] = field(default_factory=list)  # (segment, pts_ms) from segment.started
    server_metrics: dict = field(default_factory=dict)
    error: str | None = None


async def _stream_text(client: VoxgateClient, text: str, cid: str, mode: str, tokens_per_s: float) -> None:
    if mode == "whole":
        await client.append(text, cid)
    else:  # roughly one token per word piece, as an LLM streams it
        for piece in re.findall(r"\S+\s*", text):
            await client.append(piece, cid)
            await asyncio.sleep(1.0 / tokens_per_s)
    await client.end(cid)


async def _turn(client: VoxgateClient, text: str, cid: str, args: argparse.Namespace) -> TurnResult:
    result = TurnResult(turn=cid)
    t0 = time.perf_counter()
    # time.monotonic is CLOCK_MONOTONIC, shared by the client processes: underruns of different processes line up
    result.start_s = time.monotonic() - args.level_t0
    sender = asyncio.create_task(_stream_text(client, text, cid, args.mode, args.tokens_per_s))
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


async def _session(url: str, index: int, args: argparse.Namespace) -> list[TurnResult]:
    results = []
    try:
        client = await VoxgateClient.connect(url, api_key=args.api_key)
    except Exception as e:
        return [TurnResult(error=f"connect: {e}")]
    async with client:
        try:
            generation = {"continuation": not args.no_continuation, "seed": index}
            if args.max_length:
                generation["max_length"] = args.max_length
            await client.start(output={"format": args.format}, generation=generation)
        except ServerError as e:
            return [TurnResult(error=str(e))]
        for turn in range(args.turns):
            results.append(await _turn(client, TEXTS[(index + turn) % len(TEXTS)], f"s{index}t{turn}", args))
    return results


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 1)


def _summary(n: int, turns: list[TurnResult], wall_s: float, cpu_s: float, gateway: dict | None = None) -> dict:
    ok = [t for t in turns if t.error is None and t.ttfb_ms is not None]
    ttfb = [t.ttfb_ms for t in ok]
    # what the gateway adds to first audio: client-side TTFB minus the engine's own (request -> first chunk)
    overhead = [t.ttfb_ms - t.server_metrics["engine_ttfb_ms"] for t in ok
                if t.server_metrics.get("engine_ttfb_ms") is not None]
    timed = [t for t in ok if t.server_metrics.get("ttfb_ms") is not None
             and t.server_metrics.get("engine_ttfb_ms") is not None]
    server_side = [t.server_metrics["ttfb_ms"] - t.server_metrics["engine_ttfb_ms"] for t in timed]
    outside = [t.ttfb_ms - t.server_metrics["ttfb_ms"] for t in timed]
    gaps = [g for t in ok for g in t.gaps_ms]
    later = [t.server_metrics.get("later_segment_engine_ttfb_ms") for t in ok]
    later = [x for x in later if x is not None]
    audio_s = sum(t.audio_ms for t in ok) / 1000.0
    return {
        "sessions": n, "turns": len(turns), "errors": len(turns) - len(ok),
        "error_examples": sorted({t.error for t in turns if t.error})[:3],
        "ttfb_ms_p50": _pct(ttfb, 0.5), "ttfb_ms_p90": _pct(ttfb, 0.9), "ttfb_ms_p99": _pct(ttfb, 0.99),
        "gateway_overhead_ms_p50": _pct(overhead, 0.5), "gateway_overhead_ms_p90": _pct(overhead, 0.9),
        # per turn, the overhead split: inside the server (its TTFB: text handled -> first audio written, minus the
        # engine's) and around it (client TTFB - server TTFB: the client's send and receive, the server's input
        # queue, the network)
        "server_overhead_ms_p50": _pct(server_side, 0.5), "server_overhead_ms_p90": _pct(server_side, 0.9),
        "outside_server_ms_p50": _pct(outside, 0.5), "outside_server_ms_p90": _pct(outside, 0.9),
        # the server's own view (text in -> first audio sent), to split the overhead into server and delivery
        "server_ttfb_ms_p50": _pct([t.server_metrics["ttfb_ms"] for t in ok if t.server_metrics.get("ttfb_ms")], 0.5),
        "engine_ttfb_ms_p50": _pct([t.server_metrics["engine_ttfb_ms"] for t in ok
                                    if t.server_metrics.get("engine_ttfb_ms")], 0.5),
        "gap_ms_p50": _pct(gaps, 0.5), "gap_ms_p99": _pct(gaps, 0.99), "gap_ms_max": _pct(gaps, 1.0),
        "underrun_turns": sum(t.underruns > 0 for t in ok), "underrun_ms_total": round(sum(t.underrun_ms for t in ok)),
        "server_rtf_mean": round(statistics.mean(t.server_metrics["rtf"] for t in ok if t.server_metrics.get("rtf")),
                                 4) if ok else None,
        "later_segment_engine_ttfb_ms_mean": round(statistics.mean(later), 1) if later else None,
        "underrun_detail": _underrun_detail(ok), "segment_detail": _segment_detail(ok),
        "audio_s": round(audio_s, 2), "wall_s": round(wall_s, 2),
        "audio_s_per_s": round(audio_s / wall_s, 2) if wall_s else None,
        # this process's CPU (the in-process gateway and the load clients together) per second of audio delivered
        "process_cpu_ms_per_audio_s": round(1000.0 * cpu_s / audio_s, 2) if audio_s else None,
        **_gateway_summary(gateway, audio_s),
    }


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
    count, p50, p99 and max wall ms. A max near the longest underrun means the engine itself stalled."""
    try:
        from engine.worker import hist_percentile
    except ImportError:
        return None
    hists: dict[str, dict[int, int]] = {}
    for b, a in zip(before, after, strict=False):
        for name, counts in (a.get("step_hist") or {}).items():
            if not name.endswith("_wall"):
                continue
            old = {int(k): v for k, v in ((b.get("step_hist") or {}).get(name) or {}).items()}
            diff = hists.setdefault(name[:-5], {})
            for bucket, c in counts.items():
                n = c - old.get(int(bucket), 0)
                if n:
                    diff[int(bucket)] = diff.get(int(bucket), 0) + n
    out: dict[str, Any] = {kind: {"steps": sum(h.values()), "wall_ms_p50": _round(hist_percentile(h, 50)),
                                  "wall_ms_p99": _round(hist_percentile(h, 99)),
                                  "wall_ms_max": _round(hist_percentile(h, 100))}
                           for kind, h in sorted(hists.items()) if h}
    if not out:
        return None
    # a Triton compile mid-level (a shape the warm-up did not cover) stalls every stream for its duration
    for key in ("triton_compiles", "prefill_tokens"):
        out[key] = sum((a.get(key) or 0) - (b.get(key) or 0) for b, a in zip(before, after, strict=False))
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _gateway_summary(gateway: dict | None, audio_s: float) -> dict:
    """--spawn-server: the gateway process's own CPU (per audio second and per thread) and event-loop lag."""
    if gateway is None:
        return {}
    used = gateway["used"]
    return {"gateway_cpu_ms_per_audio_s": round(1000.0 * used["cpu_s"] / audio_s, 2) if audio_s else None,
            "gateway_threads_cpu_s": used["threads_cpu_s"], "gateway_loop_lag_ms": gateway["loop_lag"]}


def _client_proc(conn: Any, url: str, indexes: list[int], args: argparse.Namespace) -> None:
    """--client-procs: one process's share of the sessions; its turns go back through `conn`."""

    async def run() -> list[list[TurnResult]]:
        return await asyncio.gather(*(_session(url, i, args) for i in indexes))

    conn.send([asdict(t) for s in asyncio.run(run()) for t in s])
    conn.close()


def _sessions_in_processes(url: str, n: int, args: argparse.Namespace) -> list[TurnResult]:
    ctx = mp.get_context("spawn")
    workers = []
    for p in range(min(args.client_procs, n)):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_client_proc, args=(send, url, list(range(p, n, args.client_procs)), args),
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


async def _level(url: str, n: int, args: argparse.Namespace) -> list[TurnResult]:
    if args.client_procs:  # off this process (and its event loop, which may be the gateway's)
        return await asyncio.to_thread(_sessions_in_processes, url, n, args)
    per_session = await asyncio.gather(*(_session(url, i, args) for i in range(n)))
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
        proc = await asyncio.to_thread(GatewayProcess, *engine_args, "--max-num-seqs", str(args.max_num_seqs))
        url = proc.url
    elif url is None:
        from engine import Engine
        from gateway.server import ServerConfig, create_app, start_server

        engine = Engine.from_pretrained(args.model, max_num_seqs=args.max_num_seqs)
        await engine.wait_for_ready()
        if engine.model_info().is_demo:
            print("note: tiny demo model (random weights): timings are the gateway's, the audio is not speech",
                  file=sys.stderr)
        config = ServerConfig(web_client_dir=None)
        runner, port = await start_server(create_app(engine, config))
        url = f"ws://127.0.0.1:{port}/v1/stream"
    results = []
    try:
        for n in args.sessions:
            if proc is not None:
                await asyncio.to_thread(proc.reset)
                before = await asyncio.to_thread(proc.stats)
            steps0 = _worker_stats(engine)
            t0, cpu0 = time.perf_counter(), time.process_time()
            args.level_t0 = time.monotonic()
            turns = await _level(url, n, args)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            gateway = None
            if proc is not None:
                from gateway_proc import delta

                after = await asyncio.to_thread(proc.stats)
                gateway = {"used": delta(before, after), "loop_lag": after["loop_lag"]}
                steps = _step_detail(before["engine"].get("workers", []), after["engine"].get("workers", []))
            else:
                if runner is not None and args.client_procs:  # this process is the gateway alone
                    gateway = {"used": {"cpu_s": cpu, "threads_cpu_s": None}, "loop_lag": None}
                steps = _step_detail(steps0, _worker_stats(engine))
            results.append({**_summary(n, turns, wall, cpu, gateway), "engine_steps": steps})
    finally:
        if proc is not None:
            await asyncio.to_thread(proc.close)
        if runner is not None:
            await runner.cleanup()
        if engine is not None:
            await engine.stop()
    return results


def _worker_stats(engine: Any) -> list[dict]:
    """The in-process engine's workers' stats (their step-time histograms); [] without one."""
    return [] if engine is None else [w.get("stats", {}) for w in engine.health()["workers"]]


def _table(results: list[dict]) -> str:
    cols = [("sessions", "N"), ("ttfb_ms_p50", "TTFB p50"), ("ttfb_ms_p90", "p90"),
            ("gateway_overhead_ms_p50", "gateway +ms p50"), ("gateway_overhead_ms_p90", "p90"),
            ("server_overhead_ms_p50", "in server p50"),
            ("process_cpu_ms_per_audio_s", "CPU ms/audio s"), ("gateway_cpu_ms_per_audio_s", "gateway CPU ms/audio s"),
            ("gap_ms_p99", "gap p99"),
            ("gap_ms_max", "gap max"), ("underrun_turns", "underrun turns"), ("errors", "errors"),
            ("server_rtf_mean", "RTF"), ("later_segment_engine_ttfb_ms_mean", "later seg TTFB"),
            ("audio_s_per_s", "audio s/s")]
    lines = [" | ".join(h for _, h in cols)]
    lines += [" | ".join(str(r.get(k)) for k, _ in cols) for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running gateway (default: start one in-process)")
    ap.add_argument("--spawn-server", action="store_true", help="start the gateway (real engine) in a child process "
                    "and report its own CPU and event-loop lag")
    ap.add_argument("--model", help="model for the in-process server (default: demo / VoxCPM2 on GPU)")
    ap.add_argument("--engine", choices=("real", "paced"), default="real", help="--spawn-server: the real engine, or "
                    "the paced stand-in (bench/paced_engine.py: a patch per request per tick, no model)")
    ap.add_argument("--tick-ms", type=float, help="--engine paced: ms per patch (default 160: real time; 35 is an "
                    "RTF of 0.22); with --max-length every segment speaks exactly that many patches")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--compile-stall-ms", type=float, default=0.0, help="--engine paced: the first step serving a "
                    "continuation segment stalls this long, once (as a kernel compiled mid-serving would)")
    ap.add_argument("--api-key")
    ap.add_argument("--client-procs", type=int, default=0, help="run the sessions in this many client processes "
                    "(default 0: in this process, sharing the event loop with an in-process gateway)")
    ap.add_argument("--sessions", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4],
                    help="comma-separated concurrency levels")
    ap.add_argument("--turns", type=int, default=2, help="turns per session")
    ap.add_argument("--mode", choices=("llm", "whole"), default="llm", help="text at LLM speed, or all at once")
    ap.add_argument("--tokens-per-s", type=float, default=40.0)
    ap.add_argument("--format", default="opus", choices=("opus", "pcm_s16le", "mulaw", "alaw"))
    ap.add_argument("--cushion-ms", type=float, default=100.0, help="client playout start-up cushion")
    ap.add_argument("--no-continuation", action="store_true", help="no previous-segment prompt (TTFB cost)")
    ap.add_argument("--max-length", type=int, help="patches per segment at most (random checkpoints whose stop head "
                    "never fires would otherwise speak to the length cap)")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    if args.engine == "paced" and not args.spawn_server:
        ap.error("--engine paced needs --spawn-server")
    results = asyncio.run(_run(args))
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "level_t0")}
    if args.json:
        from datetime import UTC, datetime

        from gateway_proc import git_commit

        doc = {"command": " ".join(["python", *sys.argv]), "git_commit": git_commit(),
               "date": datetime.now(UTC).isoformat(timespec="seconds"), "config": config, "results": results}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    print(json.dumps(results))
    print(_table(results))
    return 0 if all(r["errors"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
