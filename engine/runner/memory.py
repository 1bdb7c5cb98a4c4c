"""Sizing the KV cache: what the weights, buffers, activations and graphs leave of the GPU."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.cuda_graphs import (
    LARGE_LM_GRAPH_TOKENS,
    eager_flat_key,
)
from engine.model.attention import AttentionMetadata, KVCache
from engine.runner.vae_lane import VaeLane

if TYPE_CHECKING:
    from engine.config import ModelConfig, StackConfig
    from engine.worker import WorkerConfig

log = logging.getLogger(__name__)

CPU_KV_BLOCKS = 1024
GiB = 2**30
MEMORY_MARGIN = GiB // 2  # cuBLAS/Triton workspaces and allocator fragmentation beyond the measured peaks
GRAPH_POOL_FACTOR = 2.5


@dataclass
class Activations:
    """How the memory budget runs the steps it measures: `install` puts scratch KV caches in place (the decode
    step reads them; None: takes them out again), `pad_decode` stages an all-padding decode step of every row and
    `decode` runs it; `lane`: the VAE lane, measured apart when it has a stream."""

    install: Callable[[tuple[KVCache, ...] | None], None]
    pad_decode: Callable[[], None]
    decode: Callable[[], object]
    lane: VaeLane


class MemoryBudget:
    """Sizing the KV cache: what `gpu_memory_utilization` leaves after the weights, the measured peaks of the
    largest eager steps, the graphs' memory pool and a margin (`memory`: the figures, for the log and the stats)."""

    def __init__(self, model: torch.nn.Module, kv_stacks: tuple[StackConfig, ...], block_size: int,
                 config: ModelConfig):
        self.model, self.kv_stacks, self.block_size, self.config = model, kv_stacks, block_size, config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.memory: dict[str, float] = {}

    def bytes_per_block(self) -> int:
        return self.block_size * 2 * self.dtype.itemsize * sum(
            s.num_hidden_layers * s.num_key_value_heads * s.head_dim for s in self.kv_stacks)

    def blocks(self, cfg: WorkerConfig, weights: int, run: Activations, graph_sets: int) -> int:
        """KV blocks that fit; `graph_sets`: the decode graph sets captured (with LoRA the adapter-free ones too,
        and the step tail's)."""
        mixed, decode, vae = self.measure(cfg, run)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # The graph pool holds the decode steps' intermediates for good, beside the eager steps' peak: about twice
        # the largest step's peak (every bucket keeps its outputs; captures fragment it). The VAE lane's graphs
        # have a pool of their own.
        graphs = GRAPH_POOL_FACTOR * (decode * graph_sets + vae)
        if cfg.cuda_graphs:  # the large LM graphs' intermediates: the mixed peak scaled to their largest bucket
            graphs += mixed * min(1.0, LARGE_LM_GRAPH_TOKENS / eager_flat_key(cfg.max_num_batched_tokens, 0)[0])
        eager = max(mixed, decode, vae)
        budget = total * cfg.gpu_memory_utilization - (total - free) - eager - graphs - MEMORY_MARGIN
        self.memory.update(weights_gib=weights / GiB, eager_peak_gib=eager / GiB,
                           graph_estimate_gib=graphs / GiB, total_gib=total / GiB)
        blocks = int(budget // self.bytes_per_block())
        if blocks < 1:
            raise MemoryError(f"no room for the KV cache: gpu_memory_utilization {cfg.gpu_memory_utilization} "
                              f"leaves {budget / GiB:.1f} GiB after weights, activations and CUDA graphs")
        return blocks

    @torch.inference_mode()
    def measure(self, cfg: WorkerConfig, run: Activations) -> tuple[int, int, int]:
        """Peak bytes of (a prefill step of max_num_batched_tokens tokens, a decode step of max_num_seqs rows, the
        VAE lane's decode of as many: 0 without the lane, where the decode step holds it), run eagerly on a scratch
        KV cache that every sequence shares (prefill at its padded eager bucket's size)."""
        tokens = eager_flat_key(cfg.max_num_batched_tokens, 0)[0]
        seqs = min(cfg.max_num_seqs, tokens)
        lens = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
        blocks = -(-max(lens) // self.block_size)
        caches = tuple(KVCache.allocate(stack, blocks, self.block_size, self.device, self.dtype)
                       for stack in self.kv_stacks)
        run.install(caches)
        meta = AttentionMetadata.build(lens, [0] * seqs, [list(range(blocks))] * seqs, self.block_size, self.device)
        p, d = self.config.patch_size, self.config.feat_dim
        dev = self.device

        def peak(step: Callable[[], object]) -> int:
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            step()
            torch.cuda.synchronize(dev)
            return torch.cuda.max_memory_allocated(dev) - base

        mixed = peak(lambda: self.model.forward_lms(
            torch.zeros(tokens, dtype=torch.long, device=dev), torch.zeros(tokens, p, d, device=dev, dtype=self.dtype),
            torch.zeros(tokens, dtype=torch.long, device=dev), meta.positions().long(), meta, caches,
            torch.tensor(np.cumsum(lens) - 1, device=dev)))
        run.pad_decode()
        decode = peak(run.decode)
        vae = 0
        if run.lane.stream is not None:
            run.lane.pad(cfg.max_num_seqs)
            vae = peak(lambda: run.lane.body(cfg.max_num_seqs))
        run.install(None)
        return mixed, decode, vae

    def log(self, cfg: WorkerConfig, weights: int, num_blocks: int) -> None:
        """One line: where the GPU's memory went."""
        block_bytes = self.bytes_per_block()
        positions = num_blocks * self.block_size
        self.memory.update(kv_gib=num_blocks * block_bytes / GiB, kv_blocks=num_blocks,
                           kv_positions=positions, weights_gib=weights / GiB,
                           allocated_gib=torch.cuda.memory_allocated(self.device) / GiB,
                           reserved_gib=torch.cuda.memory_reserved(self.device) / GiB)
        streams = positions // max(1, 512)
        m = self.memory
        log.info("GPU memory: weights %.2f GiB, CUDA graphs %.2f GiB (estimated %.2f), eager activation peak "
                 "%.2f GiB, KV cache %.2f GiB = %d blocks x %d positions (%d streams of 512 positions); reserved "
                 "%.2f of %.2f GiB at utilization %.2f", m["weights_gib"], m.get("graphs_gib", 0.0),
                 m.get("graph_estimate_gib", 0.0), m.get("eager_peak_gib", 0.0), m["kv_gib"], num_blocks,
                 self.block_size, streams, m["reserved_gib"], m.get("total_gib", 0.0), cfg.gpu_memory_utilization)
