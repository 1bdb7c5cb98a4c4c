"""After the runner's warm-up no serving step compiles a Triton kernel: a burst of prompts of every length class,
mixed with decodes, leaves the compile count flat (each new specialization would stall a step for 100s of ms)."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_model
from engine.request import RequestSpec, SamplingParams
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
            k = min(i % 3 + 1, n - 1) if i % 5 else 0  # the prompt ends with k patches of audio, its VAE context
            ids, mask = [j % 50 + 1 for j in range(n - k)] + [0] * k, [0] * (n - k) + [1] * k
            sched.add(RequestSpec(f"r{i}", ids, mask, (p, d),
                                  SamplingParams(seed=i, max_length=6, min_length=6, timesteps=3 if i % 4 == 3 else 4),
                                  audio=[(n - k, torch.randn(k, p, d).numpy())] if k else [], n_context=k))
        while sched.has_work:
            seqs = sched.schedule()
            out = runner.step(seqs)
            kinds.add(runner.last_step.kind)
            sched.postprocess(seqs, out.patches, out.stops)
    assert {"mixed", "graph"} <= kinds
    assert triton_compiles() == after_warm_up, "a serving step compiled a Triton kernel"
