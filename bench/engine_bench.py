"""Engine benchmark: a concurrency sweep of fixed-length streaming requests through the public async API.

Definitions follow the Nano-vLLM-VoxCPM benchmark so the numbers compare: TTFB = first chunk time - request start;
RTF per request = (wall - TTFB) / audio seconds (mean over requests); inter-chunk gap = time between consecutive
chunks of one request. Fixed length needs a checkpoint whose stop head never fires: `--random-size` writes one.

    python bench/engine_bench.py --random-size tiny --concurrency 1,8,32 --patches 20
    python bench/engine_bench.py --model DIR --concurrency 1,8,32,64 --patches 60 --out bench/results/x.json
    python bench/engine_bench.py --random-size tiny --closed-loop --concurrency 8 --duration 10
    python bench/engine_bench.py --random-size tiny --poisson 4 --requests 40
    python bench/engine_bench.py --model DIR --concurrency 1,64 --extra closed:64,poisson:20   # same engine
    python bench/engine_bench.py --model DIR --concurrency 1 --extra closed:400 --ramp 6 --duration 20  # capacity
    python bench/engine_bench.py --model DIR --concurrency 1 --extra twokey:256 --max-num-seqs 320  # fair share
    python bench/engine_bench.py --model DIR --profile   # CUDA: per-module GPU times of a decode step
    python bench/engine_bench.py --model DIR --concurrency 64 --extra mixed-one:64,mixed-quarter:64,batch:64

Mixed settings (`mixed-one:C`, `mixed-quarter:C`): like the batch mode, with one stream in C (or one in four) at
other diffusion steps and cfg (`--other-timesteps`, `--other-cfg`, taken in turn); each level reports its
default-settings streams' RTF and TTFB p90 apart (`default_streams`), and `mixed_vs_uniform` sets them beside the
batch level of the same concurrency run on the same engine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import itertools
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import Engine  # noqa: E402
from engine.engine_config import EngineConfig  # noqa: E402
from engine.request import SamplingParams  # noqa: E402

DEFAULTS = EngineConfig()

TEXT = ("Streaming speech synthesis turns text into audio while the text is still arriving, so a voice agent can "
        "start speaking within a fraction of a second. The gateway splits the text into short segments, the "
        "engine batches every active stream into one step on the accelerator, and the audio is encoded and sent "
        "to the listener as soon as each patch is ready. A good system keeps the first audio fast and steady "
        "even when hundreds of people are talking to it at the same time, and it never lets a stream run dry.")


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


LORAS: list[str] = []  # --lora: registered adapters; request `seed` uses LORAS[seed % len(LORAS)]


def prompt_text(model: str, positions: int | None) -> tuple[str, int]:
    """TEXT, or its longest word prefix that fills at most `positions` prefill positions (text tokens + the
    audio-start token) under the checkpoint's tokenizer: random checkpoints' tokenizers split English into ~3x more
    tokens than the release one, so comparisons with other systems fix the prefill length instead of the words."""
    from engine.text import Tokenizer

    tokenizer = Tokenizer.from_dir(model)
    words = TEXT.split(" ")
    text = TEXT
    if positions is not None:
        n = max(1, next((k for k in range(len(words), 0, -1)
                         if len(tokenizer.encode(" ".join(words[:k]))) + 1 <= positions), 1))
        text = " ".join(words[:n])
    return text, len(tokenizer.encode(text)) + 1


async def one_request(engine: Engine, patches: int, seed: int, timesteps: int,
                      cfg_value: float = SamplingParams.cfg_value,
                      default: bool = True) -> dict:
    """One fixed-length request; `default`: at the run's default settings (the mixed modes report those apart)."""
    start, start_wall = time.perf_counter(), time.time()
    times, samples = [], 0
    lora = LORAS[seed % len(LORAS)] if LORAS else None
    async for chunk in engine.generate(PROMPT[0], seed=seed, max_length=patches, min_length=patches,
                                       timesteps=timesteps, cfg_value=cfg_value, lora=lora):
        times.append(time.perf_counter())
        samples += chunk.audio.shape[0]
    audio_s = samples / engine.model_info().sample_rate
    ttfb = times[0] - start
    return {"ttfb": ttfb, "rtf": (times[-1] - start - ttfb) / audio_s if audio_s else float("nan"),
            "gaps": np.diff(times).tolist(), "audio_s": audio_s, "patches": len(times), "start_wall": start_wall,
            "default": default, "timesteps": timesteps, "cfg_value": cfg_value}


MIXED_MODES = {"mixed-one": None, "mixed-quarter": 4}  # one stream in C (the level's concurrency), one in four


def request_settings(args: argparse.Namespace, mode: str, index: int, concurrency: int) -> dict:
    """The `index`-th request's settings: the defaults, or in a mixed mode every C-th (or 4th) at the next of
    --other-timesteps and --other-cfg in turn."""
    every = (MIXED_MODES[mode] or concurrency) if mode in MIXED_MODES else 0
    if not every or index % every:
        return {"timesteps": args.timesteps, "cfg_value": SamplingParams.cfg_value, "default": True}
    k = index // every
    return {"timesteps": args.other_timesteps[k % len(args.other_timesteps)],
            "cfg_value": args.other_cfg[k % len(args.other_cfg)], "default": False}


def streams_summary(results: list[dict]) -> dict | None:
    """RTF and TTFB of a subset of a level's requests."""
    if not results:
        return None
    ttfb = [r["ttfb"] * 1000 for r in results]
    return {"requests": len(results), "rtf_mean": float(np.mean([r["rtf"] for r in results])),
            "ttfb_ms_p50": percentile(ttfb, 50), "ttfb_ms_p90": percentile(ttfb, 90),
            "settings": sorted({(r["timesteps"], r["cfg_value"]) for r in results})}


def mixed_vs_uniform(levels: list[dict]) -> list[dict]:
    """Each mixed level's default-settings streams beside the batch levels (uniform settings) of its concurrency on
    the same engine: the ratios the isolation claim rests on (1.0: the other streams' settings cost them nothing)."""
    out = []
    for lv in levels:
        if lv["mode"] not in MIXED_MODES or not lv.get("default_streams"):
            continue
        uniform = [u for u in levels if u["mode"] == "batch" and u["concurrency"] == lv["concurrency"]]
        if not uniform:
            continue
        rtf = float(np.mean([u["rtf_mean"] for u in uniform]))
        ttfb = float(np.mean([u["ttfb_ms"]["p90"] for u in uniform]))
        d = lv["default_streams"]
        out.append({"mode": lv["mode"], "concurrency": lv["concurrency"], "uniform_runs": len(uniform),
                    "uniform_rtf_mean": rtf, "uniform_ttfb_ms_p90": ttfb, "default_rtf_mean": d["rtf_mean"],
                    "default_ttfb_ms_p90": d["ttfb_ms_p90"], "rtf_ratio": d["rtf_mean"] / rtf,
                    "ttfb_p90_ratio": d["ttfb_ms_p90"] / ttfb, "other": lv.get("other_streams")})
    return out


def step_snapshot(engine: Engine) -> list[dict]:
    """Every worker's step histograms, prefill tokens and compile count (`engine.worker.StepStats`) right now."""
    return [w["stats"] for w in engine.health()["workers"]]


def step_summary(before: list[dict], after: list[dict]) -> dict:
    """Per step kind between two snapshots: steps, p50/p99 wall and GPU ms; plus prefill tokens and the Triton
    compiles seen (non-zero means some step waited for the compiler)."""
    from engine.worker import hist_percentile

    hists: dict[str, dict[int, int]] = {}
    for b, a in zip(before, after, strict=False):
        for name, counts in a.get("step_hist", {}).items():
            old = b.get("step_hist", {}).get(name, {})
            diff = hists.setdefault(name, {})
            for bucket, c in counts.items():
                if c - old.get(bucket, 0):
                    diff[bucket] = diff.get(bucket, 0) + c - old.get(bucket, 0)
    kinds: dict[str, dict] = {}
    for name, counts in sorted(hists.items()):
        kind, what = name.rsplit("_", 1)
        entry = kinds.setdefault(kind, {})
        if what == "wall":
            entry["steps"] = sum(counts.values())
        entry[f"{what}_ms_p50"] = round(hist_percentile(counts, 50) or 0.0, 2)
        entry[f"{what}_ms_p99"] = round(hist_percentile(counts, 99) or 0.0, 2)

    def delta(key: str) -> float:
        return sum(a.get(key, 0) - b.get(key, 0) for b, a in zip(before, after, strict=False))

    return {"by_kind": kinds, "prefill_tokens": delta("prefill_tokens"), "triton_compiles": delta("triton_compiles"),
            "gpu_ms_total": delta("gpu_ms_total"), "ahead_steps": delta("ahead_steps"),
            "split_steps": delta("split_steps"),
            "compiles_total": sum(a.get("triton_compiles", 0) for a in after)}


async def run_level(engine: Engine, args: argparse.Namespace, level: float, mode: str = "batch") -> dict:
    """mode: "batch" (N requests, at most `concurrency` at once), "closed" (closed-loop users), "poisson" (open
    loop at `level` requests/s); `level` is the concurrency, or the rate."""
    concurrency = int(level)
    steps0, t0, snap0 = engine.stats().steps, time.perf_counter(), step_snapshot(engine)
    results: list[dict] = []
    seeds = iter(range(10**9))

    peak = [0]  # the most streams running at once (sampled every 0.25 s)
    samples: list[tuple[float, int]] = []  # (s since the level began, streams running)
    wall0 = time.time()
    arrivals_end = 0.0  # Poisson: when the last request was sent

    async def report():
        for tick in itertools.count(1):
            await asyncio.sleep(0.25)
            running = engine.stats().running
            peak[0] = max(peak[0], running)
            samples.append((time.perf_counter() - t0, running))
            if tick % 8 == 0:
                print(f"  ... {len(results)} requests done, {running} running", file=sys.stderr)

    progress = asyncio.create_task(report())
    if mode == "poisson":
        rng = random.Random(0)
        tasks = []
        for _ in range(args.requests or max(32, int(level * args.duration))):  # arrivals for --duration s
            tasks.append(asyncio.create_task(one_request(engine, args.patches, next(seeds), args.timesteps)))
            tasks[-1].add_done_callback(lambda t: results.append(t.result()))
            await asyncio.sleep(rng.expovariate(level))
        arrivals_end = time.perf_counter() - t0
        await asyncio.gather(*tasks)
    elif mode == "closed":
        end = t0 + args.duration

        async def user(i: int):
            # --ramp: user i starts i/C of the ramp in, so fixed-length requests stay spread out instead of
            # arriving (and finishing) as one burst every cycle: a steady C streams with steady arrivals
            await asyncio.sleep(args.ramp * i / concurrency)
            while time.perf_counter() < end:
                results.append(await one_request(engine, args.patches, next(seeds), args.timesteps))

        await asyncio.gather(*(user(i) for i in range(concurrency)))
    else:  # batch, and the mixed-settings modes
        n = args.requests or min(args.max_requests, args.requests_factor * concurrency)
        sem = asyncio.Semaphore(concurrency)

        async def limited(index: int):
            async with sem:
                results.append(await one_request(engine, args.patches, next(seeds),
                                                 **request_settings(args, mode, index, concurrency)))

        await asyncio.gather(*(limited(i) for i in range(n)))
    progress.cancel()
    elapsed = time.perf_counter() - t0
    ttfb = [r["ttfb"] * 1000 for r in results]
    # steady state, what a capacity claim rests on: the last two thirds of the arrivals (Poisson) or of the level;
    # closed loop: the requests started between the ramp's end (every user running) and the last start
    if mode == "closed":
        begin, end = max(args.ramp, args.duration / 3), args.duration
    else:
        end = arrivals_end if mode == "poisson" else elapsed
        begin = end / 3
    steady_running = [n for t, n in samples if begin <= t <= end]
    steady = [r for r in results if begin <= r["start_wall"] - wall0 <= end]
    steady_ttfb = [r["ttfb"] * 1000 for r in steady]
    steady_gaps = [g * 1000 for r in steady for g in r["gaps"]]
    gaps = [g * 1000 for r in results for g in r["gaps"]]
    return {
        "mode": mode, "concurrency": level if mode == "poisson" else concurrency, "requests": len(results),
        "elapsed_s": elapsed, "peak_running": peak[0],
        "ramp_s": args.ramp if mode == "closed" else None,
        "steady": {"window_s": [round(begin, 2), round(end, 2)], "requests": len(steady),
                   "running_mean": float(np.mean(steady_running)) if steady_running else None,
                   "ttfb_ms_p90": percentile(steady_ttfb, 90) if steady_ttfb else None,
                   "rtf_mean": float(np.mean([r["rtf"] for r in steady])) if steady else None,
                   "gap_ms_p99": percentile(steady_gaps, 99) if steady_gaps else None},
        "ttfb_ms": {"p50": percentile(ttfb, 50), "p90": percentile(ttfb, 90), "p99": percentile(ttfb, 99)},
        "rtf_mean": float(np.mean([r["rtf"] for r in results])),
        "gap_ms": {"p50": percentile(gaps, 50), "p99": percentile(gaps, 99)},
        "default_streams": streams_summary([r for r in results if r["default"]]),
        "other_streams": streams_summary([r for r in results if not r["default"]]),
        "steps_per_s": (engine.stats().steps - steps0) / elapsed,
        "audio_s_per_s": sum(r["audio_s"] for r in results) / elapsed,
        "steps": (steps := step_summary(snap0, step_snapshot(engine))),
        # device-bracketed step time over wall time, per worker: how busy the GPU was kept (eager steps count
        # their launch gaps as busy, so this is an upper bound)
        "gpu_busy": round(steps["gpu_ms_total"] / (1000 * elapsed * max(1, len(snap0))), 3),
        # wall-clock start and TTFB of each request in start order: lines up with the worker's DEBUG step log
        "timeline": [[round(r["start_wall"], 4), round(r["ttfb"] * 1000, 1)]
                     for r in sorted(results, key=lambda r: r["start_wall"])] if args.timeline else None,
    }


def model_dir(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from engine import model_configs
    from engine.random_checkpoint import write_random_checkpoint

    config = {"tiny": lambda: model_configs.tiny("voxcpm2"), "voxcpm2": model_configs.voxcpm2,
              "voxcpm1.5": model_configs.voxcpm15}[args.random_size]()
    out = Path(tempfile.gettempdir()) / f"voxgate-bench-{args.random_size}-stop-never"
    if not (out / "config.json").exists():
        print(f"writing a random {args.random_size} checkpoint (stop head never fires) to {out}", file=sys.stderr)
        write_random_checkpoint(out, config, seed=0, stop_never=True)
    return str(out)


PROMPT = [TEXT]  # the text every request speaks (set by main from --prompt-positions)


async def main(args: argparse.Namespace) -> dict:
    model = model_dir(args)
    PROMPT[0], positions = prompt_text(model, args.prompt_positions)
    print(f"prompt: {positions} prefill positions ({len(PROMPT[0].split())} words)", file=sys.stderr)
    engine = Engine(model, max_num_seqs=args.max_num_seqs, max_waiting=args.max_num_seqs * 4,
                    inference_timesteps=args.timesteps, max_timesteps=args.max_timesteps, dtype=args.dtype,
                    gpu_memory_utilization=args.gpu_memory_utilization,
                    max_loras=(args.max_loras or args.lora) if args.lora else 0, max_lora_rank=args.lora_rank,
                    vae_dtype=args.vae_dtype, split_decodes_above=args.split_decodes_above or None,
                    merge_lora=not args.no_merge_lora, fp8_prefill=args.fp8_prefill,
                    fp8_dit=args.fp8_dit)
    t = time.perf_counter()
    await engine.wait_for_ready()
    print(f"engine ready in {time.perf_counter() - t:.1f} s: {engine.model_info()}", file=sys.stderr)
    if args.lora:
        await register_random_loras(engine, args.lora, args.lora_rank)
    await one_request(engine, 2, 0, args.timesteps)  # warm-up
    # the ~170k objects of torch & co. out of the collector's reach: a full collection of them (85-180 ms) would
    # otherwise land inside a burst, as a server's would (gateway/cli.py does the same once serving)
    gc.collect()
    gc.freeze()
    from gateway_proc import git_commit  # bench/ is on the path: this file's folder

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU {platform.processor()}"
    levels: list[dict] = []

    def result(done: bool) -> dict:
        return {"command": " ".join(sys.argv), "git_commit": git_commit(), "device": device,
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "model": model, "model_info": vars(engine.model_info()), "patches": args.patches,
                "prompt_positions": positions,
                "timesteps": args.timesteps, "max_timesteps": args.max_timesteps or args.timesteps,
                "other_timesteps": args.other_timesteps, "other_cfg": args.other_cfg,
                "max_num_seqs": args.max_num_seqs, "loras": args.lora,
                "lora_rank": args.lora_rank if args.lora else None, "merge_lora": not args.no_merge_lora,
                "vae_dtype": args.vae_dtype, "fp8_prefill": args.fp8_prefill, "fp8_dit": args.fp8_dit,
                "split_decodes_above": args.split_decodes_above or None, "levels": levels,
                "mixed_vs_uniform": mixed_vs_uniform(levels), "complete": done}

    try:
        mode = "poisson" if args.poisson else "closed" if args.closed_loop else "batch"
        plan = [(mode, float(c)) for c in ([args.poisson] if args.poisson else args.concurrency)]
        plan += [(m, float(v)) for m, v in (x.split(":") for x in args.extra)]
        for m, c in plan:
            print(f"{m} {c} ...", file=sys.stderr)
            if m == "twokey":  # bench/two_key.py: one key's burst against another key's new stream
                from two_key import run_two_key

                levels.append(await run_two_key(engine, PROMPT[0], int(c), args.patches, args.timesteps))
            else:
                levels.append(await run_level(engine, args, c, m))
            if args.out:  # what is measured survives a run cut short (a device call's time limit)
                Path(args.out).write_text(json.dumps(result(False), indent=2))
    finally:
        await engine.stop()
    return result(True)


async def register_random_loras(engine: Engine, count: int, rank: int, concurrency: int = 8) -> None:
    """`count` distinct random adapters of rank `rank` on every LoRA target (alpha = rank, small weights),
    registered `concurrency` at a time (the engine checks and packs them in threads while a worker stores the
    previous ones)."""
    from engine.lora import lora_layout

    layout = lora_layout(engine.config)
    gen = torch.Generator().manual_seed(0)
    # The benchmark needs distinct adapters of the right shapes, not independent random ones: one random base per
    # shape, rolled and scaled per adapter (~400 randn calls over 18.6M values per VoxCPM2 adapter cost ~0.1 s
    # each; this costs a few copies), shared by every layer of that shape within an adapter.
    bases_a = {n: torch.randn(rank, n, generator=gen) / n ** 0.5 for n in {fan_in for fan_in, _ in layout.values()}}
    bases_b = {n: torch.randn(n, rank, generator=gen) * 0.01 for n in {fan_out for _, fan_out in layout.values()}}
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            scale = 1.0 + 1e-3 * i
            a = {n: base.roll(i, dims=1) * scale for n, base in bases_a.items()}
            b = {n: base.roll(i, dims=0) for n, base in bases_b.items()}
            tensors = {}
            for path, (fan_in, fan_out) in layout.items():
                tensors[f"{path}.lora_A"], tensors[f"{path}.lora_B"] = a[fan_in], b[fan_out]
            await engine.register_lora(f"bench-{i}", tensors, config={"r": rank, "alpha": rank})

    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(count)))
    LORAS.extend(f"bench-{i}" for i in range(count))
    print(f"registered {count} LoRA adapters of rank {rank} in {time.perf_counter() - t:.1f} s", file=sys.stderr)


def table(result: dict) -> str:
    rows = ["| mode | concurrency | requests | TTFB p50 / p90 / p99 (ms) | RTF mean | gap p50 / p99 (ms) | steps/s "
            "| audio s/s |", "|---|---|---|---|---|---|---|---|"]
    for lv in result["levels"]:
        if lv.get("mode") == "twokey":
            from two_key import row

            rows.append(row(lv))
            continue
        t, g = lv["ttfb_ms"], lv["gap_ms"]
        rows.append(f"| {lv.get('mode', 'batch')} | {lv['concurrency']} | {lv['requests']} | "
                    f"{t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} | "
                    f"{lv['rtf_mean']:.3f} | {g['p50']:.1f} / {g['p99']:.1f} | {lv['steps_per_s']:.1f} | "
                    f"{lv['audio_s_per_s']:.1f} |")
    for lv in result["levels"]:
        st = lv.get("steps")
        if not st:
            continue
        kinds = "; ".join(f"{k} x{v.get('steps', 0)}: wall {v.get('wall_ms_p50')} / {v.get('wall_ms_p99')}, gpu "
                          f"{v.get('gpu_ms_p50')} / {v.get('gpu_ms_p99')}" for k, v in st["by_kind"].items())
        rows.append(f"steps at {lv.get('mode', 'batch')} {lv['concurrency']} (ms p50 / p99): {kinds}; prefill "
                    f"{st['prefill_tokens']} tokens; Triton compiles {st['triton_compiles']} (total "
                    f"{st['compiles_total']}); GPU busy {lv.get('gpu_busy')}; launched ahead {st.get('ahead_steps')}; "
                    f"split {st.get('split_steps')}; "
                    f"peak running {lv.get('peak_running')}")
        sd = lv.get("steady")
        if sd and lv.get("mode") in ("poisson", "closed") and sd["requests"]:
            rows.append(f"steady state at {lv['mode']} {lv['concurrency']} (requests started {sd['window_s'][0]}-"
                        f"{sd['window_s'][1]} s, {sd['requests']}): streams running {sd['running_mean']:.0f} on "
                        f"average, RTF {sd['rtf_mean']:.3f}, TTFB p90 {sd['ttfb_ms_p90']:.0f} ms, gap p99 "
                        f"{sd['gap_ms_p99']:.0f} ms")
    for m in result.get("mixed_vs_uniform", []):
        other = m["other"] or {}
        rows.append(f"{m['mode']} {m['concurrency']}: default-settings streams RTF {m['default_rtf_mean']:.3f} "
                    f"(uniform {m['uniform_rtf_mean']:.3f}, x{m['rtf_ratio']:.3f}), TTFB p90 "
                    f"{m['default_ttfb_ms_p90']:.0f} ms (uniform {m['uniform_ttfb_ms_p90']:.0f}, "
                    f"x{m['ttfb_p90_ratio']:.3f}); {other.get('requests', 0)} other streams at "
                    f"{other.get('settings')}: RTF {other.get('rtf_mean', float('nan')):.3f}")
    return "\n".join(rows)

def gpu_ms(fn, replays: int = 10, graphed: bool = False) -> float:
    """Mean GPU time of `fn` replayed as a CUDA graph (launch overhead excluded), in ms; `graphed`: fn already
    replays one."""
    fn()
    torch.cuda.synchronize()
    if not graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        fn = graph.replay
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def pipelined_step_ms(runner, b: int, steps: int = 20) -> float:
    """Wall ms per decode step of `b` rows in steady state with the VAE lane: each step graph replayed on the main
    stream while the previous step's VAE graph runs on the lane (as serving runs them), host launches included."""
    def step() -> None:
        runner.vae_lane.audio(b, runner.graphs.replay(b), runner.inputs.vae_slots)

    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / steps


def profiled(fn, host: bool = False, **options):
    """torch.profiler over one eager call of `fn` after a warm-up call (compiles, cuBLAS choices): GPU activity,
    and the host's with `host`; `options` go to the profiler (record_shapes, with_stack)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if host else [ProfilerActivity.CUDA]
    with torch_profile(activities=activities, **options) as prof:
        fn()
        torch.cuda.synchronize()
    return prof


def cuda_kernels(fn) -> list:
    """The GPU kernels one eager call of `fn` launches (what its CUDA graph holds as kernel nodes), as
    torch.profiler events; memcpy and memset excluded."""
    return [e for e in profiled(fn).events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.lower().startswith(("memcpy", "memset"))]


def kernel_count(fn) -> int:
    """How many GPU kernels one call of `fn` launches."""
    return len(cuda_kernels(fn))


def _profile_batch(runner, b: int, blocks: int, context: int, timesteps: int) -> dict[str, float]:
    from engine.model.attention import AttentionMetadata

    net, h, dtype = runner.model, runner.staging.arrays, runner.dtype
    runner.host.stage_padding(b)
    for j in range(b):
        table = list(range(j * blocks, (j + 1) * blocks))
        h["positions"][j], h["seq_lens"][j], h["vae_slots"][j], h["cfg"][j] = context, context + 1, j, \
            SamplingParams.cfg_value
        h["slots"][j] = table[context // 16] * 16 + context % 16
        h["block_tables"][j, :blocks] = table
    h["noise"][:b] = np.random.default_rng(b).standard_normal(h["noise"][:b].shape)
    h["patches"][:b] = np.random.default_rng(b + 1).standard_normal(h["patches"][:b].shape) * 0.5
    runner.inputs.copy_rows_(runner.staging.buffers, b)
    runner.lora_rows[:b].copy_(_lora_rows(runner, b))
    net.set_lora_indices(tokens=runner.lora_rows[:b], seqs=runner.lora_rows[:b])
    i = runner.inputs
    meta = AttentionMetadata(runner.cu_seqlens[:b + 1], i.seq_lens[:b], i.slots[:b], i.block_tables[:b], 1,
                             runner.max_positions)
    patches, noise, cfg, positions = i.patches[:b].to(dtype), i.noise[:b].to(dtype), i.cfg[:b].to(dtype), \
        i.positions[:b]
    x = torch.randn(b, runner.config.lm.hidden_size, device="cuda", dtype=dtype)
    sampled = net.sample_patches(x, x, patches, noise, timesteps, cfg)
    times = {
        "locenc": gpu_ms(lambda: net.encode_patches(patches)),
        "base_lm": gpu_ms(lambda: net.base_lm.forward_paged(x, positions, meta, runner.caches[0], net.attention)),
        "residual_lm": gpu_ms(lambda: net.residual_lm.forward_paged(x, positions, meta, runner.caches[1],
                                                                     net.attention)),
        "dit_all_steps": gpu_ms(lambda: net.sample_patches(x, x, patches, noise, timesteps, cfg)),
        "vae": gpu_ms(lambda: runner.vae_lane.decode(i.vae_slots[:b], sampled)),
    }
    if runner.graphs is not None and b in runner.graphs.graphs:
        if runner.vae_lane.graphs is None:
            times["whole_step_graph"] = gpu_ms(lambda: runner.graphs.replay(b), graphed=True)
        else:  # the step graph alone, the VAE lane's graph alone, and steady steps with the two overlapping
            times["step_graph_without_vae"] = gpu_ms(lambda: runner.graphs.replay(b), graphed=True)
            times["vae_graph"] = gpu_ms(lambda: runner.vae_lane.graphs.replay(b), graphed=True)
            times["whole_step_graph"] = pipelined_step_ms(runner, b)
    # eager, the same work the decode graph (and the VAE lane's) captures; a count, not ms
    times["kernels_per_step"] = kernel_count(lambda: runner._decode_body(b, runner.max_positions))
    if runner.vae_lane.graphs is not None:
        times["kernels_per_step"] += kernel_count(lambda: runner.vae_lane.body(b))
    times["dit_kernels"] = kernel_count(lambda: net.sample_patches(x, x, patches, noise, timesteps, cfg))
    return times


@torch.inference_mode()
def profile(model: str, dtype: str | None, timesteps: int, context: int, batches: tuple[int, ...] = (1, 64, 256),
            loras: int = 0, lora_rank: int = 32, fp8_prefill: bool = False, fp8_dit: bool = False,
            mixed_only: bool = False) -> dict:
    """GPU time per module of one decode step (LocEnc, base LM, residual LM, DiT with all Euler steps, VAE with its
    state gather/scatter) and of the whole graphed step, at each batch size, sequences `context` positions long.
    loras > 0: with that many random adapters in LoRA slots, row j using adapter j % loras + 1. `mixed_only`: only
    the host's side of real mixed steps (`_profile_mixed`: a burst's prefill step, prompts joining)."""
    from engine.checkpoint import load_model
    from engine.runner import Runner
    from engine.worker import WorkerConfig

    loaded = load_model(model, "cuda", dtype)
    if loras:
        _random_lora_slots(loaded.model, loras, lora_rank)
    blocks = -(-(context + 1) // DEFAULTS.block_size)
    # the Engine's token budget (its default), so a burst's prefill step takes the worker's path (padded flat buffers)
    runner = Runner(loaded, WorkerConfig(
        model=model, device="cuda", dtype=dtype, max_num_seqs=max(batches), num_kv_blocks=max(batches) * blocks,
        inference_timesteps=timesteps, max_loras=loras, max_lora_rank=lora_rank, fp8_prefill=fp8_prefill,
        fp8_dit=fp8_dit))
    from gateway_proc import git_commit  # bench/ is on the path: this file's folder

    out: dict = {"model": model, "dtype": str(runner.dtype), "timesteps": timesteps, "context": context,
                 "device": torch.cuda.get_device_name(0), "loras": loras, "fp8_prefill": fp8_prefill,
                 "fp8_dit": fp8_dit, "batches": {}, "git_commit": git_commit(), "command": " ".join(sys.argv),
                 "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    if mixed_only:
        out["mixed_steps"] = _profile_mixed(runner, loaded.config, PREFILL_POSITIONS)
        return out
    for b in batches:
        out["batches"][b] = times = _profile_batch(runner, b, blocks, context, timesteps)
        print(f"profile batch {b}: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()), file=sys.stderr)
    out["prefill"] = _profile_prefill(runner, (1, 8, 64), PREFILL_POSITIONS)
    out["mixed_steps"] = _profile_mixed(runner, loaded.config, PREFILL_POSITIONS)
    out["vae_dtypes"] = _profile_vae_dtypes(runner, loaded.vae, (1, 64, 256))
    out["top_kernels"] = {
        "decode_256": top_kernels(lambda: runner._decode_body(max(batches), runner.max_positions)),
        "decode_1": top_kernels(lambda: runner._decode_body(1, runner.max_positions), top=30),
        "prefill_64": top_kernels(lambda: _prefill(runner, 64, PREFILL_POSITIONS)),
    }
    if loras:  # where the adapters' time goes at the issue's concurrency
        out["top_kernels"]["decode_64"] = top_kernels(lambda: runner._decode_body(64, runner.max_positions))
    out["memory"] = runner.memory
    return out


PREFILL_POSITIONS = 114  # the anchor's prompt length


def _random_lora_slots(model, loras: int, rank: int) -> None:
    """Slots 1..loras of every LoRA target filled with random weights (as `register_random_loras` makes them)."""
    from engine.model.lora import attach_lora

    state = attach_lora(model, loras, rank)
    for layer in state.layers.values():  # fused groups' members are views: filling them fills the group
        layer.lora_A[1:].normal_(std=layer.lora_A.shape[-1] ** -0.5)
        layer.lora_B[1:].normal_(std=0.01)


class _FixedSlots:
    """The profile's adapters: already in their slots (`_random_lora_slots`), each named by its slot number."""

    def acquire(self, name: str) -> int:
        return int(name)

    def release(self, name: str) -> None:
        pass


def _lora_rows(runner, n: int) -> torch.Tensor:
    """Adapter slot of each of n rows, spread over all slots (all zeros without LoRA)."""
    slots = runner.model.lora.num_slots - 1 if runner.lora else 0
    rows = torch.arange(n, device=runner.device)
    return rows % slots + 1 if slots else torch.zeros_like(rows)


def _prefill(runner, seqs: int, length: int) -> None:
    """Both LMs over `seqs` text-only prompts of `length` positions, as one eager flat batch (a burst's prefill)."""
    from engine.model.attention import AttentionMetadata

    dev = runner.device
    blocks = -(-length // runner.block_size)
    tables = [list(range(j * blocks, (j + 1) * blocks)) for j in range(seqs)]
    meta = AttentionMetadata.build([length] * seqs, [0] * seqs, tables, runner.block_size, dev)
    n = seqs * length
    p, d = runner.config.patch_size, runner.config.feat_dim
    ids = torch.randint(0, runner.config.lm.vocab_size, (n,), device=dev)
    per_seq = _lora_rows(runner, seqs)
    runner.model.set_lora_indices(tokens=per_seq.repeat_interleave(length), seqs=per_seq)
    runner.model.forward_lms(ids, torch.zeros(n, p, d, device=dev, dtype=runner.dtype),
                             torch.zeros(n, dtype=torch.long, device=dev), meta.positions().long(), meta,
                             runner.caches, torch.arange(length - 1, n, length, device=dev),
                             audio_rows=torch.zeros(0, dtype=torch.long, device=dev))


def _profile_prefill(runner, seqs_list: tuple[int, ...], length: int) -> dict:
    """Wall time (eager, synchronized) of a text-only prefill of `seqs` x `length` positions, and positions/s."""
    out = {}
    for seqs in seqs_list:
        _prefill(runner, seqs, length)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            _prefill(runner, seqs, length)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 5 * 1e3
        out[seqs] = {"positions": seqs * length, "ms": round(ms, 2), "positions_per_s": round(seqs * length / ms * 1e3)}
        print(f"prefill {seqs} x {length}: {ms:.1f} ms", file=sys.stderr)
    return out


def _profile_mixed(runner, config, length: int) -> dict:
    """Host-side cost of real mixed steps through Scheduler + Runner: a burst of 64 new prompts in one step, then 16
    new prompts joining 64 decoding streams. Wall ms (synchronized) and the top Python functions by own time."""
    import cProfile
    import pstats

    from engine.request import RequestSpec, SamplingParams
    from engine.scheduler import Scheduler

    sched = Scheduler(max_num_seqs=runner.max_num_seqs, max_num_batched_tokens=length * 64 + 64,
                      num_blocks=runner.num_blocks, block_size=runner.block_size, patch_ms=config.patch_ms,
                      loras=_FixedSlots() if runner.lora else None)
    p, d = config.patch_size, config.feat_dim
    vocab = config.lm.vocab_size

    slots = _lora_rows(runner, 4 * runner.max_num_seqs).tolist()  # with LoRA slots: requests spread across them

    def add(count: int, tag: str) -> None:
        for i in range(count):
            ids = [(7 * i + k) % (vocab - 1) + 1 for k in range(length)]
            lora = str(slots[len(sched.requests) % len(slots)]) if runner.lora else None
            sched.add(RequestSpec(f"{tag}{i}", ids, [0] * length, (p, d),
                                  SamplingParams(seed=i, max_length=40, min_length=40, timesteps=runner.timesteps),
                                  lora=lora))

    def step() -> None:
        seqs = sched.schedule()
        out = runner.step(seqs)
        sched.postprocess(seqs, out.patches, out.stops)

    def sync() -> None:
        if runner.device.type == "cuda":
            torch.cuda.synchronize()

    def timed_step(label: str) -> dict:
        seqs = sched.schedule()
        prof = cProfile.Profile()
        sync()
        t0 = time.perf_counter()
        prof.enable()
        out = runner.step(seqs)
        prof.disable()
        sync()
        ms = (time.perf_counter() - t0) * 1e3
        sched.postprocess(seqs, out.patches, out.stops)
        stats = pstats.Stats(prof)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:20]  # by own (total) time
        top = [{"function": f"{Path(f).name}:{line}:{name}", "calls": cc, "own_ms": round(tt * 1e3, 2),
                "cum_ms": round(ct * 1e3, 2)} for (f, line, name), (cc, nc, tt, ct, _) in rows]
        # our own functions by cumulative time: which part of the step (staging, each LM, sampling) the host spends
        # it in; own-time ranks alone name only the leaves (torch ops, Triton's launcher)
        ours = sorted(((k, v) for k, v in stats.stats.items() if "/engine/" in k[0]), key=lambda kv: -kv[1][3])[:25]
        top_ours = [{"function": f"{Path(f).parent.name}/{Path(f).name}:{line}:{name}", "calls": cc,
                     "cum_ms": round(ct * 1e3, 2)} for (f, line, name), (cc, nc, tt, ct, _) in ours]
        print(f"mixed step {label}: {ms:.1f} ms, {len(seqs)} seqs, kind {runner.last_step.kind}; top: "
              + "; ".join(f"{t['function']} {t['own_ms']}" for t in top[:8]), file=sys.stderr)
        return {"seqs": len(seqs), "tokens": sum(q.num_tokens for q in seqs), "kind": runner.last_step.kind,
                "wall_ms": round(ms, 2), "gpu_ms": runner.last_step.gpu_ms, "top_functions": top,
                "engine_functions": top_ours}

    def kernel_step(label: str, timeline: bool = False, first: bool = False) -> dict:
        """A step without cProfile: its wall time, and the GPU time its kernels took (torch.profiler). Kernel time
        well below wall time means the step is host-bound (launches, Python), not GPU-bound. The profiled step is
        the next one like it (16 more prompts joining), or with `first` the same one again (a burst: 64 more)."""
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        seqs = sched.schedule()
        sync()
        t0 = time.perf_counter()
        out = runner.step(seqs)
        sync()
        wall = (time.perf_counter() - t0) * 1e3
        sched.postprocess(seqs, out.patches, out.stops)
        if first:
            while sched.has_work:
                step()
            add(64, f"{label}k")
        else:
            for _ in range(2):
                step()
            add(16, f"{label}k")
        seqs = sched.schedule()
        gpu = runner.device.type == "cuda"
        # `timeline`: the host's side too (where the GPU waits, and on what); kernel times are the device's either way
        activities = [ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
        if gpu and timeline:
            activities.append(ProfilerActivity.CPU)
        with torch_profile(activities=activities, with_stack=gpu and timeline) as prof:
            out = runner.step(seqs)
            sync()
        sched.postprocess(seqs, out.patches, out.stops)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel_ms = sum(e.device_time_total for e in kernels) / 1e3
        row = {"seqs": len(seqs), "tokens": sum(q.num_tokens for q in seqs), "wall_ms": round(wall, 2),
               "kernel_ms": round(kernel_ms, 2), "kernels": len(kernels)}
        if gpu and timeline:
            row["timeline"] = gpu_idle_timeline(prof.events())
        print(f"mixed step {label}: " + json.dumps(row)[:3000], file=sys.stderr)
        return row

    result = {}
    add(64, "warm")
    timed_step("warm-up burst")
    while sched.has_work:
        step()
    add(64, "burst")
    result["burst_64"] = timed_step("burst of 64")
    while sched.has_work:
        step()
    add(64, "burst_k")  # the same without cProfile: wall against kernel time, and where the GPU waits
    result["burst_64_kernels"] = kernel_step("burst of 64", timeline=True, first=True)
    for _ in range(3):
        step()
    add(16, "join")
    result["join_16_of_80"] = timed_step("16 joining 64")
    add(16, "again")
    result["join_16_of_80_kernels"] = kernel_step("16 joining 80")
    while sched.has_work:
        step()
    # at scale: 16 prompts joining ~224 decoding streams (their prompts admitted a few steps earlier)
    add(runner.max_num_seqs - 32, "many")
    while any(r.is_prefilling for r in sched.running) or sched.waiting:
        step()
    add(16, "joinmany")
    result["join_16_at_scale_kernels"] = kernel_step("16 joining at scale", timeline=True)
    return result


def gpu_idle_timeline(events, top: int = 12, min_gap_us: float = 100.0) -> dict:
    """Where a step leaves the GPU idle, from torch.profiler events with CPU and CUDA activity (with_stack): the
    step's span (first CPU event to last GPU activity), GPU busy time (union of kernels and copies), the idle gaps
    over `min_gap_us` with the CPU work under each (innermost op, CUDA runtime call, our own code's frame), and the
    host's CUDA runtime calls by total time."""
    cuda, cpu_type = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    gpu = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == cuda)
    cpu = [e for e in events if e.device_type == cpu_type]
    if not gpu or not cpu:
        return {}
    busy: list[list[float]] = []
    for a, b in gpu:
        if busy and a <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], b)
        else:
            busy.append([a, b])
    start = min(e.time_range.start for e in cpu)
    end = busy[-1][1]
    edges = [start] + [x for iv in busy for x in iv] + [end]
    gaps = [(edges[i], edges[i + 1]) for i in range(0, len(edges) - 1, 2) if edges[i + 1] - edges[i] >= min_gap_us]

    def own_frame(e) -> str:
        for frame in getattr(e, "stack", None) or []:
            if any(part in frame for part in ("engine/", "engine\\")):
                return frame
        return ""

    def under(t0: float, t1: float) -> dict:
        """The CPU events overlapping [t0, t1]: the longest of our frames, ops and runtime calls inside it."""
        inside = [e for e in cpu if e.time_range.start < t1 and e.time_range.end > t0]
        overlap = {id(e): min(e.time_range.end, t1) - max(e.time_range.start, t0) for e in inside}
        runtime = sorted((e for e in inside if e.name.startswith("cuda")), key=lambda e: -overlap[id(e)])
        ops = sorted((e for e in inside if not e.name.startswith("cuda")),
                     key=lambda e: (e.time_range.end - e.time_range.start))  # innermost first
        frames: dict[str, float] = {}
        for e in inside:
            f = own_frame(e)
            if f:
                frames[f] = max(frames.get(f, 0.0), overlap[id(e)])
        return {"runtime": [f"{e.name} {overlap[id(e)] / 1e3:.2f} ms" for e in runtime[:3]],
                "ops": [e.name for e in ops[:4]],
                "frames": [f for f, _ in sorted(frames.items(), key=lambda kv: -kv[1])[:4]]}

    runtime_totals: dict[str, list[float]] = {}
    for e in cpu:
        if e.name.startswith("cuda"):
            t = runtime_totals.setdefault(e.name, [0, 0.0])
            t[0] += 1
            t[1] += (e.time_range.end - e.time_range.start) / 1e3
    busy_ms = sum(b - a for a, b in busy) / 1e3
    return {"span_ms": round((end - start) / 1e3, 2), "gpu_busy_ms": round(busy_ms, 2),
            "gpu_idle_ms": round((end - start) / 1e3 - busy_ms, 2), "gaps_over_min": len(gaps),
            "idle_in_gaps_ms": round(sum(b - a for a, b in gaps) / 1e3, 2),
            "top_gaps": [{"at_ms": round((a - start) / 1e3, 2), "ms": round((b - a) / 1e3, 2), **under(a, b)}
                         for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:top]],
            "cuda_runtime": {k: {"calls": int(v[0]), "ms": round(v[1], 2)}
                             for k, v in sorted(runtime_totals.items(), key=lambda kv: -kv[1][1])[:8]}}


def _profile_vae_dtypes(runner, vae, batches: tuple[int, ...]) -> dict:
    """Streaming VAE decode of one patch in fp32 (as served) vs a bf16 copy: GPU ms and the bf16 audio's relative
    error over three consecutive patches (random weights: a bound on rounding, not a listening test)."""
    import copy

    vae16 = copy.deepcopy(vae).to(torch.bfloat16)
    c = runner.config
    out = {}
    for b in batches:
        latents = [torch.randn(b, c.feat_dim, c.patch_size, device="cuda") * 0.5 for _ in range(3)]
        s32, s16 = vae.stream_state(b), vae16.stream_state(b)
        ref = torch.cat([vae.decode_stream(x, s32) for x in latents], -1)
        low = torch.cat([vae16.decode_stream(x.bfloat16(), s16) for x in latents], -1).float()
        err = ((low - ref).norm() / ref.norm()).item()
        x32, x16 = latents[0], latents[0].bfloat16()
        t32 = gpu_ms(lambda x=x32, s=s32: vae.decode_stream(x, s))
        t16 = gpu_ms(lambda x=x16, s=s16, m=vae16: m.decode_stream(x, s))
        out[b] = {"fp32_ms": round(t32, 3), "bf16_ms": round(t16, 3), "bf16_rel_err": round(err, 5)}
        print(f"vae batch {b}: fp32 {t32:.2f} ms, bf16 {t16:.2f} ms, rel err {err:.4f}", file=sys.stderr)
    b = max(batches)  # where the fp32 decode's time goes, by op and input shape, and whether cuDNN's autotuner helps
    x, s = torch.randn(b, c.feat_dim, c.patch_size, device="cuda") * 0.5, vae.stream_state(b)
    out["ops_fp32"] = top_ops(lambda: vae.decode_stream(x, s))
    torch.backends.cudnn.benchmark = True
    try:
        out["fp32_ms_cudnn_benchmark"] = round(gpu_ms(lambda: vae.decode_stream(x, s)), 3)
    finally:
        torch.backends.cudnn.benchmark = False
    print(f"vae batch {b}: fp32 with cudnn.benchmark {out['fp32_ms_cudnn_benchmark']:.2f} ms; top ops "
          + "; ".join(f"{o['op']} {o['shapes']} {o['ms']}" for o in out["ops_fp32"][:6]), file=sys.stderr)
    return out


def top_ops(fn, top: int = 12) -> list[dict]:
    """The `top` torch ops of one eager call of `fn` by their own GPU time, grouped by input shapes."""
    prof = profiled(fn, host=True, record_shapes=True)

    def own_gpu_us(a) -> float:
        return getattr(a, "self_device_time_total", None) or getattr(a, "self_cuda_time_total", 0.0)

    ranked = sorted(prof.key_averages(group_by_input_shape=True), key=lambda a: -own_gpu_us(a))[:top]
    return [{"op": a.key, "shapes": str(a.input_shapes)[:160], "calls": a.count, "ms": round(own_gpu_us(a) / 1e3, 3)}
            for a in ranked]


def top_kernels(fn, top: int = 15) -> list[dict]:
    """The `top` GPU kernels of one eager call of `fn` by total time: name, calls, total ms."""
    totals: dict[str, list[float]] = {}
    for e in cuda_kernels(fn):
        t = totals.setdefault(e.name[:90], [0, 0.0])
        t[0] += 1
        t[1] += e.device_time_total / 1e3
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"kernel": k, "calls": int(v[0]), "ms": round(v[1], 3)} for k, v in ranked]


def profile_table(result: dict) -> str:
    names = list(next(iter(result["batches"].values()), {}))
    rows = ["| batch | " + " | ".join(names) + " (ms; kernels: counts) |", "|---" * (len(names) + 1) + "|"]
    for b, times in result["batches"].items():
        rows.append(f"| {b} | " + " | ".join(f"{times[n]:.0f}" if "kernels" in n else f"{times[n]:.2f}"
                                             for n in names) + " |")
    for seqs, p in result.get("prefill", {}).items():
        rows.append(f"prefill {seqs} seqs, {p['positions']} positions: {p['ms']} ms ({p['positions_per_s']}/s)")
    for b, v in result.get("vae_dtypes", {}).items():
        if isinstance(v, dict) and "fp32_ms" in v:  # the batches; beside them the op breakdown and cuDNN autotune
            rows.append(f"VAE batch {b}: fp32 {v['fp32_ms']} ms, bf16 {v['bf16_ms']} ms, bf16 rel err "
                        f"{v['bf16_rel_err']}")
    for name, step in result.get("mixed_steps", {}).items():
        rows.append(f"mixed step {name}: wall {step['wall_ms']} ms, " + (
            f"kernels {step['kernel_ms']} ms" if "kernel_ms" in step else
            "top: " + "; ".join(f"{t['function'][-40:]} {t['own_ms']}" for t in step["top_functions"][:6])))
    for name, kernels in result.get("top_kernels", {}).items():
        rows.append(f"top kernels, {name}: " + "; ".join(f"{k['kernel'][:40]} x{k['calls']} {k['ms']}"
                                                         for k in kernels[:6]))
    return "\n".join(rows)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model directory (its stop head should never fire for fixed lengths)")
    src.add_argument("--random-size", choices=["tiny", "voxcpm2", "voxcpm1.5"], default="tiny")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--patches", type=int, default=20, help="patches per request (fixed length)")
    p.add_argument("--prompt-positions", type=int, help="fix the prefill length (text tokens + 1) instead of the "
                   "words: the Nano-vLLM-VoxCPM H200 numbers used ~114")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per level (default: requests-factor x concurrency, at most max-requests)")
    p.add_argument("--requests-factor", type=int, default=1)
    p.add_argument("--max-requests", type=int, default=1024)
    p.add_argument("--extra", type=lambda s: [x for x in s.split(",") if x], default=[],
                   help="more levels on the same engine after the sweep: closed:C (C users), poisson:R (R req/s), "
                        "batch:C, mixed-one:C and mixed-quarter:C (one stream in C, or in 4, at other settings), "
                        "twokey:N (key A's N streams at once against key B's one: bench/two_key.py)")
    p.add_argument("--profile", action="store_true", help="CUDA only: per-module GPU times of a decode step")
    p.add_argument("--profile-mixed", action="store_true", help="with --profile: only the host's side of mixed steps "
                   "(a burst's prefill step under cProfile, and its GPU idle gaps)")
    p.add_argument("--closed-loop", action="store_true", help="each of C users sends requests back to back")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per level in closed loop")
    p.add_argument("--ramp", type=float, default=0.0, help="closed loop: start the users evenly over this many "
                   "seconds (about one request's length keeps them spread; 0: all at once)")
    p.add_argument("--poisson", type=float, default=0.0, help="open loop: RATE requests/s (uses --requests)")
    p.add_argument("--context", type=int, default=160, help="--profile: KV positions per sequence")
    p.add_argument("--timesteps", type=int, default=DEFAULTS.inference_timesteps)
    p.add_argument("--max-timesteps", type=int, default=None, help="the most diffusion steps served (the engine's "
                   "max_timesteps; default --timesteps)")
    p.add_argument("--other-timesteps", type=lambda s: [int(x) for x in s.split(",")], default=[1, 5],
                   help="mixed modes: the other streams' timesteps, taken in turn (default 1,5; at most the served)")
    p.add_argument("--other-cfg", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 3.0],
                   help="mixed modes: the other streams' cfg_value, taken in turn (default 1,3)")
    p.add_argument("--lora", type=int, default=0, help="register N random LoRA adapters; requests spread across them")
    p.add_argument("--lora-rank", type=int, default=DEFAULTS.max_lora_rank)
    p.add_argument("--max-loras", type=int, default=0, help="LoRA GPU slots (default: --lora, all resident)")
    p.add_argument("--no-merge-lora", action="store_true", help="LoRA kernels even when every running request "
                   "uses one adapter (default: such steps run it merged into the weights)")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULTS.max_num_seqs)
    p.add_argument("--dtype", default=None)
    p.add_argument("--vae-dtype", default=DEFAULTS.vae_dtype,
                   help="the streaming VAE decoder's dtype (float32, bfloat16)")
    p.add_argument("--fp8-prefill", action="store_true", help="the LMs' large (prefill) GEMMs in FP8")
    p.add_argument("--fp8-dit", action="store_true", help="the LocDiT's GEMMs of busy steps in FP8")
    p.add_argument("--gpu-memory-utilization", type=float, default=DEFAULTS.gpu_memory_utilization)
    p.add_argument("--split-decodes-above", type=int, default=DEFAULTS.split_decodes_above,
                   help="more speaking streams than this decode in two halves taking turns (0: never split)")
    p.add_argument("--timeline", action="store_true", help="per-request start and TTFB in the JSON (with "
                   "VOXGATE_LOG=DEBUG the worker logs each step's wall-clock start beside it)")
    p.add_argument("--out", help="write the JSON result here")
    return p.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.profile:
        result = profile(model_dir(arguments), arguments.dtype, arguments.timesteps, arguments.context,
                         loras=arguments.lora, lora_rank=arguments.lora_rank, fp8_prefill=arguments.fp8_prefill,
                         fp8_dit=arguments.fp8_dit, mixed_only=arguments.profile_mixed)
        render = profile_table
    else:
        result = asyncio.run(main(arguments))
        render = table
    text = json.dumps(result, indent=2)
    if arguments.out:
        Path(arguments.out).write_text(text)
    else:
        print(text)
    print(render(result))
