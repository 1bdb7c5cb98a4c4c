"""Micro-benchmark of the Triton kernels on one GPU (VoxCPM2 shapes); prints JSON, then a table.

Attention: a burst's prefill (64 prompts of 114 positions) at a few query tiles; one decode step's worth of paged
attention (28 base-LM + 8 residual-LM layers, each with its own cache layer) for batches 1/8/64/256 at contexts
128/512, captured in a CUDA graph per backend and timed by replay: TritonAttention (auto KV splits, and a few fixed
settings), TorchAttention (the reference), and SDPA over contiguous K/V (no paging, a roofline-ish reference).
GB/s counts the cached K/V bytes each layer must read.
Fused kernels vs their eager torch chains: Snake over the AudioVAE decoder's largest activations (fp32, like the
VAE weights), RMSNorm on LM and LocDiT rows, the CFG-Zero* combine + Euler update at 1 and 256 streams.
RoPE fusions vs the launches they replace, per layer: the LocDiT's short attention rotating q and k itself vs rope_
then short_attention (1 and 256 streams, CFG doubles the rows); the LMs' RoPE + K/V store kernel vs rope_ then
store_kv's two index_copy_ (and, without RoPE as the residual LM, vs store_kv alone), at 1 and 256 decode tokens.
AudioVAE: one streaming patch decode (VoxCPM2 decoder, random weights, 4 latent frames -> 7,680 samples) at
batch 1/64/256 in fp32 and bf16, the residual units eager (cuDNN convs, Triton snake) vs fused
(engine.model.vae_triton); TF32 is on for both (set in main; cuDNN has it on by default anyway).

Run from the repo root: `.venv/bin/python -m bench.kernels_bench [--out results.json]` (under 2 minutes on an H200).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from engine.config import ModelConfig
from engine.kernels import cfg_zero_euler_, rms_norm, rope_, snake
from engine.model import audio_vae
from engine.model.attention import AttentionMetadata, TorchAttention, store_kv
from engine.model.attention_triton import TritonAttention, rope_store_kv_, short_attention
from engine.model_configs import voxcpm2

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 28 + 8, 16, 2, 128, 16
BATCHES, CONTEXTS = (1, 8, 64, 256), (128, 512)
DTYPE = torch.bfloat16


def time_ms(fn: Callable[[], object]) -> tuple[float, str]:
    """Median ms of fn replayed from a CUDA graph (eager if it cannot be captured)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return do_bench(graph.replay, warmup=10, rep=50, return_mode="median"), "graph"
    except Exception as error:  # report and fall back: the numbers are still useful
        print(f"capture failed ({type(error).__name__}: {error}); timing eagerly")
        torch.cuda.synchronize()
        return do_bench(fn, warmup=10, rep=50, return_mode="median"), "eager"


def bandwidth_ceiling_gbs() -> float:
    """Achieved device-to-device copy bandwidth (bytes read + written)."""
    src = torch.empty(512 * 2**20, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    return 2 * src.numel() / ms / 1e6


def attention_rows(batch: int, context: int) -> list[dict]:
    """Every backend on one decode batch: `batch` sequences of `context` keys (the last one written this step)."""
    gen = torch.Generator("cuda").manual_seed(batch * context)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda", dtype=DTYPE)
    q, k, v = randn(batch, Q_HEADS, HEAD_DIM), randn(batch, KV_HEADS, HEAD_DIM), randn(batch, KV_HEADS, HEAD_DIM)
    tables, num_blocks = shuffled_tables(gen, batch, context)
    meta = AttentionMetadata.build([1] * batch, [context - 1] * batch, tables, PAGE, "cuda")
    timed = paged_times(q, k, v, meta, randn(LAYERS, num_blocks, PAGE, KV_HEADS, HEAD_DIM),
                        randn(LAYERS, num_blocks, PAGE, KV_HEADS, HEAD_DIM))
    timed.append(("sdpa contiguous", *contiguous_time(q, randn(LAYERS, batch, KV_HEADS, context, HEAD_DIM),
                                                      randn(LAYERS, batch, KV_HEADS, context, HEAD_DIM))))
    torch.cuda.empty_cache()
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * q.element_size()
    splits = TritonAttention().splits_for(batch, KV_HEADS, meta, torch.device("cuda"))
    return [{"kernel": "attention decode", "backend": name, "batch": batch, "context": context, "mode": mode,
             "auto_splits": splits, "step_ms": ms, "layer_us": 1e3 * ms / LAYERS,
             "gbs": kv_bytes / (ms / LAYERS) / 1e6} for name, ms, mode in timed]


def shuffled_tables(gen: torch.Generator, seqs: int, positions: int) -> tuple[list[list[int]], int]:
    """Block tables of `seqs` sequences of `positions` each, over a pool's blocks in shuffled order; (tables, the
    pool's block count: one spare)."""
    per_seq = math.ceil(positions / PAGE)
    num_blocks = seqs * per_seq + 1
    order = torch.randperm(num_blocks, generator=gen, device="cuda")
    return order[:seqs * per_seq].view(seqs, per_seq).tolist(), num_blocks


def paged_times(q, k, v, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                backends: dict | None = None) -> list[tuple]:
    """(name, ms, mode) of each backend over every layer's cache (default: the decode settings compared)."""
    backends = backends or {
        "triton": TritonAttention(),
        "triton splits=1": TritonAttention(num_splits=1),
        "triton block_n=32": TritonAttention(block_n=32),
        "triton block_n=128": TritonAttention(block_n=128),
        "torch": TorchAttention(),
    }
    timed = []
    for name, backend in backends.items():
        step = lambda backend=backend: [backend(q, k, v, k_cache[i], v_cache[i], meta) for i in range(LAYERS)]
        try:  # a tile too large for the SM's registers or shared memory fails to compile: report, go on
            timed.append((name, *time_ms(step)))
        except Exception as error:
            print(f"{name}: {type(error).__name__}: {str(error)[:200]}")
            timed.append((name, float("nan"), "failed"))
    return timed


def prefill_attention_rows(seqs: int = 64, tokens: int = 114) -> list[dict]:
    """A burst's prefill: `seqs` prompts of `tokens` positions each, no cache before them, through every LM layer
    (own cache layer each): TritonAttention at a few query tiles (rows_per_program: query heads x tokens per
    program; each program reads its keys once, so larger tiles read the cache fewer times) and dense causal SDPA
    over padded contiguous K/V as a reference. Each call also stores the layer's K/V (`rope_and_store_kv`)."""
    gen = torch.Generator("cuda").manual_seed(tokens)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda", dtype=DTYPE)
    n = seqs * tokens
    q, k, v = randn(n, Q_HEADS, HEAD_DIM), randn(n, KV_HEADS, HEAD_DIM), randn(n, KV_HEADS, HEAD_DIM)
    tables, num_blocks = shuffled_tables(gen, seqs, tokens)
    meta = AttentionMetadata.build([tokens] * seqs, [0] * seqs, tables, PAGE, "cuda")
    k_cache, v_cache = (torch.zeros(LAYERS, num_blocks, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
                        for _ in "kv")
    timed = paged_times(q, k, v, meta, k_cache, v_cache, {
        f"triton rows={rows} block_n={block_n}": TritonAttention(block_n=block_n, rows_per_program=rows)
        for rows, block_n in ((64, 64), (128, 64), (128, 128), (256, 64), (32, 64))})
    q4 = q.view(seqs, tokens, Q_HEADS, HEAD_DIM).transpose(1, 2)
    k4, v4 = (t.view(seqs, tokens, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous() for t in (k, v))
    timed.append(("sdpa causal contiguous", *time_ms(lambda: [
        F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True) for _ in range(LAYERS)])))
    torch.cuda.empty_cache()
    return [{"kernel": "attention prefill", "backend": name, "batch": seqs, "context": tokens, "mode": mode,
             "auto_splits": 1, "step_ms": ms, "layer_us": 1e3 * ms / LAYERS, "gbs": 0.0} for name, ms, mode in timed]


def contiguous_time(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[float, str]:
    q4 = q[:, :, None]  # [B, Hq, 1, D]
    return time_ms(lambda: [F.scaled_dot_product_attention(q4, keys[i], values[i], enable_gqa=True)
                            for i in range(LAYERS)])


def snake_rows(shape: tuple[int, int, int]) -> list[dict]:
    x = torch.randn(*shape, device="cuda") * 3
    alpha = torch.rand(1, shape[1], 1, device="cuda") + 0.05
    eager = lambda: x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)  # audio_vae.Snake on CPU
    return fused_vs_eager("snake", list(shape), lambda: snake(x, alpha), eager, 2 * x.numel() * x.element_size())


def rms_norm_rows(rows: int, dim: int) -> list[dict]:
    x = torch.randn(rows, dim, device="cuda", dtype=DTYPE)
    weight = torch.rand(dim, device="cuda", dtype=DTYPE) + 0.5

    def eager() -> torch.Tensor:  # engine.model.layers.RMSNorm.forward
        variance = x.float().pow(2).mean(dim=-1, keepdim=True)
        return (x * torch.rsqrt(variance + 1e-5)).to(x.dtype) * weight

    return fused_vs_eager("rms_norm", [rows, dim], lambda: rms_norm(x, weight, 1e-5), eager, 2 * x.numel() * 2)


def cfg_rows(batch: int) -> list[dict]:
    x, v = torch.randn(batch, 4, 64, device="cuda"), torch.randn(2 * batch, 4, 64, device="cuda", dtype=DTYPE)
    w = torch.full((batch,), 2.0, device="cuda")

    def eager() -> torch.Tensor:  # engine.model.local.CFM.solve, one Euler step after the LocDiT
        vf = v.float()
        v_cond, v_uncond = vf[:batch], vf[batch:]
        scale = (v_cond * v_uncond).sum((1, 2), keepdim=True) / (v_uncond.pow(2).sum((1, 2), keepdim=True) + 1e-8)
        return x - 0.1 * (v_uncond * scale + w.view(batch, 1, 1) * (v_cond - v_uncond * scale))

    return fused_vs_eager("cfg_zero_euler", [batch, 4, 64], lambda: cfg_zero_euler_(x, v, w, 0.1), eager,
                          v.numel() * 2 + 2 * x.numel() * 4)


def rotation(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half cos/sin [N, HEAD_DIM] of a pure rotation (no LongRoPE scale): replays that rotate the same q|k
    in place keep its magnitude."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM)
    emb = (positions.float()[:, None] * inv_freq).repeat(1, 2)
    return emb.cos(), emb.sin()


def rope_attention_rows(streams: int, length: int = 11) -> list[dict]:
    """One LocDiT layer's attention (2 x streams rows of `length` tokens, the q|k|v views of one qkv output)."""
    qkv = torch.randn(2 * streams, length, Q_HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    q, k, v = qkv[:, :, :Q_HEADS], qkv[:, :, Q_HEADS:Q_HEADS + KV_HEADS], qkv[:, :, Q_HEADS + KV_HEADS:]
    rope = rotation(torch.arange(length, device="cuda"))

    def unfused() -> torch.Tensor:
        rope_(qkv[:, :, :Q_HEADS + KV_HEADS], *rope)
        return short_attention(q, k, v)

    return fused_vs_eager("rope+short_attention", list(qkv.shape), lambda: short_attention(q, k, v, rope), unfused,
                          2 * qkv.numel() * qkv.element_size())


def rope_store_rows(tokens: int, rope: bool) -> list[dict]:
    """One LM layer's RoPE and K/V store for `tokens` decode tokens (one per sequence, scattered pages)."""
    qkv = torch.randn(tokens, Q_HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    q, k, v = qkv[:, :Q_HEADS], qkv[:, Q_HEADS:Q_HEADS + KV_HEADS], qkv[:, Q_HEADS + KV_HEADS:]
    k_cache, v_cache = (torch.zeros(tokens * 4, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in "kv")
    tables = torch.randperm(tokens * 4, device="cuda").view(tokens, 4).tolist()
    meta = AttentionMetadata.build([1] * tokens, [37] * tokens, tables, PAGE, "cuda")
    table = rotation(meta.positions()) if rope else None

    def unfused() -> None:
        if table is not None:
            rope_(qkv[:, :Q_HEADS + KV_HEADS], *table)
        store_kv(k, v, k_cache, v_cache, meta)

    name = "rope+store_kv" if rope else "store_kv (no rope)"
    moved = (2 * (q.numel() + k.numel()) if rope else 0) + 2 * (k.numel() + v.numel())
    return fused_vs_eager(name, list(qkv.shape), lambda: rope_store_kv_(q, k, v, k_cache, v_cache, meta.slot_mapping,
                                                                         table), unfused, moved * qkv.element_size())


def vae_rows(batches: tuple[int, ...]) -> list[dict]:
    """One streaming patch through the VoxCPM2 AudioVAE decoder per batch and dtype, residual units eager vs fused."""
    torch.manual_seed(0)
    config = ModelConfig.from_dict(voxcpm2())
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        vae = audio_vae.AudioVAE(config.audio_vae).to("cuda", dtype).eval()
        for batch in batches:
            latents = torch.randn(batch, vae.latent_dim, config.patch_size, device="cuda", dtype=dtype)
            for name, fused in (("eager", False), ("fused", True)):
                state = vae.stream_state(batch)
                ms, mode = time_ms(lambda vae=vae, latents=latents, state=state, fused=fused:
                                   vae_patch(vae, latents, state, fused))
                rows.append({"kernel": "vae decode patch", "backend": name, "batch": batch,
                             "dtype": str(dtype).removeprefix("torch."), "mode": mode, "ms": ms})
            torch.cuda.empty_cache()
    return rows


def vae_patch(vae: audio_vae.AudioVAE, latents: torch.Tensor, state: audio_vae.StreamState,
              fused: bool) -> torch.Tensor:
    previous = audio_vae.FUSED_DECODER
    audio_vae.FUSED_DECODER = fused  # read while the graph is captured: each graph keeps its path
    try:
        return vae.decode_stream(latents, state)
    finally:
        audio_vae.FUSED_DECODER = previous


def fused_vs_eager(kernel: str, shape: list[int], fused: Callable[[], object], eager: Callable[[], object],
                   moved: int) -> list[dict]:
    """Each timed from a CUDA graph, as the engine runs them (the eager chains are launch-bound at small sizes)."""
    rows = []
    for name, fn in (("fused", fused), ("eager", eager)):
        ms, mode = time_ms(fn)
        rows.append({"kernel": kernel, "backend": name, "shape": shape, "mode": mode, "us": 1e3 * ms,
                     "gbs": moved / ms / 1e6})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--only-prefill", action="store_true", help="only the prefill attention rows (seconds)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    ceiling = bandwidth_ceiling_gbs()
    rows = prefill_attention_rows()
    if args.only_prefill:
        for r in rows:
            print(f"{r['backend']:<32}{r['mode']:>7}{r['layer_us']:>10.1f} us/layer{r['step_ms']:>9.3f} ms")
        if args.out:
            sys.path.insert(0, str(Path(__file__).parent))  # run as a script or as -m bench.kernels_bench
            from gateway_proc import git_commit

            with open(args.out, "w") as f:
                json.dump({"command": " ".join(sys.argv), "git_commit": git_commit(), "date":
                           datetime.now(UTC).isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
                           "rows": rows}, f)
        return
    rows += [row for b in BATCHES for c in CONTEXTS for row in attention_rows(b, c)]
    # VoxCPM2 decoder: 2048 channels at the latent rate down to 32 at 48 kHz; 4 latent frames per patch.
    for shape in ((256, 32, 7680), (256, 64, 3840), (256, 1024, 32), (1, 64, 3840)):
        rows += snake_rows(shape)
    # RMSNorm: LM rows at 256 streams (hidden 2048) and LocDiT rows (2 x 256 streams x 11 tokens, hidden 1024).
    rows += rms_norm_rows(256, 2048) + rms_norm_rows(2 * 256 * 11, 1024) + cfg_rows(256) + cfg_rows(1)
    # RoPE fused into attention ("eager" rows: the launches it replaces, each a Triton kernel or index_copy_)
    rows += rope_attention_rows(1) + rope_attention_rows(256)
    rows += [row for tokens in (1, 256) for rope in (True, False) for row in rope_store_rows(tokens, rope)]
    rows += vae_rows((1, 64, 256))
    report = {"device": torch.cuda.get_device_name(), "copy_gbs": ceiling, "rows": rows}
    text = json.dumps(report)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)

    print(f"\n{report['device']}: device copy {ceiling:.0f} GB/s (datasheet ~4800; target ~4300)")
    print(f"{'attention decode':<20}{'B':>5}{'ctx':>6}{'splits':>7}{'mode':>7}{'us/layer':>10}{'step ms':>9}"
          f"{'GB/s':>8}{'% copy':>8}")
    for r in rows:
        if r["kernel"] in ("attention decode", "attention prefill"):
            print(f"{r['backend']:<20}{r['batch']:>5}{r['context']:>6}{r['auto_splits']:>7}{r['mode']:>7}"
                  f"{r['layer_us']:>10.1f}{r['step_ms']:>9.3f}{r['gbs']:>8.0f}{100 * r['gbs'] / ceiling:>8.1f}")
    print(f"{'fused kernel':<30}{'shape':>20}{'mode':>7}{'us':>10}{'GB/s':>8}")
    for r in rows:
        if r["kernel"] not in ("attention decode", "attention prefill", "vae decode patch"):
            print(f"{r['kernel'] + ' ' + r['backend']:<30}{str(tuple(r['shape'])):>20}{r['mode']:>7}{r['us']:>10.1f}"
                  f"{r['gbs']:>8.0f}")

    print(f"{'vae decode patch':<18}{'dtype':>9}{'B':>5}{'mode':>7}{'eager ms':>10}{'fused ms':>10}{'speedup':>9}")
    vae = {(r["dtype"], r["batch"], r["backend"]): r for r in rows if r["kernel"] == "vae decode patch"}
    for (dtype, batch, backend), r in vae.items():
        if backend == "fused":
            eager = vae[(dtype, batch, "eager")]["ms"]
            print(f"{'':<18}{dtype:>9}{batch:>5}{r['mode']:>7}{eager:>10.2f}{r['ms']:>10.2f}{eager / r['ms']:>8.2f}x")


if __name__ == "__main__":
    main()
