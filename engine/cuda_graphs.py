"""Decode steps as whole-step CUDA graphs, one per batch bucket; small mixed steps' LM part as graphs too.

A decode-only step (one position per sequence) always runs the same kernels: both LMs over B tokens, every CFG
Euler evaluation of the LocDiT (the default timesteps' evaluations, each row on its own schedule read from the
buffers: `engine.model.euler`; rows at more steps finish in the step's tail, `engine.step_tail`), the stop head,
and the streaming VAE on the B streams' rows.
Replaying it as one graph removes ~1000+ kernel launches per step. Every input lives in a static device buffer
(`DecodeBuffers`), filled from a pinned host mirror by asynchronous copies; a bucket of B' >= B rows runs the B real
sequences plus padding rows that write only to a scratch KV block and a scratch VAE row, so they are harmless.

The graphs never need recapture as sequences grow: the attention grid is sized by a fixed bound (the model's
maximum positions) and the kernel loops only over each sequence's real length, read from the buffers.

Steps with prefill chunks run both LMs over a flat batch (`FlatBuffers`, staged from pinned memory). A small one (a
single new prompt, or a few joining a small batch) spends far longer launching ~500 kernels than running them: it
replays an LM graph keyed by (tokens, sequences) buckets (`lm_graph_key`). A large one (a burst of prompts, prompts
joining many speaking streams) replays a large LM graph (`large_lm_graph_key`): keyed by tokens at the eager
buckets' sizes, every sequence a step can hold, and the audio rows LocEnc runs on (none, or up to a fixed count,
listed in the buffers). Past those, or with more audio rows, a step runs eagerly over the same buffers, padded to
coarser buckets (`eager_flat_key`) so that cuBLAS sees recurring shapes. The padding tokens form one extra
sequence whose K/V go to the scratch block; buckets' other sequences are empty.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from engine.settings import EngineSettings

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# LM graphs of small mixed steps: flat tokens x sequences (counting the padding sequence). Beyond these the eager
# launches hide behind the GPU work, and the attention grid (sequences x max tokens) would grow wasteful. A graph
# runs LocEnc on all its rows (a few ms at 2048), still far below the ~30-50 ms of eager launches it replaces.
LM_GRAPH_TOKENS = (64, 128, 256, 512, 1024, 2048)
LM_GRAPH_SEQS = (2, 4, 8, 16, 32, 64)
EAGER_TOKEN_STEP = 256  # the finest rounding of an eager flat batch's positions (`eager_flat_key`)
# Large LM graphs, for every sequence a flat batch holds, at each eager bucket up to this many positions (a c=64 burst
# of ~111-position prompts is ~7,100). Launched eagerly, such a step's ~500 launches take about as long on the host as
# its GPU work, or longer, so a burst's first audio would wait on the host (with FP8 GEMMs every time); one replay
# takes that host time away. They start at the smallest eager bucket, not past LM_GRAPH_TOKENS: a mixed step of more
# sequences than the small graphs hold (hundreds of decode rows beside a few prompts, every step of a busy gateway)
# would otherwise pad to 2,304 positions (measured: 64 decode rows on the flat path
# took twice as long as their graph step; docs/decisions.md).
LARGE_LM_GRAPH_TOKENS = 8192
# VOXGATE_LARGE_LM_GRAPHS=0: none (every step past the small LM graphs eager); =text: only those
# of prompts alone (LocEnc on no row). For A/B timing and as a fallback.
LARGE_LM_GRAPHS = EngineSettings.from_env().large_lm_graphs


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
    steps_index: Tensor  # [M, E] i64: each Euler evaluation's time-table row (`engine.model.euler.RowSteps`)
    steps_dt: Tensor  # [M, E] f32: each evaluation's Euler step (0 past the row's own evaluations)
    # the step's tail (`engine.step_tail`): the rows that finish their evaluations there, where each writes back
    tail_src: Tensor  # [M] i64
    tail_dst: Tensor  # [M] i64: = tail_src; M (a scratch row) for padding

    @classmethod
    def allocate(cls, rows: int, patch_size: int, feat_dim: int, table_width: int, evaluations: int,
                 device: torch.device, pin: bool = False) -> DecodeBuffers:
        def empty(*shape: int, dtype: torch.dtype) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

        return cls(empty(rows, patch_size, feat_dim, dtype=torch.float32),
                   empty(rows, feat_dim, patch_size, dtype=torch.float32), empty(rows, dtype=torch.float32),
                   empty(rows, dtype=torch.int64), empty(rows, dtype=torch.int64), empty(rows, dtype=torch.int32),
                   empty(rows, table_width, dtype=torch.int32), empty(rows, dtype=torch.int64),
                   empty(rows, evaluations, dtype=torch.int64), empty(rows, evaluations, dtype=torch.float32),
                   empty(rows, dtype=torch.int64), empty(rows, dtype=torch.int64))

    def tensors(self) -> list[Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def copy_rows_(self, src: DecodeBuffers, rows: int) -> None:
        """The first `rows` rows of every buffer from `src` (asynchronous when src is pinned)."""
        for dst, s in zip(self.tensors(), src.tensors(), strict=True):
            dst[:rows].copy_(s[:rows], non_blocking=True)


def lm_graph_keys(max_num_seqs: int) -> list[tuple[int, int]]:
    """(tokens, sequences) of every LM graph, smallest first; sequences count the padding one."""
    cap = min(max_num_seqs + 1, LM_GRAPH_SEQS[-1])
    seqs = [s for s in LM_GRAPH_SEQS if s < cap] + [cap]
    return [(t, s) for t in LM_GRAPH_TOKENS for s in seqs if s <= t]


def lm_graph_key(tokens: int, seqs: int, keys: list[tuple[int, ...]]) -> tuple[int, int] | None:
    """The smallest small LM graph (among `keys`, small and large) for a flat batch of `tokens` positions in `seqs`
    sequences (plus the padding one)."""
    return next(((k[0], k[1]) for k in keys if len(k) == 2 and k[0] >= tokens and k[1] > seqs), None)


def large_lm_graph_keys(max_tokens: int, seqs: int, audio_rows: int) -> list[tuple[int, int, int]]:
    """(tokens, sequences, audio rows) of every large LM graph, smallest first: tokens at the eager buckets up to
    `max_tokens` (at most LARGE_LM_GRAPH_TOKENS), `seqs` sequences (all a flat batch holds, with the padding one),
    LocEnc on no rows or on `audio_rows` listed rows. Up to LM_GRAPH_TOKENS they serve the steps of more sequences
    than the small graphs hold."""
    if LARGE_LM_GRAPHS == "0":
        return []
    tokens = eager_flat_token_buckets(min(max_tokens, LARGE_LM_GRAPH_TOKENS))
    return [(t, seqs, a) for t in tokens for a in ((0,) if LARGE_LM_GRAPHS == "text" else (0, audio_rows))]


def large_lm_graph_key(tokens: int, seqs: int, audio: int,
                       keys: list[tuple[int, ...]]) -> tuple[int, int, int] | None:
    """The smallest large LM graph (among `keys`) for a flat batch of `tokens` positions in `seqs` sequences (plus
    the padding one), `audio` of them audio positions."""
    return next((k for k in keys if len(k) == 3 and k[0] >= tokens and k[1] > seqs and k[2] >= audio
                 and (k[2] > 0) == (audio > 0)), None)


def eager_flat_key(tokens: int, seqs: int) -> tuple[int, int]:
    """The padded flat batch of an eager mixed step (beyond the LM graphs): positions rounded up to 1/8 of their
    power of two (at least EAGER_TOKEN_STEP), sequences (plus the padding one) to a multiple of 16.

    cuBLAS picks a GEMM kernel per new shape: a linear whose row count it has not seen costs several times the
    host time of a known one, so a mixed step of a fresh token count would spend tens of ms launching its ~200
    linears while the GPU idles. Padding (at most 1/8 more work) makes a few dozen shapes recur;
    the multiple of 16 keeps Triton's integer specializations the warm-up compiled."""
    step = max(EAGER_TOKEN_STEP, 1 << max(0, tokens.bit_length() - 4))
    return -(-tokens // step) * step, -(-(seqs + 1) // 16) * 16


def eager_flat_token_buckets(max_tokens: int) -> list[int]:
    """Every token count `eager_flat_key` rounds to, up to the one holding `max_tokens`."""
    out = [eager_flat_key(1, 0)[0]]
    while out[-1] < max_tokens:
        out.append(eager_flat_key(out[-1] + 1, 0)[0])
    return out


@dataclass
class FlatBuffers:
    """Inputs of both LMs over a flat batch of up to T positions in up to S sequences (an LM graph's buffers)."""

    ids: Tensor  # [T] i64 token ids (0 at audio positions)
    patches: Tensor  # [T, P, D] f32 (zeros at text positions)
    masks: Tensor  # [T] i64: 1 at audio positions
    positions: Tensor  # [T] i64
    slots: Tensor  # [T] i64 paged-cache slots
    lora: Tensor  # [T] i64 adapter slot of each position
    cu_seqlens: Tensor  # [S + 1] i32
    seq_lens: Tensor  # [S] i32
    block_tables: Tensor  # [S, W] i32
    last_index: Tensor  # [S] i64: each sequence's last position in the flat batch
    audio_rows: Tensor  # [A] i64: a large LM graph's audio positions, LocEnc's rows (padded with a repeat)

    @classmethod
    def allocate(cls, tokens: int, seqs: int, patch_size: int, feat_dim: int, table_width: int,
                 device: torch.device, pin: bool = False, audio_rows: int = 0) -> FlatBuffers:
        def empty(*shape: int, dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

        return cls(empty(tokens), empty(tokens, patch_size, feat_dim, dtype=torch.float32), empty(tokens),
                   empty(tokens), empty(tokens), empty(tokens), empty(seqs + 1, dtype=torch.int32),
                   empty(seqs, dtype=torch.int32), empty(seqs, table_width, dtype=torch.int32), empty(seqs),
                   empty(audio_rows))

    def copy_(self, src: FlatBuffers, key: tuple[int, ...]) -> None:
        """What bucket `key` reads, from `src` (asynchronous when src is pinned): its (tokens, sequences) and, for a
        large LM graph, its audio rows."""
        tokens, seqs = key[:2]
        audio = key[2] if len(key) > 2 else 0
        for f in fields(self):
            n = {"cu_seqlens": seqs + 1, "seq_lens": seqs, "block_tables": seqs, "last_index": seqs,
                 "audio_rows": audio}.get(f.name, tokens)
            if n:
                getattr(self, f.name)[:n].copy_(getattr(src, f.name)[:n], non_blocking=True)


@dataclass
class DecodeResult:
    patches: Tensor  # [B, P, D] f32
    stops: Tensor  # [B] bool
    audio: Tensor | None  # [B, samples] f32; None from a step graph whose VAE runs on the VAE lane


class StepGraphs:
    """One captured graph of `body(key)` per bucket key (a row count, or (tokens, sequences)) over the same static
    buffers. Every graph set of a runner shares one memory pool: captured largest first, replayed one at a time on
    one stream, outputs copied out before the next replay can reuse them.

    `stream`: where to capture (default: PyTorch's one capture stream for every graph). A set replayed beside others,
    on a stream of its own, needs a capture stream of its own too: PyTorch keys the cuBLAS workspace that a captured
    GEMM writes by the capture stream, so graphs captured on the same one share it, and two of them running at once
    corrupt each other's GEMMs (pytorch/pytorch#193402)."""

    def __init__(self, body: Callable[[Any], Any], buckets: list, before_capture: Callable[[Any], None],
                 pool: tuple, stream: torch.cuda.Stream | None = None):
        self.graphs: dict[Any, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Any, Any] = {}
        for bucket in sorted(buckets, reverse=True):
            before_capture(bucket)
            body(bucket)  # warm-up: Triton compiles, cuBLAS picks kernels, lazy tables fill
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[bucket] = body(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def replay(self, bucket: Any) -> Any:
        self.graphs[bucket].replay()
        return self.outputs[bucket]
