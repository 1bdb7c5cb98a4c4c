"""Per-step instrumentation (what the worker reports and the bench summarises) and the runner's warm-up."""

from __future__ import annotations

import numpy as np
import torch

from engine.checkpoint import load_model
from engine.request import RequestSpec, SamplingParams
from engine.runner import Runner
from engine.scheduler import Scheduler
from engine.worker import STEP_MS_EDGES, StepStats, WorkerConfig, hist_percentile, ms_bucket


def test_histogram_percentiles_track_numpy_within_one_bucket():
    rng = np.random.default_rng(0)
    times = rng.lognormal(mean=3.0, sigma=1.0, size=2000)
    stats = StepStats()
    for ms in times:
        stats.record("mixed", float(ms), None, 10, 2, 0)
    hist = stats.stats()["step_hist"]["mixed_wall"]
    assert sum(hist.values()) == len(times)
    for q in (50, 90, 99):
        exact = float(np.percentile(times, q))
        got = hist_percentile(hist, q)
        assert exact <= got <= exact * 10 ** (1 / 20) * 1.01  # the bucket's upper edge: at most 12% above
    assert ms_bucket(0.0) == 0 and ms_bucket(1e9) == len(STEP_MS_EDGES)
    assert hist_percentile({}, 50) is None
    assert stats.stats()["prefill_tokens"] == 10 * len(times)


def make_spec(i: int, config, prompt_len: int) -> RequestSpec:
    p, d = config.patch_size, config.feat_dim
    return RequestSpec(f"r{i}", [(3 * i + k) % 50 + 1 for k in range(prompt_len)], [0] * prompt_len, (p, d),
                       SamplingParams(seed=i, max_length=4, min_length=4, timesteps=2))


def cpu_runner(loaded) -> Runner:
    return Runner(loaded, WorkerConfig(model="", device="cpu", dtype=None, max_num_seqs=4, max_num_batched_tokens=64,
                                       block_size=16, num_kv_blocks=64, gpu_memory_utilization=0.9,
                                       inference_timesteps=2))


def serve(loaded, warm: bool) -> tuple[list[torch.Tensor], list]:
    runner = cpu_runner(loaded)
    if warm:
        runner.warm_up()
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=runner.num_blocks, block_size=16,
                      patch_ms=loaded.config.patch_ms)
    reqs = [sched.add(make_spec(i, loaded.config, n)) for i, n in enumerate((20, 9))]
    timings = []
    while sched.has_work:
        seqs = sched.schedule()
        out = runner.step(seqs)
        timings.append(runner.last_step)
        sched.postprocess(seqs, out.patches, out.stops)
    return [p for r in reqs for p in r.generated], timings


@torch.inference_mode()
def test_warm_up_leaves_serving_unchanged_and_steps_report_their_kind(tiny_v2_dir):
    loaded = load_model(tiny_v2_dir)
    cold, timings = serve(loaded, warm=False)
    warm, _ = serve(loaded, warm=True)  # warm-up writes only the scratch KV block and VAE row
    assert len(cold) == len(warm) == 8
    for a, b in zip(cold, warm, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    first = timings[0]
    assert (first.kind, first.prefill_tokens, first.decode_rows, first.gpu_ms) == ("mixed", 29, 0, None)
    assert timings[-1].kind == "decode" and timings[-1].prefill_tokens == 0 and timings[-1].decode_rows >= 1


@torch.inference_mode()
def test_warm_up_primes_the_vae_with_every_continuation_tail_length(tiny_v2_dir):
    """A continuation primes its VAE row with the prompt's last 1-3 patches; on a GPU a length the warm-up never ran
    compiles Triton kernels inside a serving step (~1 s with every stream stalled: the 64-session gateway run's 1.35 s
    gap). The warm-up runs each length once."""
    from engine.prompt import CONTEXT_PATCHES

    loaded = load_model(tiny_v2_dir)
    runner = cpu_runner(loaded)
    frames = []
    decode = runner.vae.decode_stream
    runner.vae.decode_stream = lambda latents, state: frames.append(latents.shape[-1]) or decode(latents, state)
    runner.warm_up()
    p = loaded.config.patch_size
    assert {k * p for k in range(1, CONTEXT_PATCHES["voxcpm2"] + 1)} <= set(frames)


@torch.inference_mode()
def test_steps_report_how_they_ran_lora(tiny_v2_dir, caplog):
    """A step's `lora` (in the worker's DEBUG step line): merged with the adapter every row uses, bypassed when no
    row has one, else the LoRA kernels with each row's slot (at DEBUG), as decided at launch."""
    import logging

    from engine.model.lora import attach_lora, merge_into_weights

    caplog.set_level(logging.DEBUG, logger="engine.runner")

    loaded = load_model(tiny_v2_dir)
    plain = cpu_runner(loaded)
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=plain.num_blocks, block_size=16,
                      patch_ms=loaded.config.patch_ms)
    for i, n in enumerate((20, 9)):
        sched.add(make_spec(i, loaded.config, n))
    seqs = sched.schedule()
    plain.collect(plain.launch(seqs))
    assert plain.last_step.lora == ""
    attach_lora(loaded.model, num_adapters=2, max_rank=4)
    merge_into_weights(loaded.model.lora, loaded.model)
    runner = cpu_runner(loaded)
    reported = []
    for slots, adapter in (((1, 2), 0), ((0, 0), 0), ((1, 1), 1)):
        for seq, slot in zip(seqs, slots, strict=True):
            seq.request.lora_slot = slot
        runner.collect(runner.launch(seqs, adapter=adapter))
        reported.append(runner.last_step.lora)
    for seq in seqs:
        seq.request.lora_slot = 0
    loaded.model.lora.merged.use(0)
    assert reported == ["kernels 1,2", "bypass", "merged 1"]
