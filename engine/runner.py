"""Runs one scheduled step on the device: flat LM batch -> patches -> stop flags -> streaming VAE.

The runner owns everything that lives on the device: the model, both paged KV caches (base and residual LM share
block tables), and one VAE stream state with a row per request slot. The paths:

- decode-only steps go through static buffers (`engine.cuda_graphs`): on CUDA one graph replay per step, no host
  sync but the one on the outputs; on CPU the same body runs eagerly at the exact batch;
- steps with prefill chunks run both LMs over the flat batch (a third graph set, keyed by tokens x sequences, when
  the step is small enough for launches to dominate; eagerly otherwise), then the emitting rows go through the
  second graph set, "sample + stop + VAE", over the same buffers.

Each row samples at its own settings on every path: its cfg_value and its Euler schedule (`timesteps`, up to the
served maximum `max_timesteps`) are rows of the static buffers, so a request's settings never change a step's
shape or path. The step runs the default timesteps' evaluations: a row with fewer rides along with dt = 0
(`engine.model.euler`); a row with more finishes its own in the step's tail (`engine.step_tail`), a graph per row
bucket over just those rows, replayed after the step's graph and before the VAE lane decodes.

`launch` starts a step and returns at once on the graph path (outputs come back D2H into pinned memory, behind a
CUDA event); `collect` waits for them. The worker publishes the previous step's audio in between.

The VAE lane (CUDA graphs): a step's streaming VAE decode is its own graph, replayed on a second CUDA stream as soon
as the step's patches exist, while the main stream goes on with the next step's LMs and LocDiT (which need only the
patches). The VAE's memory-bound convolutions then fill the SMs that the LocDiT's small kernels and GEMM tails
leave idle, instead of adding their time to every step. Everything that touches the VAE state (decodes, resets,
continuation priming) runs on that stream, so its order is the order of launch. `VOXGATE_VAE_STREAM=0`: the VAE
stays inside the step's graph, on the main stream (`WorkerConfig.vae_stream`).

On a GPU the KV cache takes what `gpu_memory_utilization` leaves after the weights, the static buffers, the
measured peak of a largest eager step and the graphs' memory pool (estimated by the largest decode step's peak).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.cuda_graphs import (
    LARGE_LM_GRAPH_TOKENS,
    DecodeBuffers,
    DecodeResult,
    FlatBuffers,
    StepGraphs,
    bucket_for,
    buckets_for,
    eager_flat_key,
    eager_flat_token_buckets,
    large_lm_graph_key,
    large_lm_graph_keys,
    lm_graph_key,
    lm_graph_keys,
)
from engine.model import fp8
from engine.model.attention import PREFILL_ROWS, AttentionMetadata, KVCache, make_attention_backend
from engine.model.euler import RowSteps, evaluations
from engine.model.fusion import FUSED_KERNELS
from engine.model.parallel import agree_min, local_kv_stack, tp_size
from engine.prompt import CONTEXT_PATCHES
from engine.scheduler import ScheduledSeq
from engine.step_tail import StepTail

if TYPE_CHECKING:
    from engine.checkpoint import LoadedModel
    from engine.worker import WorkerConfig

log = logging.getLogger(__name__)

CPU_KV_BLOCKS = 1024
GiB = 2**30
MEMORY_MARGIN = GiB // 2  # cuBLAS/Triton workspaces and allocator fragmentation beyond the measured peaks
GRAPH_POOL_FACTOR = 2.5


GraphSets = tuple[StepGraphs, StepGraphs, StepGraphs]  # decode, sample, LM


@dataclass
class StepOutput:
    """Aligned with the scheduled seqs; None where a seq only prefilled. On CUDA the audio arrays view pinned
    buffers that the step after next overwrites: copy them before then."""

    patches: list[torch.Tensor | None]  # [P, D] float32 on CPU
    stops: list[bool]
    audio: list[np.ndarray | None]  # float32 mono, one patch


@dataclass
class PendingStep:
    """A launched step: `done` already when it ran eagerly, else the graph path's rows behind `event`."""

    seqs: list[ScheduledSeq]
    done: StepOutput | None = None
    result: DecodeResult | None = None  # CPU outputs, or pinned host copies on CUDA
    event: torch.cuda.Event | None = None
    emit: list[int] | None = None  # the seq of each result row (None: row j is seq j)
    kind: str = "mixed"  # graph (decode replay), decode (CPU decode body), mixed (flat LMs + sample body/graphs)
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # CUDA: brackets the step's device work
    sampled: torch.Tensor | None = None  # its patches where it made them (on the device), row j = seq emit[j]
    audio_event: torch.cuda.Event | None = None  # the VAE lane: its audio is in `result` once this fired
    lora: str = ""  # how it ran LoRA (`Runner._launch`), for the DEBUG step log


@dataclass
class StepTiming:
    """What the last collected step was and what it cost: the worker reports it and the bench summarises it."""

    kind: str
    prefill_tokens: int  # positions fed by chunks of more than one position, or a first patch's prompt
    decode_rows: int
    gpu_ms: float | None  # CUDA events around the step's device work (None on CPU)
    audio_ms: float | None = None  # from the step's start until its audio was back on the host (the VAE lane)
    lora: str = ""  # "merged <slot>", "bypass" or "kernels" (+ each seq's slot at DEBUG); "" without LoRA slots


@dataclass
class HostStaging:
    """Where a step's inputs are written on the host before their upload (on CPU: the device inputs)."""

    buffers: DecodeBuffers
    arrays: dict[str, np.ndarray]  # numpy views of `buffers`: element writes without torch's per-call overhead
    lora_rows: torch.Tensor  # each row's LoRA slot
    flat: FlatBuffers | None = None  # a mixed step's flat batch (`Runner.allocate_flat`), and its numpy views
    flat_arrays: dict[str, np.ndarray] | None = None
    # pinned buffers (CUDA): re-recorded on the stream behind each upload from them. The copies read the buffers
    # when the stream gets there, so the host must not write them again before (`writable`)
    uploaded: torch.cuda.Event | None = None

    @classmethod
    def of(cls, buffers: DecodeBuffers, rows: int, pin: bool) -> HostStaging:
        return cls(buffers, {name: t.numpy() for name, t in vars(buffers).items()},
                   torch.zeros(rows, dtype=torch.long, pin_memory=pin), uploaded=torch.cuda.Event() if pin else None)

    def mark_uploaded(self) -> None:
        """Note an upload just enqueued from these buffers (nothing to note on CPU: they are the device inputs)."""
        if self.uploaded is not None:
            self.uploaded.record()

    def writable(self) -> None:
        """Wait until the device has read the last upload from these buffers (returns at once before any). A
        serving step finds it done (steps alternate two stagings and collect one before staging into it again);
        the warm-up, staging bucket after bucket into one, waits here. Without this wait a host ahead of the device
        would rewrite a bucket's lengths under the previous bucket's pending copy, and the attention would read past
        its tensors."""
        if self.uploaded is not None:
            self.uploaded.synchronize()


_engine_kernels: tuple[int, list] = (-1, [])  # (len(sys.modules) when found, the engine's JITFunctions)


def triton_compiles() -> int:
    """Triton kernels compiled so far in this process, over every specialization of every engine kernel: a new
    one inside a serving step stalls it for 100s of ms, so after the runner's warm-up this should stay flat."""
    global _engine_kernels
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return 0
    # The worker counts after every step: finding the kernels walks every engine module (~0.3 ms, on the way to
    # publishing the step's audio), so that runs again only when a module was imported since
    seen, kernels = _engine_kernels
    if seen != len(sys.modules):
        found = {id(obj): obj for name, module in list(sys.modules.items())
                 if name.startswith("engine") and module is not None
                 for obj in list(vars(module).values()) if isinstance(obj, JITFunction)}
        kernels = list(found.values())
        _engine_kernels = (len(sys.modules), kernels)
    return sum(len(cache[0]) for kernel in kernels for cache in kernel.device_caches.values())


class Runner:
    def __init__(self, loaded: LoadedModel, cfg: WorkerConfig):
        self.config = loaded.config
        self.model, self.vae = loaded.model, loaded.vae
        # under tensor parallelism this rank caches only its own KV heads
        self.kv_stacks = tuple(local_kv_stack(s, tp_size(self.model))
                               for s in (self.config.lm, self.config.residual_lm))
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if cfg.vae_dtype != "float32":  # the decoder only: prompt audio is encoded by the float32 encoder
            self.vae.decoder.to(getattr(torch, cfg.vae_dtype))
        self.vae_dtype = next(self.vae.decoder.parameters()).dtype
        self.block_size = cfg.block_size
        self.timesteps = cfg.inference_timesteps
        self.max_timesteps = cfg.max_timesteps or cfg.inference_timesteps
        # every served timesteps value's Euler evaluations: each step runs `schedules.width` of them, each row on its
        # own schedule over one time-embedding table, made here (before any capture) and never reallocated (no LoRA,
        # FP8 or fusion touches the time MLPs' weights)
        self.schedules = self.model.feat_decoder.schedules(range(1, self.max_timesteps + 1))
        with torch.no_grad():
            self.step_table = self.schedules.table(self.model.feat_decoder.estimator, self.device)
        self.max_num_seqs = cfg.max_num_seqs
        cuda = self.device.type == "cuda"
        if cuda:
            self.model.attention = make_attention_backend(self.device, cfg.block_size)
            if FUSED_KERNELS:
                self.model.fuse_projections()  # before the graphs capture the step
        if cfg.fp8_prefill or cfg.fp8_dit:
            self._quantize_fp8(cfg)  # before the memory budget below counts the weights
        weights = torch.cuda.memory_allocated(self.device) if cuda else 0

        # Graph buckets on CUDA; on CPU the decode body runs at the exact batch size (padding buys nothing there).
        self.buckets: list[int] | None = buckets_for(cfg.max_num_seqs) if cuda else None
        self.max_positions = self.config.lm.max_position_embeddings
        p, d = self.config.patch_size, self.config.feat_dim
        width = -(-self.max_positions // self.block_size)
        evals = self.schedules.width
        self.inputs = DecodeBuffers.allocate(cfg.max_num_seqs, p, d, width, evals, self.device)
        # Two pinned host mirrors on CUDA, one per launch in turn: a step launched ahead (`launch(after=...)`) is
        # staged while the previous one's inputs may still be on their way to the device.
        mirrors = [DecodeBuffers.allocate(cfg.max_num_seqs, p, d, width, evals, torch.device("cpu"), pin=True)
                   for _ in range(2)] if cuda else [self.inputs]
        self.stagings = [HostStaging.of(m, cfg.max_num_seqs, pin=cuda) for m in mirrors]
        self.host_turn = 0
        self._use_host(0)
        rows = torch.arange(cfg.max_num_seqs + 1, device=self.device)
        self.row_index, self.cu_seqlens = rows[:-1], rows.to(torch.int32)
        self.zeros, self.ones = torch.zeros_like(self.row_index), torch.ones_like(self.row_index)
        self._zero_patch = torch.zeros(1, p, d)  # a fed row's staged input (`stage_flat`)
        hidden = self.config.lm.hidden_size  # the sample graphs' inputs: LM states of the emitting rows
        self.lm_h = torch.zeros(cfg.max_num_seqs, hidden, device=self.device, dtype=self.dtype)
        self.res_h = torch.zeros_like(self.lm_h)
        self.scratch_slot = cfg.max_num_seqs  # padding rows decode into this extra VAE row
        # LoRA slot of each static row (padding rows: 0, no adapter); the graphs read it in place
        self.lora = getattr(self.model, "lora", None) is not None
        self.lora_rows = torch.zeros(cfg.max_num_seqs, dtype=torch.long, device=self.device)
        self.merged_steps = 0  # steps that ran one adapter merged into the weights (`MergedAdapter`)
        self.vae_state = self.vae.stream_state(cfg.max_num_seqs + 1)
        # the VAE lane (module docstring): its stream, the static inputs its graphs read (each step's patches and
        # VAE rows, copied there: the next step overwrites its own), and the event of their last read
        self.vae_stream = torch.cuda.Stream(self.device) if cuda and cfg.cuda_graphs and cfg.vae_stream else None
        self.vae_in = torch.zeros(cfg.max_num_seqs, p, d, device=self.device)
        self.vae_in_slots = torch.full((cfg.max_num_seqs,), self.scratch_slot, dtype=torch.long, device=self.device)
        self.vae_graphs: StepGraphs | None = None
        self._vae_read: torch.cuda.Event | None = None
        self.parity = 0
        self.outputs = [self._host_outputs(cfg.max_num_seqs) for _ in range(2)] if cuda else []
        # Rows at more diffusion steps than the default: the step's graphs run the default's evaluations for every
        # row and such rows finish theirs in the step's tail (`engine.step_tail`), which needs the VAE lane (or no
        # graphs) and no LoRA slots; otherwise every step runs the most evaluations served.
        self.graph_evals = self.schedules.width
        self.tail: StepTail | None = None
        if self.max_timesteps > self.timesteps and not self.lora and (
                self.vae_stream is not None or not (cuda and cfg.cuda_graphs)):
            self.graph_evals = evaluations(self.timesteps)
            self.tail = StepTail(self)

        self.memory: dict[str, float] = {}
        if cfg.num_kv_blocks:
            self.num_blocks = cfg.num_kv_blocks
        elif cuda:
            self.num_blocks = agree_min(self.model, self._blocks_from_budget(cfg, weights), self.device)
        else:
            self.num_blocks = CPU_KV_BLOCKS
        self.scratch_block = self.num_blocks  # one block past the scheduler's: padding rows write their KV here
        self.caches = tuple(KVCache.allocate(stack, self.num_blocks + 1, self.block_size, self.device, self.dtype)
                            for stack in self.kv_stacks)
        self.graphs: StepGraphs | None = None
        self.sample_graphs: StepGraphs | None = None
        self.lm_graphs: StepGraphs | None = None
        self.adapter_free_graphs: GraphSets | None = None  # with LoRA slots: the three sets captured without LoRA
        self.lm_keys: list[tuple[int, ...]] = []  # LM graph buckets: (tokens, seqs) and large (tokens, seqs, audio)
        self.eager_flat: tuple[int, int] | None = None  # the largest eager flat batch (`eager_flat_key`)
        self.ahead_tokens = 0  # positions a step launched ahead may hold (its flat batch must take it)
        if cuda or cfg.mixed_ahead(cuda):  # on CPU the flat batch serves only steps launched ahead (no padding gain)
            # the padding sequence (at most 1/8 of a bucket) must fit one sequence's positions
            self.ahead_tokens = min(cfg.max_num_batched_tokens, self.max_positions)
            eager = eager_flat_key(self.ahead_tokens, cfg.max_num_seqs)
            keys: list[tuple[int, ...]] = []
            if cuda and cfg.cuda_graphs:
                # large graphs: LocEnc on no rows, or on as many as a step has sequences (decode rows, short audio)
                keys = [*lm_graph_keys(cfg.max_num_seqs),
                        *large_lm_graph_keys(self.ahead_tokens, eager[1], -(-cfg.max_num_seqs // 64) * 64)]
            self.allocate_flat(keys, eager)
        if cuda and cfg.cuda_graphs:
            before = torch.cuda.memory_reserved(self.device)
            pool = torch.cuda.graph_pool_handle()
            with torch.inference_mode():
                self.graphs, self.sample_graphs, self.lm_graphs = self._capture_graphs(pool)
                if self.lora:  # steps whose rows all use no adapter replay these and launch no LoRA kernel
                    self.model.lora.bypass = True
                    try:
                        self.adapter_free_graphs = self._capture_graphs(pool)
                    finally:
                        self.model.lora.bypass = False
                    if self.model.lora.merged is not None:  # an adapter switch: one replay, not ~200 launches
                        self.model.lora.merged.capture()
                if self.tail is not None:
                    self.tail.capture(pool)
                if self.vae_stream is not None:  # replayed beside the step graphs, not after them: a memory pool
                    # and a capture stream of their own (so their GEMMs get a cuBLAS workspace of their own, see
                    # `StepGraphs`; with one shared, steps launched ahead would sample wrong patches now and then)
                    self.vae_graphs = StepGraphs(self._vae_body, self.buckets or [], self._pad_vae,
                                                 torch.cuda.graph_pool_handle(), stream=self.vae_stream)
            self.memory["graphs_gib"] = (torch.cuda.memory_reserved(self.device) - before) / GiB
        if cuda:
            self.warm_up()
            self._log_memory(cfg, weights)
        self.last_step: StepTiming | None = None

    def _use_host(self, turn: int) -> None:
        self.host_turn = turn
        self.staging = self.stagings[turn]
        self.staging.writable()

    def _capture_graphs(self, pool: tuple) -> GraphSets:
        """Decode, sample and LM graphs for every bucket (the caller sets whether LoRA work is captured)."""
        return (StepGraphs(lambda rows: self._decode_body(rows, self.max_positions), self.buckets or [],
                           self._pad_all, pool),
                StepGraphs(self._sample_body, self.buckets or [], self._pad_all, pool),
                StepGraphs(self.lm_body, self.lm_keys, self._pad_flat, pool))

    def _graph_sets(self) -> tuple[StepGraphs | None, StepGraphs | None, StepGraphs | None]:
        """(decode, sample, LM) graphs for the step being launched: the adapter-free ones when it bypasses LoRA."""
        if self.adapter_free_graphs is not None and self.model.lora.bypass:
            return self.adapter_free_graphs
        return self.graphs, self.sample_graphs, self.lm_graphs

    def _quantize_fp8(self, cfg: WorkerConfig) -> None:
        """FP8 copies of the weights `fp8_prefill` / `fp8_dit` name (`engine.model.fp8`), their kernels warmed up."""
        if not fp8.supported(self.device):
            raise ValueError(f"FP8 GEMMs need a GPU of compute capability 8.9 or newer; {self.device} is "
                             f"{'.'.join(map(str, torch.cuda.get_device_capability(self.device)))}")
        if cfg.fp8_prefill:
            self.model.quantize_lms_fp8()
        if cfg.fp8_dit:
            self.model.quantize_dit_fp8()
        copies = fp8.weights(self.model)
        log.info("FP8 GEMMs from %d rows on in %s: %d FP8 weights, %.2f GiB", fp8.MIN_ROWS,
                 " and ".join(n for n, on in (("the LMs", cfg.fp8_prefill), ("the LocDiT", cfg.fp8_dit)) if on),
                 len(copies), sum(w.weight.numel() + 4 * w.scale.numel() for w in copies) / GiB)
        fp8.warm_up(self.model, cfg.max_num_batched_tokens)

    # ---- memory ----------------------------------------------------------------------------------------------
    def _kv_bytes_per_block(self) -> int:
        return self.block_size * 2 * self.dtype.itemsize * sum(
            s.num_hidden_layers * s.num_key_value_heads * s.head_dim for s in self.kv_stacks)

    def _blocks_from_budget(self, cfg: WorkerConfig, weights: int) -> int:
        mixed, decode, vae = self._measure_activations(cfg)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # The graph pool holds the decode steps' intermediates for good, beside the eager steps' peak: about twice
        # the largest step's peak (every bucket keeps its outputs; captures fragment it).
        # With LoRA the adapter-free sets too; the VAE lane's graphs have a pool of their own.
        graphs = GRAPH_POOL_FACTOR * (decode * (1 + self.lora + (self.tail is not None)) + vae)
        if cfg.cuda_graphs:  # the large LM graphs' intermediates: the mixed peak scaled to their largest bucket
            graphs += mixed * min(1.0, LARGE_LM_GRAPH_TOKENS / eager_flat_key(cfg.max_num_batched_tokens, 0)[0])
        eager = max(mixed, decode, vae)
        budget = total * cfg.gpu_memory_utilization - (total - free) - eager - graphs - MEMORY_MARGIN
        self.memory.update(weights_gib=weights / GiB, eager_peak_gib=eager / GiB,
                           graph_estimate_gib=graphs / GiB, total_gib=total / GiB)
        blocks = int(budget // self._kv_bytes_per_block())
        if blocks < 1:
            raise MemoryError(f"no room for the KV cache: gpu_memory_utilization {cfg.gpu_memory_utilization} "
                              f"leaves {budget / GiB:.1f} GiB after weights, activations and CUDA graphs")
        return blocks

    @torch.inference_mode()
    def _measure_activations(self, cfg: WorkerConfig) -> tuple[int, int, int]:
        """Peak bytes of (a prefill step of max_num_batched_tokens tokens, a decode step of max_num_seqs rows, the
        VAE lane's decode of as many: 0 without the lane, where the decode step holds it), run eagerly on a scratch
        KV cache that every sequence shares (prefill at its padded eager bucket's size)."""
        tokens = eager_flat_key(cfg.max_num_batched_tokens, 0)[0]
        seqs = min(cfg.max_num_seqs, tokens)
        lens = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
        blocks = -(-max(lens) // self.block_size)
        self.scratch_block = 0
        self.caches = tuple(KVCache.allocate(stack, blocks, self.block_size, self.device, self.dtype)
                            for stack in self.kv_stacks)
        meta = AttentionMetadata.build(lens, [0] * seqs, [list(range(blocks))] * seqs, self.block_size, self.device)
        p, d = self.config.patch_size, self.config.feat_dim
        dev = self.device

        def peak(run) -> int:
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            run()
            torch.cuda.synchronize(dev)
            return torch.cuda.max_memory_allocated(dev) - base

        mixed = peak(lambda: self.model.forward_lms(
            torch.zeros(tokens, dtype=torch.long, device=dev), torch.zeros(tokens, p, d, device=dev, dtype=self.dtype),
            torch.zeros(tokens, dtype=torch.long, device=dev), meta.positions().long(), meta, self.caches,
            torch.tensor(np.cumsum(lens) - 1, device=dev)))
        self._pad_all(cfg.max_num_seqs)
        decode = peak(lambda: self._decode_body(cfg.max_num_seqs, self.max_positions))
        vae = 0
        if self.vae_stream is not None:
            self._pad_vae(cfg.max_num_seqs)
            vae = peak(lambda: self._vae_body(cfg.max_num_seqs))
        del self.caches
        return mixed, decode, vae

    def _log_memory(self, cfg: WorkerConfig, weights: int) -> None:
        block_bytes = self._kv_bytes_per_block()
        positions = self.num_blocks * self.block_size
        self.memory.update(kv_gib=self.num_blocks * block_bytes / GiB, kv_blocks=self.num_blocks,
                           kv_positions=positions, weights_gib=weights / GiB,
                           allocated_gib=torch.cuda.memory_allocated(self.device) / GiB,
                           reserved_gib=torch.cuda.memory_reserved(self.device) / GiB)
        streams = positions // max(1, 512)
        m = self.memory
        log.info("GPU memory: weights %.2f GiB, CUDA graphs %.2f GiB (estimated %.2f), eager activation peak "
                 "%.2f GiB, KV cache %.2f GiB = %d blocks x %d positions (%d streams of 512 positions); reserved "
                 "%.2f of %.2f GiB at utilization %.2f", m["weights_gib"], m.get("graphs_gib", 0.0),
                 m.get("graph_estimate_gib", 0.0), m.get("eager_peak_gib", 0.0), m["kv_gib"], self.num_blocks,
                 self.block_size, streams, m["reserved_gib"], m.get("total_gib", 0.0), cfg.gpu_memory_utilization)

    # Flat-batch shapes of the eager steps, (positions per sequence, block-table width): Triton specializes integer
    # arguments on == 1 and divisibility by 16 (token counts in RoPE and LoRA, the block-table stride in attention),
    # so these cover every class a serving step can hit; each new class would otherwise compile inside a step.
    WARM_SHAPES = ((1, 1), (16, 1), (17, 2), (16, 16), (5, 17), (16, 33))
    WARM_SEQS = (1, 2, 3)
    WARM_EAGER_TOKENS = 8192

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile every kernel specialization the eager paths can reach, at engine start: both LMs over flat
        batches of each shape class (into the scratch KV block), and sampling + VAE at each row-count class (into
        the scratch VAE row). Costs a few seconds once; a serving step then never waits for the compiler."""
        before = triton_compiles()
        dev, p, d = self.device, self.config.patch_size, self.config.feat_dim
        bs = self.block_size
        for q, width in self.WARM_SHAPES:
            if width * bs > self.max_positions:
                continue
            for seqs in self.WARM_SEQS:
                n = q * seqs
                tables = [[self.scratch_block] * width] * seqs
                meta = AttentionMetadata.build([q] * seqs, [width * bs - q] * seqs, tables, bs, dev)
                if self.lora:
                    self.model.set_lora_indices(tokens=torch.zeros(n, dtype=torch.long, device=dev))
                mask = torch.arange(n, device=dev) % 2  # text and audio rows
                self.model.forward_lms(torch.ones(n, dtype=torch.long, device=dev),
                                       torch.zeros(n, p, d, device=dev, dtype=self.dtype), mask,
                                       meta.positions().long(), meta, self.caches,
                                       torch.arange(q - 1, n, q, device=dev))
        for rows in (1, 2, 16, 17):
            h = torch.zeros(rows, self.config.lm.hidden_size, device=dev, dtype=self.dtype)
            if self.lora:
                self.model.set_lora_indices(seqs=torch.zeros(rows, dtype=torch.long, device=dev))
            sampled = self.model.sample_patches(h, h, torch.zeros(rows, p, d, device=dev, dtype=self.dtype),
                                                torch.randn(rows, d, p, device=dev, dtype=self.dtype),
                                                self.schedules.uniform(self.model.feat_decoder.estimator,
                                                                       self.timesteps, rows, dev),
                                                torch.full((rows,), 2.0, device=dev, dtype=self.dtype))
            self.model.stop_flags(h)
            with self._on_vae_lane(join=True):
                slots = torch.full((rows,), self.scratch_slot, device=self.vae_state.buffers[0].device)
                self._vae_decode(slots, sampled)
        # eager mixed steps: every flat bucket up to WARM_EAGER_TOKENS once, all padding (one sequence in the scratch
        # block), so each GEMM shape has met cuBLAS before a step does (larger ones come in bursts whose GPU work
        # hides that first meeting)
        if self.eager_flat is not None:
            for tokens in eager_flat_token_buckets(min(self.eager_flat[0], self.WARM_EAGER_TOKENS, self.max_positions)):
                self._pad_flat((tokens, 16))
                self.lm_body((tokens, 16), eager=True)
        # a continuation primes its VAE row with the prompt's last 1..CONTEXT_PATCHES patches, eagerly: lengths
        # whose kernels (Triton specializations, ~1 s to compile) the decodes above never run
        with self._on_vae_lane(join=True):
            for k in range(1, CONTEXT_PATCHES[self.config.architecture] + 1):
                self._prime_context(self.scratch_slot, torch.zeros(k, p, d))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        log.info("warm-up: %d Triton kernel specializations compiled (%d in all)", triton_compiles() - before,
                 triton_compiles())

    # ---- one step --------------------------------------------------------------------------------------------
    def step(self, seqs: list[ScheduledSeq]) -> StepOutput:
        """Run one step to completion."""
        return self.collect(self.launch(seqs))

    @torch.inference_mode()
    def launch(self, seqs: list[ScheduledSeq], after: PendingStep | None = None, adapter: int = 0) -> PendingStep:
        """Start a step; on the graph paths the device works on it after this returns.

        `after`: a step not yet collected whose sampling requests this step continues, one decode position each
        (`Scheduler.schedule_ahead`; it may also admit new prompts, `launchable_ahead`). Its sampled patches become
        this step's inputs on the device, so this step is staged and queued while that one runs, and the device
        never waits for the host between the two.
        `adapter`: the LoRA slot that every running request uses (`Scheduler.single_adapter`; 0: none, or several).
        With a `MergedAdapter` such a step runs that adapter merged into the weights, without LoRA kernels."""
        start = None
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        pending = self._launch(seqs, after, adapter)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            pending.events = (start, end)
        return pending

    def _launch(self, seqs: list[ScheduledSeq], after: PendingStep | None, adapter: int) -> PendingStep:
        if len(self.stagings) > 1:
            self._use_host(1 - self.host_turn)
        if not self.lora:
            return self._launch_step(seqs, after)
        # a step without adapter rows skips all LoRA work: eagerly by the flag, graphed by the sets captured with it;
        # so does one whose adapter is merged into the weights (every running request uses it, so all its rows do)
        state = self.model.lora
        merged = state.merged is not None and adapter != 0 and all(s.request.lora_slot == adapter for s in seqs)
        if state.merged is not None:
            state.merged.use(adapter if merged else 0)
        state.bypass = merged or all(s.request.lora_slot == 0 for s in seqs)
        self.merged_steps += merged
        if merged:
            how = f"merged {adapter}"
        elif state.bypass:
            how = "bypass"
        elif log.isEnabledFor(logging.DEBUG):  # each row's slot only then: a join over the batch every step otherwise
            how = "kernels " + ",".join(str(s.request.lora_slot) for s in seqs)
        else:
            how = "kernels"
        try:
            pending = self._launch_step(seqs, after)
        finally:
            self.model.lora.bypass = False
        pending.lora = how
        return pending

    def _launch_step(self, seqs: list[ScheduledSeq], after: PendingStep | None) -> PendingStep:
        decode_graphs, sample_graphs, _ = self._graph_sets()
        if self.tail is not None:
            self.tail.bucket = 0  # `_stage_rows` stages this step's tail, if it has one
        # the seqs that continue `after` (still on the device): seq k's input patch is row fed[k] of its samples
        fed = self._fed_rows(seqs, after) if after is not None else {}
        if self._decode_only(seqs):
            n = len(seqs)
            # rows continuing `after` get their input on the device; the others (split decodes: the other half,
            # collected a step ago) from the host
            conds = [None if k in fed else s.request.generated[-1] for k, s in enumerate(seqs)]
            rows = self._stage_rows([s.request for s in seqs], conds)
            self._stage_positions(seqs)
            self._upload(rows)
            if fed:
                ks = sorted(fed)
                self._gather(self.inputs.patches, ks, after, [fed[k] for k in ks])
            if decode_graphs is not None:
                result = self._lane_audio(rows, self._replay_tail(decode_graphs.replay(rows)))
            else:
                result = self._decode_body(rows, self._max_seqlen_k(n), eager_tail=True)
            pending = self._download(seqs, result, n, None)
            pending.kind = "graph" if decode_graphs is not None else "decode"
            pending.sampled = result.patches
            return pending
        emit = [k for k, s in enumerate(seqs) if s.emit]
        rows = n = 0
        if emit:  # the sampling inputs first: the LM graph may reuse the memory `after` sampled into
            reqs = [seqs[k].request for k in emit]
            rows = self._stage_rows(reqs, [None if k in fed else seqs[k].request.cond for k in emit])
            self._upload(rows)
            conds = [j for j, k in enumerate(emit) if k in fed]
            if conds:
                self._gather(self.inputs.patches, conds, after, [fed[emit[j]] for j in conds])
        lm_h, res_h = self._forward_lms(seqs, after, fed)
        if not emit:
            return PendingStep(seqs, done=StepOutput([None] * len(seqs), [False] * len(seqs), [None] * len(seqs)),
                               kind="mixed")
        index = self._device_index(emit)
        n = len(emit)
        self.lm_h[:n].copy_(lm_h.index_select(0, index))
        self.res_h[:n].copy_(res_h.index_select(0, index))
        self.lm_h[n:rows].zero_()
        self.res_h[n:rows].zero_()
        result = self._lane_audio(rows, self._replay_tail(sample_graphs.replay(rows))) if sample_graphs is not None \
            else self._sample_body(rows, eager_tail=True)
        pending = self._download(seqs, result, n, emit)
        pending.kind = "mixed"
        pending.sampled = result.patches
        return pending

    def launchable_ahead(self, request) -> bool:
        """Whether a step launched ahead (`launch(after=...)`) may admit `request`: its prompt goes through the
        flat buffers (where the continuing rows' patches are fed on the device)."""
        return self.eager_flat is not None

    def collect(self, pending: PendingStep) -> StepOutput:
        """Wait for a launched step's outputs (and note its timing in `last_step`)."""
        out = self._collect(pending)
        gpu_ms = audio_ms = None
        if pending.events is not None:
            pending.events[1].synchronize()
            gpu_ms = pending.events[0].elapsed_time(pending.events[1])
            if pending.audio_event is not None:
                audio_ms = pending.events[0].elapsed_time(pending.audio_event)
        prefill = sum(s.num_tokens for s in pending.seqs if s.num_tokens > 1 or not s.request.generated)
        decode = sum(1 for s in pending.seqs if s.num_tokens == 1 and s.request.generated)
        self.last_step = StepTiming(pending.kind, prefill, decode, gpu_ms, audio_ms, pending.lora)
        return out

    def _collect(self, pending: PendingStep) -> StepOutput:
        if pending.done is not None:
            return pending.done
        assert pending.result is not None
        for event in (pending.event, pending.audio_event):
            if event is not None:
                event.synchronize()
        r = pending.result
        patches = list(r.patches.clone())  # the requests keep these; the pinned buffers are reused
        stops = r.stops.tolist()
        audio = r.audio.numpy()
        if pending.emit is None:
            return StepOutput(patches, stops, [audio[j] for j in range(len(pending.seqs))])
        out = StepOutput([None] * len(pending.seqs), [False] * len(pending.seqs), [None] * len(pending.seqs))
        for j, k in enumerate(pending.emit):
            out.patches[k], out.stops[k], out.audio[k] = patches[j], stops[j], audio[j]
        return out

    def _decode_only(self, seqs: list[ScheduledSeq]) -> bool:
        width = self.staging.buffers.block_tables.shape[1]
        return bool(seqs) and len(seqs) <= self.max_num_seqs and all(
            s.num_tokens == 1 and s.emit and s.request.generated and len(s.request.block_table) <= width
            for s in seqs)

    def _max_seqlen_k(self, n: int) -> int:
        # CUDA: a fixed bound, so one graph serves every length; CPU (TorchAttention pads to it): the real one
        return self.max_positions if self.device.type == "cuda" else int(self.staging.buffers.seq_lens[:n].max())

    def _stage_rows(self, reqs: list, conds: list[torch.Tensor | None] | None) -> int:
        """Host rows of the sampling inputs (condition patch, noise, cfg, VAE row) of `reqs`, padding up to the
        bucket; returns the bucket size. Primes new VAE rows first (eagerly, ahead of the step on the stream).
        conds None (or a None entry): the condition patches come later, on the device (`_gather`)."""
        d, p = self.config.feat_dim, self.config.patch_size
        host = self.staging
        h = host.arrays
        self._prime([r for r in reqs if not r.vae_primed])
        for j, req in enumerate(reqs):
            params = req.spec.params
            if conds is not None and conds[j] is not None:
                host.buffers.patches[j].copy_(conds[j])
            noise = host.buffers.noise[j]
            torch.randn(d, p, generator=req.generator, out=noise)
            if params.temperature != 1.0:
                noise.mul_(params.temperature)
            h["cfg"][j] = params.cfg_value
            h["vae_slots"][j] = req.vae_slot
            host.lora_rows[j] = req.lora_slot
        n = len(reqs)
        # each row's Euler schedule, one fancy index for all (the guard admits served values only)
        timesteps = np.fromiter((r.spec.params.timesteps for r in reqs), dtype=np.int64, count=n)
        h["steps_index"][:n] = self.schedules.index_by_value[timesteps]
        h["steps_dt"][:n] = self.schedules.dt_by_value[timesteps]
        if self.tail is not None:
            self.tail.stage(timesteps)
        rows = bucket_for(n, self.buckets) if self.buckets else n
        self._stage_padding(rows, first=n)
        return rows

    @staticmethod
    def _fed_rows(seqs: list[ScheduledSeq], after: PendingStep) -> dict[int, int]:
        """{k: j}: seqs[k] continues a request that sampled row j of `after` (a step still on the device)."""
        assert after.sampled is not None, "a step that sampled"
        emit = after.emit if after.emit is not None else range(len(after.seqs))
        row = {id(after.seqs[k].request): j for j, k in enumerate(emit)}
        return {k: row[id(s.request)] for k, s in enumerate(seqs) if id(s.request) in row}

    def _gather(self, dst: torch.Tensor, dst_rows: list[int], after: PendingStep, rows: list[int]) -> None:
        """dst[dst_rows] = the patches `after` sampled at `rows`: on the device, behind that step's work and this
        step's uploads on the one stream."""
        assert after.sampled is not None
        n = len(rows)
        if dst_rows == rows == list(range(n)):  # no request left in between: the rows line up
            dst[:n].copy_(after.sampled[:n])
            return
        src = after.sampled.index_select(0, self._device_index(rows))
        if dst_rows == list(range(n)):
            dst[:n].copy_(src)
        else:
            dst.index_copy_(0, self._device_index(dst_rows), src)

    def _device_index(self, values: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Host ints as a device index, from pageable memory: the driver copies them to a staging buffer at once
        (no stream sync, unlike torch.tensor(..., device=)), and nothing pinned is reused before its copy ran (a
        launch may gather twice)."""
        return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(self.device, non_blocking=True)

    def _stage_positions(self, seqs: list[ScheduledSeq]) -> None:
        """Host rows of a decode step's attention inputs (the fed position, its slot, the block table)."""
        h, bs = self.staging.arrays, self.block_size
        for j, seq in enumerate(seqs):
            pos, table = seq.start, seq.request.block_table
            h["positions"][j] = pos
            h["slots"][j] = table[pos // bs] * bs + pos % bs
            h["seq_lens"][j] = pos + 1
            h["block_tables"][j, :len(table)] = table

    def _upload(self, rows: int) -> None:
        host = self.staging
        if host.buffers is not self.inputs:
            self.inputs.copy_rows_(host.buffers, rows)
        if self.lora:
            self.lora_rows[:rows].copy_(host.lora_rows[:rows], non_blocking=True)
        host.mark_uploaded()

    def _download(self, seqs: list[ScheduledSeq], result: DecodeResult, n: int, emit: list[int] | None
                  ) -> PendingStep:
        """The first n result rows: as they are on CPU; on CUDA copied D2H into pinned memory behind an event."""
        if self.device.type != "cuda":
            return PendingStep(seqs, result=DecodeResult(result.patches[:n], result.stops[:n], result.audio[:n]),
                               emit=emit)
        out = self.outputs[self.parity]
        self.parity ^= 1
        lane = self.vae_stream
        copies = [(out.patches, result.patches), (out.stops, result.stops)]
        if lane is None:  # else the audio comes back on the lane, below
            copies.append((out.audio, result.audio))
        for dst, src in copies:
            dst[:n].copy_(src[:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        audio_event = None
        if lane is not None:  # behind the step's VAE decode on its lane
            with torch.cuda.stream(lane):
                out.audio[:n].copy_(result.audio[:n], non_blocking=True)
                audio_event = torch.cuda.Event(enable_timing=True)  # `collect` times the audio's return too
                audio_event.record()
        return PendingStep(seqs, result=DecodeResult(out.patches[:n], out.stops[:n], out.audio[:n]), event=event,
                           emit=emit, audio_event=audio_event)

    def _stage_padding(self, rows: int, first: int = 0) -> None:
        """Host rows [first, rows): sequences of length 1 in the scratch KV block, decoding into the scratch VAE row."""
        h = self.staging.arrays
        for name in ("patches", "noise", "positions"):
            h[name][first:rows] = 0
        h["cfg"][first:rows] = 1.0
        h["steps_index"][first:rows], h["steps_dt"][first:rows] = self.schedules.row(self.timesteps)
        h["slots"][first:rows] = self.scratch_block * self.block_size
        h["seq_lens"][first:rows] = 1
        h["block_tables"][first:rows, 0] = self.scratch_block
        h["vae_slots"][first:rows] = self.scratch_slot
        self.staging.lora_rows[first:rows] = 0

    def _pad_all(self, rows: int) -> None:
        self.staging.writable()
        self._stage_padding(rows)
        self._upload(rows)

    def _decode_body(self, rows: int, max_seqlen_k: int, eager_tail: bool = False) -> DecodeResult:
        """The whole decode step over the first `rows` rows of the static buffers (what the graphs capture);
        `eager_tail`: see `_sample_body`."""
        b = self.inputs
        self.model.set_lora_indices(tokens=self.lora_rows[:rows])
        meta = AttentionMetadata(cu_seqlens_q=self.cu_seqlens[:rows + 1], seq_lens=b.seq_lens[:rows],
                                 slot_mapping=b.slots[:rows], block_tables=b.block_tables[:rows],
                                 max_seqlen_q=1, max_seqlen_k=max_seqlen_k)
        lm_h, res_h = self.model.forward_lms(self.zeros[:rows], b.patches[:rows].to(self.dtype), self.ones[:rows],
                                             b.positions[:rows], meta, self.caches, last_index=self.row_index[:rows])
        return self._sample_body(rows, lm_h, res_h, eager_tail)

    def _sample_body(self, rows: int, lm_h: torch.Tensor | None = None, res_h: torch.Tensor | None = None,
                     eager_tail: bool = False) -> DecodeResult:
        """Sample + stop + VAE for the first `rows` rows (LM states from `lm_h`/`res_h`, default: the static ones),
        the graphs' evaluations of each row's schedule. With the VAE lane, no VAE (audio None): `_lane_audio` queues
        it on its own stream. `eager_tail` (eager callers; graphs replay the tail after this): run the staged step's
        tail (`engine.step_tail`) before the VAE decodes its rows."""
        b = self.inputs
        self.model.set_lora_indices(seqs=self.lora_rows[:rows])
        given = (lm_h, res_h)
        lm_h = self.lm_h[:rows] if lm_h is None else lm_h
        res_h = self.res_h[:rows] if res_h is None else res_h
        evals = self.graph_evals
        steps = RowSteps(self.step_table, b.steps_index[:rows, :evals], b.steps_dt[:rows, :evals])
        sampled = self.model.sample_patches(lm_h, res_h, b.patches[:rows].to(self.dtype),
                                            b.noise[:rows].to(self.dtype), steps, b.cfg[:rows].to(self.dtype))
        stops = self.model.stop_flags(lm_h)
        if self.tail is not None:
            sampled = self.tail.keep(rows, sampled, *given)
            if eager_tail and self.tail.bucket:
                self.tail.body(self.tail.bucket)
        if self.vae_stream is not None:
            return DecodeResult(sampled, stops, None)
        return DecodeResult(sampled, stops, self._vae_decode(b.vae_slots[:rows], sampled))

    def _replay_tail(self, result: DecodeResult) -> DecodeResult:
        """`result` (a graph's) once the staged step's tail, if any, has finished its rows in place."""
        if self.tail is not None:
            self.tail.replay()
        return result

    # ---- the VAE lane -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _on_vae_lane(self, join: bool = False) -> Iterator[None]:
        """Run the enclosed VAE-state work on the VAE lane, after all work queued so far on the main stream (its
        tensors must be made inside, or outlive the lane's use of them); `join`: the main stream then waits for it.
        Without the lane, in place."""
        lane = self.vae_stream
        if lane is None or torch.cuda.current_stream(self.device) == lane:
            yield
            return
        main = torch.cuda.current_stream(self.device)
        lane.wait_stream(main)
        with torch.cuda.stream(lane):
            yield
        if join:
            main.wait_stream(lane)

    def _vae_body(self, rows: int) -> torch.Tensor:
        """The VAE lane's decode of the first `rows` rows of its static inputs (what its graphs capture)."""
        return self._vae_decode(self.vae_in_slots[:rows], self.vae_in[:rows])

    def _pad_vae(self, rows: int) -> None:
        self.vae_in[:rows].zero_()
        self.vae_in_slots[:rows].fill_(self.scratch_slot)

    def _lane_audio(self, rows: int, result: DecodeResult) -> DecodeResult:
        """`result` with its audio: the step's VAE decode queued on the VAE lane behind its patches (without the
        lane the graph made it already). The main stream waits only for the previous lane decode to have read its
        inputs, before their buffers take this step's: a step's LMs and LocDiT take far longer than a VAE decode,
        so it is long done."""
        if result.audio is not None:
            return result
        assert self.vae_stream is not None and self.vae_graphs is not None
        main = torch.cuda.current_stream(self.device)
        if self._vae_read is not None:
            main.wait_event(self._vae_read)
        self.vae_in[:rows].copy_(result.patches[:rows])
        self.vae_in_slots[:rows].copy_(self.inputs.vae_slots[:rows])
        self.vae_stream.wait_stream(main)
        with torch.cuda.stream(self.vae_stream):
            audio = self.vae_graphs.replay(rows)
            self._vae_read = torch.cuda.Event()
            self._vae_read.record()
        return DecodeResult(result.patches, result.stops, audio)

    def _host_outputs(self, rows: int) -> DecodeResult:
        c = self.config
        return DecodeResult(torch.empty(rows, c.patch_size, c.feat_dim, pin_memory=True),
                            torch.empty(rows, dtype=torch.bool, pin_memory=True),
                            torch.empty(rows, c.samples_per_patch, pin_memory=True))

    # ---- LM graphs of small mixed steps -------------------------------------------------------------------------
    def allocate_flat(self, keys: list[tuple[int, ...]], eager: tuple[int, int] | None = None) -> None:
        """Static flat-batch buffers (and their pinned host mirror on CUDA) for LM graphs of these buckets (small
        (tokens, seqs) and large (tokens, seqs, audio rows) ones) and, with `eager` (the largest `eager_flat_key`),
        for eager mixed steps up to that size."""
        self.lm_keys, self.eager_flat = keys, eager
        sizes = keys + ([eager] if eager else [])
        tokens, seqs = max(k[0] for k in sizes), max(k[1] for k in sizes)
        audio = max((k[2] for k in keys if len(k) > 2), default=0)
        p, d, width = self.config.patch_size, self.config.feat_dim, self.staging.buffers.block_tables.shape[1]
        self.flat = FlatBuffers.allocate(tokens, seqs, p, d, width, self.device, audio_rows=audio)
        cuda = self.device.type == "cuda"
        for staging in self.stagings:  # one pinned mirror per staging: a step launched ahead stages into the other
            staging.flat = FlatBuffers.allocate(tokens, seqs, p, d, width, torch.device("cpu"), pin=True,
                                                audio_rows=audio) if cuda else self.flat
            staging.flat_arrays = {name: t.numpy() for name, t in vars(staging.flat).items()}

    @property
    def flat_host(self) -> FlatBuffers:
        """The current staging's flat batch."""
        assert self.staging.flat is not None, "allocate_flat first"
        return self.staging.flat

    @property
    def flat_np(self) -> dict[str, np.ndarray]:
        assert self.staging.flat_arrays is not None, "allocate_flat first"
        return self.staging.flat_arrays

    def flat_key(self, tokens: int, seqs: int) -> tuple[int, int] | None:
        """The padded flat batch of a mixed step: the smallest small LM graph bucket holding it, else its eager
        bucket when the buffers hold that; None: neither (the unpadded eager path). `stage_flat` may then pick a
        large LM graph instead of the eager bucket."""
        key = lm_graph_key(tokens, seqs, self.lm_keys)
        if key is None and self.eager_flat is not None:
            key = eager_flat_key(tokens, seqs)
            if key[0] > self.eager_flat[0] or key[1] > self.eager_flat[1]:
                return None
        return key

    def stage_flat(self, seqs: list[ScheduledSeq], fed: Container[int] = ()) -> tuple[int, ...] | None:
        """Stage the scheduled chunks into the flat buffers, padded to their bucket (`flat_key`, or a large LM
        graph's when one holds the chunks and their audio rows; the padding positions form one extra sequence in
        the scratch KV block); the bucket, or None when none holds them.
        `fed`: seqs (one audio position each) whose patch is still on the device: zeros here, fed in later."""
        tokens = sum(s.num_tokens for s in seqs)
        key = self.flat_key(tokens, len(seqs))
        if key is None:
            return None
        h, bs, pos = self.flat_np, self.block_size, 0
        for j, seq in enumerate(seqs):
            n, start, req = seq.num_tokens, seq.start, seq.request
            ids, patches, masks = ([0], self._zero_patch, [1]) if j in fed else req.inputs(start, start + n)
            at = np.arange(start, start + n)
            table = np.asarray(req.block_table)
            h["ids"][pos:pos + n], h["masks"][pos:pos + n], h["positions"][pos:pos + n] = ids, masks, at
            h["slots"][pos:pos + n] = table[at // bs] * bs + at % bs
            h["lora"][pos:pos + n] = req.lora_slot
            self.flat_host.patches[pos:pos + n].copy_(patches)
            h["cu_seqlens"][j], h["seq_lens"][j], h["last_index"][j] = pos, start + n, pos + n - 1
            h["block_tables"][j, :len(table)] = table
            pos += n
        if key not in self.lm_keys:
            key = self._large_key(pos, len(seqs)) or key
        self._stage_flat_padding(pos, len(seqs), key)
        return key

    def _large_key(self, tokens: int, seqs: int) -> tuple[int, int, int] | None:
        """The large LM graph for the staged flat batch, its audio rows listed for LocEnc; None: none holds it."""
        h = self.flat_np
        audio = np.flatnonzero(h["masks"][:tokens])
        key = large_lm_graph_key(tokens, seqs, len(audio), self.lm_keys)
        if key is not None and key[2]:
            h["audio_rows"][:len(audio)] = audio
            h["audio_rows"][len(audio):key[2]] = audio[0]  # a repeat writes the same LocEnc row again
        return key

    def _stage_flat_padding(self, tokens: int, seqs: int, key: tuple[int, ...]) -> None:
        """Positions [tokens, T) as sequence `seqs` (writing K/V only into the scratch block), empty sequences after."""
        total, rows = key[:2]
        h, q = self.flat_np, total - tokens
        for name in ("ids", "masks", "lora"):
            h[name][tokens:total] = 0
        h["positions"][tokens:total] = np.arange(q)
        h["slots"][tokens:total] = self.scratch_block * self.block_size
        self.flat_host.patches[tokens:total].zero_()
        h["cu_seqlens"][seqs:rows + 1] = total
        h["cu_seqlens"][seqs] = tokens
        h["seq_lens"][seqs:rows] = 0
        h["seq_lens"][seqs] = q
        h["block_tables"][seqs:rows, :-(-max(q, 1) // self.block_size)] = self.scratch_block
        h["last_index"][seqs:rows] = 0

    def _pad_flat(self, key: tuple[int, ...]) -> None:
        """Stage and upload an all-padding flat batch of bucket `key` (warm-up and graph capture only)."""
        self.staging.writable()
        self._stage_flat_padding(0, 0, key)
        if len(key) > 2:
            self.flat_np["audio_rows"][:key[2]] = 0
        self._upload_flat(key)

    def _upload_flat(self, key: tuple[int, ...]) -> None:
        if self.flat_host is not self.flat:
            self.flat.copy_(self.flat_host, key)
            self.staging.mark_uploaded()

    def lm_body(self, key: tuple[int, ...], eager: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Both LMs over the staged flat buffers of bucket `key` (what an LM graph captures); (lm_h, res_h) [S, H]
        with row j the state of scheduled sequence j (rows past the real sequences are padding). LocEnc runs on
        every row of a small graph's bucket, on the listed audio rows of a large one's (tokens, seqs, audio).

        `eager` (not captured): the attention grid and KV splits from the staged batch's real lengths, and LocEnc
        on its audio rows only (padded to a multiple of 64 with a repeat, so their GEMM shapes recur too)."""
        tokens, seqs = key[:2]
        f = self.flat
        if self.lora:
            self.model.set_lora_indices(tokens=f.lora[:tokens])
        max_q, max_k, audio_rows = tokens, self.max_positions, None
        query_rows = None
        if len(key) > 2:
            audio_rows = f.audio_rows[:key[2]]
            # the attention's query tile (its heuristic reads the batch shape, which a graph bucket of mostly empty
            # sequences misstates): large for prompts alone, small beside decode rows (audio rows), whose programs
            # would compute whole tiles for one query each (`TritonAttention.rows_for`)
            query_rows = PREFILL_ROWS[-1] if key[2] else PREFILL_ROWS[0]
        if eager or self.device.type != "cuda":
            h = self.flat_np
            max_q, max_k = int(np.diff(h["cu_seqlens"][:seqs + 1]).max()), int(h["seq_lens"][:seqs].max())
        if eager:
            audio = np.flatnonzero(h["masks"][:tokens])
            if len(audio):
                audio = np.concatenate((audio, np.full(-len(audio) % 64, audio[0])))
            audio_rows = self._device_index(audio)
        meta = AttentionMetadata(cu_seqlens_q=f.cu_seqlens[:seqs + 1], seq_lens=f.seq_lens[:seqs],
                                 slot_mapping=f.slots[:tokens], block_tables=f.block_tables[:seqs],
                                 max_seqlen_q=max_q, max_seqlen_k=max_k, query_rows=query_rows)
        return self.model.forward_lms(f.ids[:tokens], f.patches[:tokens].to(self.dtype), f.masks[:tokens],
                                      f.positions[:tokens], meta, self.caches, last_index=f.last_index[:seqs],
                                      audio_rows=audio_rows)

    def _forward_lms(self, seqs: list[ScheduledSeq], after: PendingStep | None = None,
                     fed: dict[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Both LMs over the flat batch of every scheduled chunk: an LM graph replay when a bucket holds it, else
        eagerly over the padded flat buffers, else (larger than those) unpadded; (lm_h, res_h) with row j the state
        of seqs[j] (at least len(seqs) rows). `fed` (`_fed_rows`): seqs whose input patch `after` sampled."""
        if self.lm_keys or self.eager_flat:  # CUDA (and CPU with async_mixed, or when a test allocates them)
            key = self.stage_flat(seqs, fed or {})
            if key is not None:
                self._upload_flat(key)
                if fed:
                    assert after is not None
                    first = np.cumsum([0] + [s.num_tokens for s in seqs])
                    self._gather(self.flat.patches, [int(first[k]) for k in fed], after, list(fed.values()))
                lm_graphs = self._graph_sets()[2]
                if lm_graphs is not None and key in lm_graphs.graphs:
                    return lm_graphs.replay(key)
                return self.lm_body(key, eager=key not in self.lm_keys)
        if fed:
            raise ValueError(f"a step launched ahead must fit the flat buffers (up to {self.eager_flat})")
        ids: list[int] = []
        masks: list[int] = []
        patches: list[torch.Tensor] = []
        positions: list[int] = []
        for seq in seqs:
            i, p, m = seq.request.inputs(seq.start, seq.start + seq.num_tokens)
            ids += i
            masks += m
            patches.append(p)
            positions.extend(range(seq.start, seq.start + seq.num_tokens))
        query_lens = [s.num_tokens for s in seqs]
        meta = AttentionMetadata.build(query_lens, [s.start for s in seqs],
                                       [s.request.block_table for s in seqs], self.block_size, self.device)
        dev = self.device
        if self.lora:
            slots = [s.request.lora_slot for s in seqs]
            self.model.set_lora_indices(tokens=torch.tensor(np.repeat(slots, query_lens), device=dev))
        last_index = torch.tensor(np.cumsum(query_lens) - 1, device=dev)
        # prefill is mostly text: LocEnc only where there is audio
        audio_rows = torch.tensor(np.flatnonzero(masks), dtype=torch.long, device=dev)
        lm_h, res_h = self.model.forward_lms(
            torch.tensor(ids, device=dev), torch.cat(patches).to(dev, self.dtype), torch.tensor(masks, device=dev),
            torch.tensor(positions, device=dev), meta, caches=self.caches, last_index=last_index,
            audio_rows=audio_rows)
        return lm_h, res_h

    def _eager_step(self, seqs: list[ScheduledSeq]) -> StepOutput:
        """The whole step eagerly, rows grouped by their timesteps, each group solved on its own (the reference that
        the GPU tests compare the graphed steps with; serving steps never take it)."""
        lm_h, res_h = self._forward_lms(seqs)
        dev = self.device
        out = StepOutput([None] * len(seqs), [False] * len(seqs), [None] * len(seqs))
        emit = [k for k, s in enumerate(seqs) if s.emit]
        if not emit:
            return out
        sampled = torch.empty(len(emit), self.config.patch_size, self.config.feat_dim, device=dev)
        by_steps: dict[int, list[int]] = {}
        for j, k in enumerate(emit):
            by_steps.setdefault(seqs[k].request.spec.params.timesteps, []).append(j)
        for timesteps, group in by_steps.items():
            reqs = [seqs[emit[j]].request for j in group]
            rows = torch.tensor([emit[j] for j in group], device=dev)
            cond = torch.stack([r.cond for r in reqs]).to(dev, self.dtype)
            noise = torch.stack([self.noise(r) for r in reqs]).to(dev, self.dtype)
            cfg = torch.tensor([r.spec.params.cfg_value for r in reqs], device=dev, dtype=self.dtype)
            if self.lora:
                self.model.set_lora_indices(seqs=torch.tensor([r.lora_slot for r in reqs], device=dev))
            sampled[group] = self.model.sample_patches(lm_h[rows], res_h[rows], cond, noise, timesteps, cfg).float()
        stops = self.model.stop_flags(lm_h[torch.tensor(emit, device=dev)]).tolist()
        audio = self.decode_audio([seqs[k].request for k in emit], sampled)
        patches_cpu = sampled.float().cpu()
        for j, k in enumerate(emit):
            out.patches[k], out.stops[k], out.audio[k] = patches_cpu[j], bool(stops[j]), audio[j]
        return out

    def noise(self, req) -> torch.Tensor:
        """[D, P] from the request's own generator, so a request's noise never depends on its batch."""
        p = req.spec.params
        return torch.randn(self.config.feat_dim, self.config.patch_size, generator=req.generator) * p.temperature

    def decode_audio(self, reqs: list, patches: torch.Tensor) -> np.ndarray:
        """One patch of audio per request, through each request's row of the streaming VAE state."""
        self._prime([r for r in reqs if not r.vae_primed])
        with self._on_vae_lane(join=True):
            slots = torch.tensor([r.vae_slot for r in reqs], device=self.vae_state.buffers[0].device)
            return self._vae_decode(slots, patches).cpu().numpy()

    def _vae_decode(self, slots: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        """[B, P, D] patches -> [B, samples] float32 audio, advancing the VAE state rows `slots`."""
        part = self.vae_state.gather(slots)
        latents = patches.to(self.vae_dtype).transpose(1, 2)  # [B, D, P]: P latent frames per patch
        audio = self.vae.decode_stream(latents, part)
        self.vae_state.scatter_(slots, part)
        return audio.reshape(patches.shape[0], -1).float()

    def _prime(self, reqs: list) -> None:
        """Start the requests' VAE rows from silence (one reset for all of them: a burst of new requests costs one
        launch per state buffer, not one per request), then replay each continuation's prompt tail into its row."""
        if not reqs:
            return
        dev = self.vae_state.buffers[0].device
        slots = torch.tensor([r.vae_slot for r in reqs])
        with self._on_vae_lane():  # in order with the lane's decodes, and the main stream never waits for it
            self.vae_state.reset_(slots.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else slots)
            for req in reqs:
                context = req.spec.context_patches
                if context is not None and len(context):
                    self._prime_context(req.vae_slot, context)
                req.vae_primed = True

    def _prime_context(self, slot: int, context: torch.Tensor) -> None:
        """Replay a continuation's prompt tail [k, P, D] into VAE row `slot` (its audio is the previous segment's)."""
        dev = self.vae_state.buffers[0].device
        rows = torch.full((1,), slot, device=dev)  # a fill on the device: a pageable copy would wait for the stream
        part = self.vae_state.gather(rows)
        if dev.type == "cuda":  # pinned, for the same reason
            context = context.pin_memory()
        latents = context.to(self.device, non_blocking=True).to(self.vae_dtype)
        latents = latents.reshape(1, -1, self.config.feat_dim).transpose(1, 2)
        self.vae.decode_stream(latents, part)
        self.vae_state.scatter_(rows, part)
