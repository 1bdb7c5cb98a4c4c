"""Small mixed steps replay an LM graph over padded flat buffers (engine.cuda_graphs.FlatBuffers): the same step
body runs eagerly on CPU here, so the padding (one extra sequence in the scratch KV block, empty sequences after it)
is checked against the unpadded eager path, step by step, through real scheduling."""

from __future__ import annotations

import torch

from engine.checkpoint import load_model
from engine.cuda_graphs import (
    eager_flat_key,
    eager_flat_token_buckets,
    large_lm_graph_key,
    large_lm_graph_keys,
    lm_graph_key,
    lm_graph_keys,
)
from engine.request import RequestSpec, SamplingParams
from engine.runner import Runner
from engine.scheduler import Scheduler
from engine.worker import WorkerConfig


def test_lm_graph_buckets_fit_the_batch_plus_a_padding_sequence():
    keys = lm_graph_keys(max_num_seqs=8)
    assert keys == sorted(keys) and all(s <= min(t, 9) for t, s in keys) and (64, 9) in keys
    assert lm_graph_key(111, 1, keys) == (128, 2)
    assert lm_graph_key(64, 2, keys) == (64, 4)  # exactly full: the padding sequence is empty
    assert lm_graph_key(130, 7, keys) == (256, 8)
    assert lm_graph_key(130, 8, keys) == (256, 9)
    assert lm_graph_key(600, 1, keys) == (1024, 2) and lm_graph_key(2048, 3, keys) == (2048, 4)
    assert lm_graph_key(2049, 1, keys) is None and lm_graph_key(10, 9, keys) is None


def test_eager_flat_batches_round_to_recurring_shapes():
    assert eager_flat_key(1, 0) == (256, 16) and eager_flat_key(256, 15) == (256, 16)
    assert eager_flat_key(2000, 255) == (2048, 256) and eager_flat_key(2049, 3) == (2304, 16)
    assert eager_flat_key(5000, 100) == (5120, 112) and eager_flat_key(20000, 1) == (20480, 16)
    for tokens in (1, 300, 2047, 4097, 9000, 31000):  # at most 1/8 (or one 256 step) of padding
        t = eager_flat_key(tokens, 0)[0]
        assert tokens <= t <= max(tokens * 9 / 8, tokens + 255) and t in eager_flat_token_buckets(32768)
    buckets = eager_flat_token_buckets(32768)
    assert buckets == sorted(set(buckets)) and buckets[-1] == 32768 and len(buckets) == 40


def test_large_lm_graphs_follow_the_eager_buckets_and_the_audio_rows():
    keys = large_lm_graph_keys(32768, 528, 512)
    tokens = sorted({k[0] for k in keys})
    assert tokens[0] == 256 and tokens[-1] == 8192 and len(keys) == 2 * len(tokens) == 48
    assert all(s == 528 and a in (0, 512) for _, s, a in keys)
    assert large_lm_graph_keys(4096, 16, 64)[-1] == (4096, 16, 64)
    keys = lm_graph_keys(512) + keys
    assert large_lm_graph_key(7104, 64, 0, keys) == (7168, 528, 0)  # a c=64 burst: LocEnc on no row
    assert large_lm_graph_key(2049, 400, 384, keys) == (2304, 528, 512)  # prompts joining 384 speaking streams
    # a busy gateway's mixed step: 250 decode rows, 10 later segments' prompts (12 audio positions each), 800 in all
    assert large_lm_graph_key(1050, 260, 370, keys) == (1280, 528, 512)
    assert large_lm_graph_key(64, 64, 64, keys) == (256, 528, 512)  # 64 decode rows: past the small graphs' 64
    assert lm_graph_key(64, 64, keys) is None
    assert large_lm_graph_key(7104, 64, 513, keys) is None  # more audio rows than a graph lists: eager
    assert large_lm_graph_key(8193, 1, 0, keys) is None and large_lm_graph_key(3000, 528, 0, keys) is None


def serve(loaded, flat: bool, eager_only: bool = False, large: bool = False) -> tuple[list[torch.Tensor], list]:
    """`flat`: through the padded flat buffers (graph buckets and, past them, eager buckets); `eager_only`: eager
    buckets alone (as on CUDA past the LM graphs); `large`: large LM graph buckets (small ones here) alone, LocEnc
    on their listed audio rows. Returns the patches and the bucket of each step staged into the flat buffers."""
    cfg = WorkerConfig(model="", device="cpu", dtype=None, max_num_seqs=6, max_num_batched_tokens=80, block_size=16,
                       num_kv_blocks=64, gpu_memory_utilization=0.9, inference_timesteps=2)
    runner = Runner(loaded, cfg)
    if flat:
        eager = eager_flat_key(cfg.max_num_batched_tokens, cfg.max_num_seqs)
        keys = [] if eager_only else [k for k in lm_graph_keys(cfg.max_num_seqs) if k[0] <= 64]
        if large:
            keys = [(t, eager[1], a) for t in (16, 32, 48) for a in (0, 8)]
        runner.host.allocate_flat(keys, eager)
    staged = []
    stage = runner.host.stage_flat

    def counting(seqs, fed=()):
        key = stage(seqs, fed)
        if key is not None:
            staged.append(key)
        return key

    runner.host.stage_flat = counting
    sched = Scheduler(max_num_seqs=6, max_num_batched_tokens=80, num_blocks=runner.num_blocks, block_size=16,
                      patch_ms=loaded.config.patch_ms)
    p, d = loaded.config.patch_size, loaded.config.feat_dim
    reqs = []
    for i, n in enumerate((37, 5, 70, 16, 3)):  # a chunked prompt, prompts that join running streams
        reqs.append(sched.add(RequestSpec(f"r{i}", [(5 * i + k) % 50 + 1 for k in range(n)], [0] * n, (p, d),
                                          SamplingParams(seed=i, max_length=5, min_length=5, timesteps=2))))
        out = runner.step(seqs := sched.schedule())
        sched.postprocess(seqs, out.patches, out.stops)
    while sched.has_work:
        out = runner.step(seqs := sched.schedule())
        sched.postprocess(seqs, out.patches, out.stops)
    return [p for r in reqs for p in r.generated], staged


@torch.inference_mode()
def test_padded_flat_lm_batches_serve_the_same_audio_as_eager_steps(tiny_v2_dir):
    loaded = load_model(tiny_v2_dir)
    eager, _ = serve(loaded, flat=False)
    # graph buckets up to 64 positions, eager buckets past them; eager ones alone; large graph buckets (LocEnc on
    # none or on the listed audio rows) with eager ones past them
    for eager_only, large in ((False, False), (True, False), (False, True)):
        padded, staged = serve(loaded, flat=True, eager_only=eager_only, large=large)
        assert len(staged) >= 4  # every prefill step went through the padded buffers
        if large:  # prompts alone, prompts beside speaking streams (decode rows are audio rows), and past them
            assert {k[2] for k in staged if len(k) == 3} == {0, 8} and any(len(k) == 2 for k in staged)
        assert len(eager) == len(padded) == 25
        for a, b in zip(eager, padded, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
