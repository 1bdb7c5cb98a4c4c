"""Sizing the KV cache: what the weights, buffers, activations and graphs leave of the GPU."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.cuda_graphs import (
    LARGE_LM_GRAPH_TOKENS,
    eager_flat_key,
)
from engine.model.attention import AttentionMetadata, KVCache

if TYPE_CHECKING:
    from engine.worker import WorkerConfig

log = logging.getLogger(__name__)

CPU_KV_BLOCKS = 1024
GiB = 2**30
MEMORY_MARGIN = GiB // 2  # cuBLAS/Triton workspaces and allocator fragmentation beyond the measured peaks
GRAPH_POOL_FACTOR = 2.5


class MemoryBudget:
    """Sizing the KV cache (a part of `Runner`)."""

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
        if self.vae_lane.stream is not None:
            self.vae_lane.pad(cfg.max_num_seqs)
            vae = peak(lambda: self.vae_lane.body(cfg.max_num_seqs))
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
