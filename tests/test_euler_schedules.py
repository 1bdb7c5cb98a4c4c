"""Per-row Euler schedules (engine.model.euler) on the tiny VoxCPM2: rows at different timesteps and cfg in one
solve equal each row solved alone, and the solve's work does not depend on the rows' settings."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.checkpoint import load_model
from engine.model.euler import EulerSchedules, RowSteps, euler_schedule, evaluations, zero_velocity_steps
from engine.request import RequestSpec, SamplingParams
from engine.runner import Runner
from engine.scheduler import Scheduler
from engine.worker import WorkerConfig

SERVED = 6  # timesteps 1..6 served: 5 evaluations per solve


@pytest.fixture(scope="module")
def loaded(tiny_v2_dir):
    return load_model(tiny_v2_dir)


@pytest.fixture(scope="module")
def model(loaded):
    return loaded.model


def test_each_served_value_is_its_official_schedule_then_steps_of_zero():
    schedules = EulerSchedules(range(1, SERVED + 1), mean_mode=False)
    assert schedules.width == evaluations(SERVED) == 5
    seen: list[int] = []
    for n in range(1, SERVED + 1):
        index, dt = schedules.row(n)
        own = euler_schedule(n)[zero_velocity_steps(n):]
        assert dt[:len(own)].tolist() == pytest.approx([d for _, d in own], abs=0)  # the official fp32 steps
        assert not dt[len(own):].any()  # the rest leave x as it is
        seen += index[:len(own)].tolist()
    assert sorted(seen) == list(range(len(seen)))  # every evaluation has its own table row
    with pytest.raises(KeyError):
        schedules.row(SERVED + 1)


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def test_rows_at_their_own_settings_equal_each_row_alone_and_cost_the_batch_nothing(model):
    config = model.config
    timesteps = [4, 1, 6, 2, 4, 5]
    cfg = torch.tensor([2.0, 1.0, 0.0, 3.0, 1.0, 2.5])
    b, p, d = len(timesteps), config.patch_size, config.feat_dim
    gen = torch.Generator().manual_seed(3)
    lm_h, res_h = torch.randn(b, config.lm.hidden_size, generator=gen), torch.randn(b, config.lm.hidden_size,
                                                                                     generator=gen)
    cond, noise = torch.randn(b, p, d, generator=gen), torch.randn(b, d, p, generator=gen)
    schedules = model.feat_decoder.schedules(range(1, SERVED + 1))
    table = schedules.table(model.feat_decoder.estimator, torch.device("cpu"))
    rows = [schedules.row(n) for n in timesteps]
    steps = RowSteps(table, torch.from_numpy(np.stack([r[0] for r in rows])),
                     torch.from_numpy(np.stack([r[1] for r in rows])))

    model.sample_patches(lm_h, res_h, cond, noise, steps, cfg)  # lazy tables (RoPE) out of the counts below
    with OpCount() as mixed:
        together = model.sample_patches(lm_h, res_h, cond, noise, steps, cfg)
    for j, n in enumerate(timesteps):
        alone = model.sample_patches(lm_h[j:j + 1], res_h[j:j + 1], cond[j:j + 1], noise[j:j + 1], n, cfg[j:j + 1])
        torch.testing.assert_close(together[j:j + 1], alone, rtol=1e-4, atol=1e-5)  # fp32 GEMMs of other sizes
    assert not torch.equal(together[1], together[4])  # timesteps 1 (the noise itself) and 4 really differ

    index, dt = schedules.row(4)
    uniform = RowSteps(table, torch.from_numpy(np.stack([index] * b)), torch.from_numpy(np.stack([dt] * b)))
    default_cfg = torch.full((b,), 2.0)
    with OpCount() as plain:
        model.sample_patches(lm_h, res_h, cond, noise, uniform, default_cfg)
    assert mixed.ops == plain.ops  # the same kernels whatever the rows ask: batch-mates pay nothing


# (timesteps, cfg) of each request: below, at and above the default 3 (served up to 5), cfg 0 to 3
SETTINGS = [(3, 2.0), (5, 1.0), (1, 0.0), (4, 3.0), (2, 1.0), (5, 2.0)]


def serve_settings(loaded, eager: bool) -> tuple[list[torch.Tensor], list[int]]:
    """Every request of SETTINGS through real scheduling: the graph-shaped step bodies, padded to CUDA-like buckets
    (padding rows in the step and in its tail), or (`eager`) the eager reference that solves each timesteps group
    on its own. Returns each request's patches and the tail's row buckets, step by step."""
    cfg = WorkerConfig(model="", device="cpu", dtype=None, max_num_seqs=8, max_num_batched_tokens=80, block_size=16,
                       num_kv_blocks=64, gpu_memory_utilization=0.9, inference_timesteps=3, max_timesteps=5)
    runner = Runner(loaded, cfg)
    runner.buckets = [4, 8]  # CPU runs the exact batch by default; force the CUDA bucketing
    assert runner.tail is not None and runner.graph_evals == evaluations(3) < runner.schedules.width
    tails: list[int] = []
    body = runner.tail.body
    runner.tail.body = lambda k: tails.append(k) or body(k)
    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=80, num_blocks=runner.num_blocks, block_size=16,
                      patch_ms=loaded.config.patch_ms)
    p, d = loaded.config.patch_size, loaded.config.feat_dim
    reqs = [sched.add(RequestSpec(f"r{i}", [(7 * i + k) % 50 + 1 for k in range(9 + i)], [0] * (9 + i), (p, d),
                                  SamplingParams(seed=i, max_length=4, min_length=4, timesteps=t, cfg_value=c)))
            for i, (t, c) in enumerate(SETTINGS)]
    step = runner._eager_step if eager else runner.step
    while sched.has_work:
        out = step(seqs := sched.schedule())
        sched.postprocess(seqs, out.patches, out.stops)
    return [torch.stack(r.generated) for r in reqs], tails


@torch.inference_mode()
def test_graph_shaped_steps_at_mixed_settings_equal_the_per_group_eager_steps(loaded):
    """The bodies the CUDA graphs capture, on CPU: rows at five timesteps and four cfg values share every step, the
    two at 5 (above the default) finish in the tail, padded to its bucket; each request equals the eager reference."""
    shaped, tails = serve_settings(loaded, eager=False)
    reference, _ = serve_settings(loaded, eager=True)
    assert tails and set(tails) == {4}  # the rows at 5 timesteps, padded to the smallest bucket
    for ours, ref in zip(shaped, reference, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
