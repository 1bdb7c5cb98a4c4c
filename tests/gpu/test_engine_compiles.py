"""After the runner's warm-up no serving step compiles a Triton kernel: a burst of prompts of every length class,
mixed with decodes, leaves the compile count flat (each new specialization would stall a step for 100s of ms)."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_model
from engine.request import RequestSpec, SamplingParams, zero_patches
from engine.runner import Runner, triton_compiles
from engine.scheduler import Scheduler
from engine.worker import WorkerConfig

gpu = pytest.mark.gpu


@gpu
@torch.inference_mode()
def test_no_triton_compiles_after_warm_up(voxcpm2_dir, cuda):
    loaded = load_model(voxcpm2_dir, cuda)
    cfg = WorkerConfig(model="", device=cuda, dtype=None, max_num_seqs=16, max_num_batched_tokens=256,
                       block_size=16, num_kv_blocks=1024, gpu_memory_utilization=0.9, inference_timesteps=4)
    runner = Runner(loaded, cfg)  # warms up on CUDA
    after_warm_up = triton_compiles()
    assert after_warm_up > 0
    sched = Scheduler(max_num_seqs=16, max_num_batched_tokens=256, num_blocks=runner.num_blocks, block_size=16,
                      patch_ms=loaded.config.patch_ms)
    p, d = loaded.config.patch_size, loaded.config.feat_dim
    kinds = set()
    # prompts of every length class, some at other timesteps (they ride in the same graphs on their own schedules),
    # some continuations (their VAE rows primed with 1..3 prompt patches, several in one batched priming)
    for wave in (range(0, 16, 2), range(1, 16, 2)):
        for i in wave:
            n = (1, 2, 15, 16, 17, 31, 32, 33, 64, 100, 114, 130, 200, 257, 300, 7)[i]
            context = torch.randn(i % 3 + 1, p, d).numpy() if i % 5 else None
            sched.add(RequestSpec(f"r{i}", [k % 50 + 1 for k in range(n)], zero_patches((n, p, d)), [0] * n,
                                  zero_patches((p, d)), context,
                                  SamplingParams(seed=i, max_length=6, min_length=6, timesteps=3 if i % 4 == 3 else 4)))
        while sched.has_work:
            seqs = sched.schedule()
            out = runner.step(seqs)
            kinds.add(runner.last_step.kind)
            sched.postprocess(seqs, out.patches, out.stops)
    assert {"mixed", "graph"} <= kinds
    assert triton_compiles() == after_warm_up, "a serving step compiled a Triton kernel"
