"""Decode steps as whole-step CUDA graphs, one per batch bucket.

A decode-only step (one position per sequence, all at the default timesteps) always runs the same kernels: both
LMs over B tokens, every CFG Euler step of the LocDiT, the stop head, and the streaming VAE on the B streams' rows.
Replaying it as one graph removes ~1000+ kernel launches per step. Every input lives in a static device buffer
(`DecodeBuffers`), filled from a pinned host mirror by asynchronous copies; a bucket of B' >= B rows runs the B real
sequences plus padding rows that write only to a scratch KV block and a scratch VAE row, so they are harmless.

The graphs never need recapture as sequences grow: the attention grid is sized by a fixed bound (the model's
maximum positions) and the kernel loops only over each sequence's real length, read from the buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def buckets_for(max_num_seqs: int) -> list[int]:
    """Bucket sizes up to max_num_seqs, which is always the largest one."""
    return [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket holding n rows."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} sequences exceed the largest bucket ({buckets[-1]})")


@dataclass
class DecodeBuffers:
    """Inputs of a decode step for up to M sequences; row i is sequence i, rows past the batch are padding."""

    patches: Tensor  # [M, P, D] f32: each sequence's previous patch (the LM input and the DiT condition)
    noise: Tensor  # [M, D, P] f32
    cfg: Tensor  # [M] f32
    positions: Tensor  # [M] i64: the position fed (= KV length before the step)
    slots: Tensor  # [M] i64: its paged-cache slot
    seq_lens: Tensor  # [M] i32: KV length after the step
    block_tables: Tensor  # [M, W] i32
    vae_slots: Tensor  # [M] i64: the stream's row of the VAE state

    @classmethod
    def allocate(cls, rows: int, patch_size: int, feat_dim: int, table_width: int, device: torch.device,
                 pin: bool = False) -> DecodeBuffers:
        def empty(*shape: int, dtype: torch.dtype) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

        return cls(empty(rows, patch_size, feat_dim, dtype=torch.float32),
                   empty(rows, feat_dim, patch_size, dtype=torch.float32), empty(rows, dtype=torch.float32),
                   empty(rows, dtype=torch.int64), empty(rows, dtype=torch.int64), empty(rows, dtype=torch.int32),
                   empty(rows, table_width, dtype=torch.int32), empty(rows, dtype=torch.int64))

    def tensors(self) -> list[Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def copy_rows_(self, src: DecodeBuffers, rows: int) -> None:
        """The first `rows` rows of every buffer from `src` (asynchronous when src is pinned)."""
        for dst, s in zip(self.tensors(), src.tensors(), strict=True):
            dst[:rows].copy_(s[:rows], non_blocking=True)


@dataclass
class DecodeResult:
    patches: Tensor  # [B, P, D] f32
    stops: Tensor  # [B] bool
    audio: Tensor  # [B, samples] f32


Body = Callable[[int], DecodeResult]  # rows -> outputs of the first `rows` rows of the static buffers


class DecodeGraphs:
    """One captured graph of `body` per bucket over the same static buffers. Every graph set of a runner shares
    one memory pool: captured largest first, replayed one at a time on one stream, outputs copied out before the
    next replay can reuse them."""

    def __init__(self, body: Body, buckets: list[int], before_capture: Callable[[int], None], pool: tuple):
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, DecodeResult] = {}
        for bucket in sorted(buckets, reverse=True):
            before_capture(bucket)
            body(bucket)  # warm-up: Triton compiles, cuBLAS picks kernels, lazy tables fill
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = body(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def replay(self, bucket: int) -> DecodeResult:
        self.graphs[bucket].replay()
        return self.outputs[bucket]
