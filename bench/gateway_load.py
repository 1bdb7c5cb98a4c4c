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
(bench/gateway_proc.py) and its own CPU per audio second, per thread, and its event-loop lag are reported.
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
    ttfb_ms: float | None = None
    audio_ms: float = 0.0
    gaps_ms: list[float] = field(default_factory=list)
    underruns: int = 0
    underrun_ms: float = 0.0
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
    result = TurnResult()
    t0 = time.perf_counter()
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
                        play_start += now - due
                    last_arrival = now
                    frame_ms = client.session["output"]["frame_ms"]
                    result.audio_ms = event.pts_ms + frame_ms
                elif event.get("type") == "error":
                    raise ServerError(event)
                elif event.get("type") == "context.done" and event.get("context_id") == cid:
                    result.server_metrics = event["metrics"]
                    return result
    except (ServerError, TimeoutError, ConnectionError, OSError) as e:
        result.error = str(e) or type(e).__name__
        return result
    finally:
        sender.cancel()


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
    gaps = [g for t in ok for g in t.gaps_ms]
    later = [t.server_metrics.get("later_segment_engine_ttfb_ms") for t in ok]
    later = [x for x in later if x is not None]
    audio_s = sum(t.audio_ms for t in ok) / 1000.0
    return {
        "sessions": n, "turns": len(turns), "errors": len(turns) - len(ok),
        "error_examples": sorted({t.error for t in turns if t.error})[:3],
        "ttfb_ms_p50": _pct(ttfb, 0.5), "ttfb_ms_p90": _pct(ttfb, 0.9), "ttfb_ms_p99": _pct(ttfb, 0.99),
        "gateway_overhead_ms_p50": _pct(overhead, 0.5), "gateway_overhead_ms_p90": _pct(overhead, 0.9),
        # the server's own view (text in -> first audio sent), to split the overhead into server and delivery
        "server_ttfb_ms_p50": _pct([t.server_metrics["ttfb_ms"] for t in ok if t.server_metrics.get("ttfb_ms")], 0.5),
        "engine_ttfb_ms_p50": _pct([t.server_metrics["engine_ttfb_ms"] for t in ok
                                    if t.server_metrics.get("engine_ttfb_ms")], 0.5),
        "gap_ms_p50": _pct(gaps, 0.5), "gap_ms_p99": _pct(gaps, 0.99), "gap_ms_max": _pct(gaps, 1.0),
        "underrun_turns": sum(t.underruns > 0 for t in ok), "underrun_ms_total": round(sum(t.underrun_ms for t in ok)),
        "server_rtf_mean": round(statistics.mean(t.server_metrics["rtf"] for t in ok if t.server_metrics.get("rtf")),
                                 4) if ok else None,
        "later_segment_engine_ttfb_ms_mean": round(statistics.mean(later), 1) if later else None,
        "audio_s": round(audio_s, 2), "wall_s": round(wall_s, 2),
        "audio_s_per_s": round(audio_s / wall_s, 2) if wall_s else None,
        # this process's CPU (the in-process gateway and the load clients together) per second of audio delivered
        "process_cpu_ms_per_audio_s": round(1000.0 * cpu_s / audio_s, 2) if audio_s else None,
        **_gateway_summary(gateway, audio_s),
    }


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

        proc = await asyncio.to_thread(GatewayProcess, "--engine", "real", *(["--model", args.model] if args.model
                                                                             else []),
                                       "--max-num-seqs", str(args.max_num_seqs))
        url = proc.url
    elif url is None:
        from engine import Engine
        from gateway.server import ServerConfig, create_app, start_server

        engine = Engine.from_pretrained(args.model, max_num_seqs=args.max_num_seqs)
        await engine.wait_for_ready()
        if engine.model_info().is_demo:
            print("note: tiny demo model (random weights): timings are the gateway's, the audio is not speech",
                  file=sys.stderr)
        runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None)))
        url = f"ws://127.0.0.1:{port}/v1/stream"
    results = []
    try:
        for n in args.sessions:
            if proc is not None:
                await asyncio.to_thread(proc.reset)
                before = await asyncio.to_thread(proc.stats)
            t0, cpu0 = time.perf_counter(), time.process_time()
            turns = await _level(url, n, args)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            gateway = None
            if proc is not None:
                from gateway_proc import delta

                after = await asyncio.to_thread(proc.stats)
                gateway = {"used": delta(before, after), "loop_lag": after["loop_lag"]}
            elif runner is not None and args.client_procs:  # this process is the gateway alone
                gateway = {"used": {"cpu_s": cpu, "threads_cpu_s": None}, "loop_lag": None}
            results.append(_summary(n, turns, wall, cpu, gateway))
    finally:
        if proc is not None:
            await asyncio.to_thread(proc.close)
        if runner is not None:
            await runner.cleanup()
        if engine is not None:
            await engine.stop()
    return results


def _table(results: list[dict]) -> str:
    cols = [("sessions", "N"), ("ttfb_ms_p50", "TTFB p50"), ("ttfb_ms_p90", "p90"),
            ("gateway_overhead_ms_p50", "gateway +ms p50"), ("gateway_overhead_ms_p90", "p90"),
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
    ap.add_argument("--max-num-seqs", type=int, default=256)
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
    results = asyncio.run(_run(args))
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
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
