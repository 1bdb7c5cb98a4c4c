"""The engine on a CUDA GPU: bf16 vs fp32 per module, graphed decode step == eager step, graphs in the serving
engine (steps launched ahead, split decodes, the VAE lane), and the memory budget at gpu_memory_utilization 0.9
with 512 concurrent streams.

Run on the GPU machine: `python -m pytest -q -m gpu tests/gpu/test_engine_gpu.py` (bench/gpu_run.sh does). One test
runs on CPU too: the bucket padding of the static-buffer path (graphs are CUDA-only; their body is not).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from engine import Engine
from engine.checkpoint import load_model
from engine.model.attention import AttentionMetadata, KVCache, TorchAttention, make_attention_backend
from engine.request import RequestSpec, SamplingParams
from engine.runner import Runner
from engine.scheduler import Scheduler
from engine.worker import WorkerConfig

gpu = pytest.mark.gpu


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_spec(i: int, config, timesteps: int, prompt_len: int = 12, cfg_value: float = 2.0) -> RequestSpec:
    tokens = [(7 * i + k) % 50 + 1 for k in range(prompt_len)]
    p, d = config.patch_size, config.feat_dim
    return RequestSpec(f"r{i}", tokens, [0] * prompt_len, (p, d),
                       SamplingParams(cfg_value=cfg_value, seed=i, max_length=50, min_length=50, timesteps=timesteps))


def runner_and_scheduler(loaded, max_num_seqs: int, timesteps: int, blocks: int = 128, tokens: int = 512,
                         **config) -> tuple[Runner, Scheduler]:
    device = str(next(loaded.model.parameters()).device)
    cfg = WorkerConfig(model="", device=device, dtype=None, max_num_seqs=max_num_seqs, max_num_batched_tokens=tokens,
                       block_size=16, num_kv_blocks=blocks, gpu_memory_utilization=0.9,
                       inference_timesteps=timesteps, **config)
    runner = Runner(loaded, cfg)
    return runner, Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=tokens, num_blocks=runner.num_blocks,
                             block_size=16, patch_ms=loaded.config.patch_ms)


def advance(runner: Runner, sched: Scheduler):
    seqs = sched.schedule()
    out = runner.step(seqs)
    sched.postprocess(seqs, out.patches, out.stops)
    return seqs, out


def graphed_vs_eager(runner: Runner, seqs):
    """Run `seqs` through launch/collect (graphs) and, from the same saved state, through the eager step: the
    outputs, the KV cache and the VAE state agree, except the scratch block and row the padding rows write."""
    reqs = [s.request for s in seqs]
    state = [t.clone() for c in runner.caches for t in (c.k, c.v)] + [b.clone() for b in runner.vae_lane.state.buffers]
    rng = [r.generator.get_state() for r in reqs]
    live = [t for c in runner.caches for t in (c.k, c.v)] + list(runner.vae_lane.state.buffers)

    graphed = runner.collect(runner.launch(seqs))
    graphed_audio = [None if a is None else a.copy() for a in graphed.audio]
    graphed_state = [t.clone() for t in live]
    for t, saved in zip(live, state, strict=True):
        t.copy_(saved)
    for r, saved in zip(reqs, rng, strict=True):
        r.generator.set_state(saved)
    eager = runner._eager_step(seqs)

    assert graphed.stops == eager.stops
    assert sum(p is not None for p in graphed.patches) == sum(s.emit for s in seqs) > 0
    for g, e, ga, ea in zip(graphed.patches, eager.patches, graphed_audio, eager.audio, strict=True):
        assert (g is None) == (e is None) == (ga is None) == (ea is None)
        if g is not None:
            assert torch.isfinite(g).all() and np.isfinite(ga).all()
            assert relative_error(g, e) < 1e-4
            assert relative_error(torch.from_numpy(ga), torch.from_numpy(ea)) < 1e-3  # ~30 convs deep
    scratch, slot = runner.scratch_block, runner.vae_lane.scratch_slot
    for i, (g, t) in enumerate(zip(graphed_state, live, strict=True)):
        real = (slice(None), slice(0, scratch)) if i < 4 else (slice(0, slot),)
        assert relative_error(g[real], t[real]) < 1e-3
    return eager


@pytest.fixture
def no_tf32():
    """cuDNN runs fp32 convolutions in TF32 by default: 1e-3 differences between algorithms, not between paths."""
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = previous


MIXED_TIMESTEPS = (4, 1, 6, 2, 5, 3)  # around the default 4, up to the served 6 (`max_timesteps`)
MIXED_CFG = (2.0, 1.0, 0.0, 3.0)


def check_graphed_steps(runner: Runner, sched: Scheduler, loaded, batch: int, mixed: bool = False) -> None:
    """`mixed`: each row at its own timesteps and cfg (MIXED_*), in the same decode graph and sample graph; the
    eager reference solves each timesteps group on its own."""
    for i in range(batch):
        timesteps, cfg = (MIXED_TIMESTEPS[i % 6], MIXED_CFG[i % 4]) if mixed else (4, 1.5 + 0.25 * (i % 3))
        sched.add(make_spec(i, loaded.config, timesteps=timesteps, prompt_len=10 + 3 * i, cfg_value=cfg))
    for _ in range(3):
        advance(runner, sched)
    seqs = sched.schedule()
    assert runner._decode_only(seqs) and len(seqs) == batch
    out = graphed_vs_eager(runner, seqs)  # a decode step: one graph
    sched.postprocess(seqs, out.patches, out.stops)
    sched.add(make_spec(99, loaded.config, timesteps=4, prompt_len=20))
    seqs = sched.schedule()
    assert not runner._decode_only(seqs) and len(seqs) == batch + 1
    graphed_vs_eager(runner, seqs)  # a mixed step: eager LMs, then the sample + VAE graph


@gpu
@pytest.mark.parametrize("batch", [8, 5])  # 8 fills its bucket; 5 runs with 3 padding rows
def test_graphed_steps_equal_eager_steps(cuda, tiny_v2_dir, no_tf32, batch):
    loaded = load_model(tiny_v2_dir, cuda, "float32")  # fp32: the two paths differ only in summation order
    runner, sched = runner_and_scheduler(loaded, max_num_seqs=16, timesteps=4)
    assert runner.graphs is not None and runner.sample_graphs is not None
    check_graphed_steps(runner, sched, loaded, batch)


@gpu
@pytest.mark.parametrize("batch", [8, 5])
def test_graphed_steps_at_mixed_settings_equal_eager_steps(cuda, tiny_v2_dir, no_tf32, batch):
    """A request's settings never change the step's path: rows at timesteps 1-6 (default 4, served up to 6) and cfg
    0, 1, 2, 3 replay the same decode and sample graphs as a uniform batch (the default's 3 evaluations), rows at 5
    and 6 finish theirs in a tail graph; each row equals its eager solve."""
    loaded = load_model(tiny_v2_dir, cuda, "float32")
    runner, sched = runner_and_scheduler(loaded, max_num_seqs=16, timesteps=4, max_timesteps=6)
    assert runner.graph_evals == 3 and runner.schedules.width == 5 and runner.tail.graphs is not None
    replays, tails = [], []
    replay, tail = runner.graphs.replay, runner.tail.graphs.replay
    runner.graphs.replay = lambda rows: replays.append(rows) or replay(rows)
    runner.tail.graphs.replay = lambda rows: tails.append(rows) or tail(rows)
    check_graphed_steps(runner, sched, loaded, batch, mixed=True)
    assert replays and tails  # the decode step of mixed settings replayed its graph, then the tail's


@gpu
def test_large_lm_graphs_equal_eager_steps(cuda, tiny_v2_dir, no_tf32):
    """Past the small LM graphs: a burst of prompts replays a large LM graph that runs LocEnc on no row, prompts
    joining speaking streams one that runs it on the listed audio rows (the decode rows, padded with a repeat);
    both equal the eager step, and their attention finds each query block's sequence among mostly empty ones."""
    loaded = load_model(tiny_v2_dir, cuda, "float32")
    runner, sched = runner_and_scheduler(loaded, max_num_seqs=48, timesteps=4, blocks=1024, tokens=4096)
    replayed = []
    replay = runner.lm_graphs.replay
    runner.lm_graphs.replay = lambda key: replayed.append(key) or replay(key)
    eager_step = runner._eager_step

    def eager_lms(seqs):  # the reference: the step with its LMs eager (no large graph holds it)
        keys = runner.lm_keys
        runner.host.lm_keys = [k for k in keys if len(k) == 2]
        try:
            return eager_step(seqs)
        finally:
            runner.host.lm_keys = keys

    runner._eager_step = eager_lms
    for i in range(24):
        sched.add(make_spec(i, loaded.config, timesteps=4, prompt_len=90 + i))
    seqs = sched.schedule()
    assert sum(s.num_tokens for s in seqs) > 2048 and all(not s.request.generated for s in seqs)
    out = graphed_vs_eager(runner, seqs)
    assert len(replayed) == 1 and len(replayed[0]) == 3 and replayed[0][2] == 0
    sched.postprocess(seqs, out.patches, out.stops)
    for _ in range(2):
        advance(runner, sched)
    for i in range(20):
        sched.add(make_spec(100 + i, loaded.config, timesteps=4, prompt_len=110))
    seqs = sched.schedule()
    assert len(seqs) == 44 and sum(s.num_tokens for s in seqs) > 2048
    replayed.clear()
    graphed_vs_eager(runner, seqs)
    assert len(replayed) == 1 and len(replayed[0]) == 3 and replayed[0][2] >= 24


@gpu
def test_a_mixed_step_of_many_decode_rows_replays_a_large_lm_graph_of_its_own_size(cuda, tiny_v2_dir, no_tf32):
    """More sequences than the small LM graphs hold, few positions (a busy gateway's step: ~70 decode rows and a new
    prompt): a large LM graph of the smallest eager bucket holding them (not one of 2,304 positions), equal to the
    eager step."""
    loaded = load_model(tiny_v2_dir, cuda, "float32")
    runner, sched = runner_and_scheduler(loaded, max_num_seqs=80, timesteps=4, blocks=1024, tokens=4096)
    replayed = []
    replay = runner.lm_graphs.replay
    runner.lm_graphs.replay = lambda key: replayed.append(key) or replay(key)
    eager_step = runner._eager_step

    def eager_lms(seqs):  # the reference: the step with its LMs eager
        keys = runner.lm_keys
        runner.host.lm_keys = [k for k in keys if len(k) == 2]
        try:
            return eager_step(seqs)
        finally:
            runner.host.lm_keys = keys

    runner._eager_step = eager_lms
    for i in range(70):
        sched.add(make_spec(i, loaded.config, timesteps=4, prompt_len=12))
    advance(runner, sched)
    sched.add(make_spec(100, loaded.config, timesteps=4, prompt_len=30))
    seqs = sched.schedule()
    assert len(seqs) == 71 and sum(s.num_tokens for s in seqs) == 100
    replayed.clear()
    graphed_vs_eager(runner, seqs)
    assert len(replayed) == 1 and replayed[0][0] == 256 and replayed[0][2] >= 70


@gpu
def test_fp8_locdit_graphed_decode_step_equals_its_eager_step(cuda, tiny_v2_dir, no_tf32, monkeypatch):
    """`fp8_dit`: the tiny LocDiT's 8 x 22 rows in FP8 (MIN_ROWS lowered), captured in the decode graph; the bucket
    is full, so the graph's GEMMs see the eager step's rows."""
    from engine.model import fp8

    monkeypatch.setattr(fp8, "MIN_ROWS", 64)
    loaded = load_model(tiny_v2_dir, cuda, "float32")
    runner, sched = runner_and_scheduler(loaded, max_num_seqs=16, timesteps=4, fp8_dit=True)
    assert runner.graphs is not None and loaded.model.feat_decoder.estimator.decoder.layers[0].mlp.down8 is not None
    for i in range(8):
        sched.add(make_spec(i, loaded.config, timesteps=4, prompt_len=10 + 3 * i))
    for _ in range(3):
        advance(runner, sched)
    seqs = sched.schedule()
    assert runner._decode_only(seqs) and len(seqs) == 8
    graphed_vs_eager(runner, seqs)


@pytest.mark.parametrize("mixed", [False, True])
def test_bucket_padding_rows_are_harmless_on_cpu(tiny_v2_dir, mixed):
    loaded = load_model(tiny_v2_dir, "cpu")
    runner, sched = runner_and_scheduler(loaded, max_num_seqs=16, timesteps=4, max_timesteps=6 if mixed else None)
    runner.buckets = [8, 16]  # CPU runs the exact batch by default; force the CUDA bucketing (5 -> 8 rows)
    tails = []
    if mixed:
        tail = runner.tail.body
        runner.tail.body = lambda rows: tails.append(rows) or tail(rows)
    check_graphed_steps(runner, sched, loaded, 5, mixed=mixed)
    assert tails == [8] * len(tails) and bool(tails) == mixed  # 2 rows at 5 and 6 timesteps + 6 of padding


@gpu
@torch.inference_mode()
def test_bf16_matches_fp32_reference_per_module(cuda, voxcpm2_dir):
    ref, low = load_model(voxcpm2_dir, cuda, "float32"), load_model(voxcpm2_dir, cuda, "bfloat16")
    ref.model.attention = TorchAttention()
    low.model.attention = make_attention_backend(cuda, 16)
    config = ref.config
    p, d, n = config.patch_size, config.feat_dim, 96
    gen = torch.Generator(cuda).manual_seed(0)
    tokens = torch.randint(1, 1000, (n,), generator=gen, device=cuda)
    meta = AttentionMetadata.build([n], [0], [list(range(n // 16))], 16, cuda)
    errors = {}
    hidden = {}
    for name, loaded in (("fp32", ref), ("bf16", low)):
        kv = tuple(KVCache.allocate(s, n // 16, 16, cuda, loaded.dtype) for s in (config.lm, config.residual_lm))
        hidden[name] = loaded.model.forward_lms(tokens, torch.zeros(n, p, d, device=cuda, dtype=loaded.dtype),
                                                torch.zeros(n, dtype=torch.long, device=cuda),
                                                torch.arange(n, device=cuda), meta, kv,
                                                torch.tensor([n - 1], device=cuda))
    errors["lm_hidden"] = relative_error(hidden["bf16"][0].float(), hidden["fp32"][0])
    errors["residual_hidden"] = relative_error(hidden["bf16"][1].float(), hidden["fp32"][1])
    lm_h, res_h = hidden["fp32"]  # the DiT on identical inputs
    cond = torch.randn(1, p, d, generator=gen, device=cuda)
    noise = torch.randn(1, d, p, generator=gen, device=cuda)
    cfg = torch.full((1,), 2.0, device=cuda)
    patch = ref.model.sample_patches(lm_h, res_h, cond, noise, 10, cfg)
    patch_low = low.model.sample_patches(lm_h.bfloat16(), res_h.bfloat16(), cond.bfloat16(), noise.bfloat16(), 10,
                                         cfg.bfloat16())
    errors["patch"] = relative_error(patch_low, patch)
    latents = torch.randn(2, d, 3 * p, generator=gen, device=cuda)  # the VAE (kept fp32) vs a bf16 copy of it
    audio = ref.vae.decode(latents)
    audio_low = low.vae.to(torch.bfloat16).decode(latents.bfloat16()).float()
    errors["vae_audio_bf16"] = relative_error(audio_low, audio)
    print("bf16 vs fp32 relative errors:", {k: f"{v:.2e}" for k, v in errors.items()})
    assert errors["lm_hidden"] < 0.05 and errors["residual_hidden"] < 0.05
    assert errors["patch"] < 0.1
    assert errors["vae_audio_bf16"] < 0.1


@gpu
async def test_engine_with_graphs_streams_finite_audio_for_concurrent_requests(cuda, tiny_v2_dir):
    engine = Engine(str(tiny_v2_dir), max_num_seqs=16, num_kv_blocks=256, inference_timesteps=4)
    await engine.wait_for_ready()
    try:
        async def one(i: int) -> list:
            return [c async for c in engine.generate(f"Stream number {i} says hello.", seed=i, max_length=6,
                                                     min_length=6)]

        results = await asyncio.gather(*(one(i) for i in range(12)))
        spp = engine.model_info().samples_per_patch
        for chunks in results:
            assert len(chunks) == 6
            for c in chunks:
                assert c.audio.shape == (spp,) and np.isfinite(c.audio).all()
        same = await asyncio.gather(one(3), one(3))  # same seed alone twice (different batch partners)
        np.testing.assert_allclose(np.concatenate([c.audio for c in same[0]]),
                                   np.concatenate([c.audio for c in same[1]]), atol=5e-2)
    finally:
        await engine.stop()


async def serve_tiny(tiny_v2_dir, monkeypatch, env: dict[str, str], streams, stat: str,
                     **engine_args) -> tuple[list[list], int]:
    """`streams(engine)`'s chunk lists from a fresh tiny engine under `env`, and the workers' stat `stat` after."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    engine = Engine(str(tiny_v2_dir), max_num_seqs=16, num_kv_blocks=256, inference_timesteps=4, **engine_args)
    await engine.wait_for_ready()
    try:
        results = await streams(engine)
        return results, sum(w["stats"][stat] for w in engine.health()["workers"])
    finally:
        await engine.stop()


def assert_same_streams(runs: list[list], reference: list[list]) -> None:
    """Chunk for chunk the same streams, bf16 audio within the batch-invariance tolerance."""
    for a, s in zip(runs, reference, strict=True):
        assert [c.index for c in a] == [c.index for c in s] and a[-1].stop_reason == s[-1].stop_reason
        np.testing.assert_allclose(np.concatenate([c.audio for c in a]), np.concatenate([c.audio for c in s]),
                                   atol=5e-2)


@gpu
async def test_streams_at_mixed_settings_equal_each_stream_alone(cuda, tiny_v2_dir, monkeypatch):
    """The serving engine (decode graphs, steps launched ahead, the VAE lane) with streams at timesteps 1-6 (default
    4, served up to 6) and cfg 0-3 sharing steps: each stream equals its run alone on the same engine (bf16, within
    the batch-invariance tolerance), and no step left the graphs for their sake."""
    text = "Every stream keeps its own settings."
    cases = [dict(seed=40 + i, timesteps=MIXED_TIMESTEPS[i % 6], cfg_value=MIXED_CFG[i % 4]) for i in range(12)]

    async def streams(engine: Engine) -> list[list]:
        async def one(case: dict) -> list:
            return [c async for c in engine.generate(text, max_length=8, min_length=8, **case)]

        together = await asyncio.gather(*(one(case) for case in cases))
        alone = [await one(case) for case in cases]
        return [together, alone]

    (together, alone), ahead = await serve_tiny(tiny_v2_dir, monkeypatch, {}, streams, "ahead_steps",
                                                max_timesteps=6)
    assert ahead > 0  # steady steps of mixed settings were launched ahead, as uniform ones are
    assert len({c.step for chunks in together for c in chunks}) < sum(len(chunks) for chunks in together)
    assert_same_streams(together, alone)


@gpu
async def test_steps_launched_ahead_equal_one_step_at_a_time(cuda, tiny_v2_dir, monkeypatch):
    """Async scheduling (each steady decode step launched before the previous one is collected, its patches fed on
    the device) gives the streams of one step at a time: same lengths, same stops, same audio."""

    async def streams(engine: Engine) -> list[list]:
        async def one(case: dict) -> list:
            return [c async for c in engine.generate("Hello there, how are you today?", **case)]

        cases = [dict(seed=s, max_length=16, min_length=0 if s % 2 else 16) for s in range(8)]
        return await asyncio.gather(*(one(case) for case in cases))

    ahead, launched_ahead = await serve_tiny(tiny_v2_dir, monkeypatch, {"VOXGATE_ASYNC_SCHEDULING": "1"}, streams,
                                             "ahead_steps")
    sync, launched_sync = await serve_tiny(tiny_v2_dir, monkeypatch, {"VOXGATE_ASYNC_SCHEDULING": "0"}, streams,
                                           "ahead_steps")
    assert launched_ahead > 0 and launched_sync == 0
    assert any(chunks[-1].stop_reason == "stop" for chunks in ahead)
    assert_same_streams(ahead, sync)


@gpu
async def test_prompts_admitted_ahead_equal_one_step_at_a_time(cuda, tiny_v2_dir, monkeypatch):
    """`async_mixed`: prompts that arrive while streams speak are admitted by a step launched ahead (the speaking
    streams' patches fed on the device into the flat batch and the sampling inputs, through the LM graphs or the
    padded eager path). The streams equal those of one step at a time (lengths fixed: arrival timing may change
    batch partners, so bf16 audio is compared within the batch-invariance tolerance)."""
    texts = ["Streaming speech should start quickly and never stop.", "Hi there.",
             "The quick brown fox jumps over the lazy dog. " * 12, "Good morning!"]

    async def streams(engine: Engine) -> list[list]:
        joined = [asyncio.Event() for _ in texts]

        async def one(i: int) -> list:
            if i:
                await joined[i - 1].wait()
            chunks = []
            async for c in engine.generate(texts[i], seed=i, max_length=12, min_length=12):
                chunks.append(c)
                joined[i].set()
            return chunks

        return await asyncio.gather(*(one(i) for i in range(len(texts))))

    mixed = {"VOXGATE_ASYNC_SCHEDULING": "1", "VOXGATE_ASYNC_MIXED": "1"}
    one_at_a_time = {"VOXGATE_ASYNC_SCHEDULING": "0", "VOXGATE_ASYNC_MIXED": "0"}
    ahead, admitted = await serve_tiny(tiny_v2_dir, monkeypatch, mixed, streams, "ahead_admitting",
                                       max_num_batched_tokens=256)
    sync, admitted_sync = await serve_tiny(tiny_v2_dir, monkeypatch, one_at_a_time, streams, "ahead_admitting",
                                           max_num_batched_tokens=256)
    assert admitted > 0 and admitted_sync == 0
    assert all([c.index for c in a] == list(range(12)) for a in ahead)
    assert_same_streams(ahead, sync)


@gpu
async def test_split_decodes_equal_one_step_at_a_time(cuda, tiny_v2_dir, monkeypatch):
    """Split decodes (more than `split_decodes_above` speaking streams take turns by half) with graphs, steps
    launched ahead decoding the other half and admitting late prompts: the streams of one step at a time without
    splitting (lengths fixed; bf16 audio within the batch-invariance tolerance)."""

    async def streams(engine: Engine) -> list[list]:
        speaking = asyncio.Event()

        async def one(i: int) -> list:
            if i >= 8:  # the last four join while the first eight speak, split
                await speaking.wait()
            chunks = []
            async for c in engine.generate("Hello there, how are you today?", seed=i, max_length=14, min_length=14):
                chunks.append(c)
                if i == 0 and c.index == 2:
                    speaking.set()
            return chunks

        return await asyncio.gather(*(one(i) for i in range(12)))

    mixed = {"VOXGATE_ASYNC_SCHEDULING": "1", "VOXGATE_ASYNC_MIXED": "1"}
    one_at_a_time = {"VOXGATE_ASYNC_SCHEDULING": "0", "VOXGATE_ASYNC_MIXED": "0"}
    split, split_steps = await serve_tiny(tiny_v2_dir, monkeypatch, mixed, streams, "split_steps",
                                          split_decodes_above=4)
    sync, sync_split = await serve_tiny(tiny_v2_dir, monkeypatch, one_at_a_time, streams, "split_steps",
                                        split_decodes_above=None)
    assert split_steps > 0 and sync_split == 0
    assert all([c.index for c in a] == list(range(14)) for a in split)
    assert_same_streams(split, sync)


@gpu
async def test_vae_lane_equals_the_vae_inside_the_step_graph(cuda, tiny_v2_dir, monkeypatch):
    """The VAE lane (each step's VAE decode replayed on a second stream while the next step runs) gives the streams
    of the VAE inside each step's graph: with steps launched ahead, prompts admitted ahead, streams ending and their
    VAE rows reused, and continuation segments whose rows are primed on the lane from the prompt's patches (lengths
    fixed). fp32, so that no rounding change (other batch partners) can explain a difference: this test caught the
    lane's graphs sharing the step graphs' cuBLAS workspace (`engine.cuda_graphs.StepGraphs`), in fp32 2 runs of 3
    on an H200 in s13, once in bf16."""
    texts = ["Streaming speech should start quickly.", "Hi there.", "The quick brown fox jumps over the lazy dog.",
             "Good morning!", "One more voice in the batch."]

    async def streams(engine: Engine) -> list[list]:
        first = [c async for c in engine.generate("A first segment to continue from.", seed=7, max_length=6,
                                                  min_length=6)]
        context = np.stack([c.latents for c in first])

        async def one(i: int) -> list:
            await asyncio.sleep(0.02 * i)  # arrivals while the others speak
            # lengths fixed: arrival times may change batch partners, and bf16 rounding with them a stop decision
            kwargs: dict = dict(seed=i, max_length=8 + 2 * i, min_length=8 + 2 * i)
            if i % 2 == 0:  # a continuation: its VAE row starts from the first segment's last patches
                kwargs.update(prompt_latents=context, prompt_text="A first segment to continue from.")
            return [c async for c in engine.generate(texts[i % len(texts)], **kwargs)]

        return [first, *await asyncio.gather(*(one(i) for i in range(10)))]

    mixed = {"VOXGATE_ASYNC_SCHEDULING": "1", "VOXGATE_ASYNC_MIXED": "1"}
    lane, ahead = await serve_tiny(tiny_v2_dir, monkeypatch, {**mixed, "VOXGATE_VAE_STREAM": "1"}, streams,
                                   "ahead_steps", dtype="float32")
    inside, _ = await serve_tiny(tiny_v2_dir, monkeypatch, {**mixed, "VOXGATE_VAE_STREAM": "0"}, streams,
                                 "ahead_steps", dtype="float32")
    assert ahead > 0
    assert_same_streams(lane, inside)


@gpu
@pytest.mark.timeout(420)
async def test_512_concurrent_streams_fit_at_utilization_09(cuda, voxcpm2_dir):
    engine = Engine(str(voxcpm2_dir), max_num_seqs=512, max_waiting=512, gpu_memory_utilization=0.9,
                    inference_timesteps=10)
    await engine.wait_for_ready()
    peak = 0
    try:
        async def one(i: int) -> int:
            chunks = [c async for c in engine.generate(f"Caller {i}: hello, how are you today?", seed=i,
                                                       max_length=4, min_length=4)]
            assert all(np.isfinite(c.audio).all() for c in chunks)
            return len(chunks)

        async def watch():
            nonlocal peak
            while True:
                peak = max(peak, engine.stats().running)
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        counts = await asyncio.gather(*(one(i) for i in range(512)))
        watcher.cancel()
        assert counts == [4] * 512
        assert peak >= 256, f"only {peak} streams ran at once"
        print(f"512 streams: peak running {peak}; memory {engine._workers[0].info.get('memory')}")
    finally:
        await engine.stop()
