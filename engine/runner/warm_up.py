"""Warm-up: every graph captured and every kernel specialisation compiled before serving."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from engine.cuda_graphs import eager_flat_token_buckets
from engine.model.attention import AttentionMetadata, KVCache
from engine.prompt import CONTEXT_PATCHES
from engine.runner.vae_lane import PRIME_BATCHES, VaeLane

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.model.euler import EulerSchedules

log = logging.getLogger(__name__)


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


@dataclass
class WarmUp:
    """What the warm-up runs on: the model, the VAE lane, the KV caches (it writes into their scratch block only),
    the served Euler schedules, and `flat_step`, which stages an all-padding flat batch of an eager bucket (tokens,
    seqs) and runs both LMs over it eagerly (`eager_tokens`: the largest such batch; None without flat buffers)."""

    model: torch.nn.Module
    lane: VaeLane
    caches: tuple[KVCache, ...]
    schedules: EulerSchedules
    config: ModelConfig
    block_size: int
    scratch_block: int
    max_positions: int
    timesteps: int
    lora: bool
    eager_tokens: int | None
    flat_step: Callable[[tuple[int, int]], object]

    # Flat-batch shapes of the eager steps, (positions per sequence, block-table width): Triton specializes integer
    # arguments on == 1 and divisibility by 16 (token counts in RoPE and LoRA, the block-table stride in attention),
    # so these cover every class a serving step can hit; each new class would otherwise compile inside a step.
    WARM_SHAPES: ClassVar = ((1, 1), (16, 1), (17, 2), (16, 16), (5, 17), (16, 33))
    WARM_SEQS: ClassVar = (1, 2, 3)
    WARM_EAGER_TOKENS: ClassVar = 8192

    @torch.inference_mode()
    def run(self) -> None:
        """Compile every kernel specialization the eager paths can reach, at engine start: both LMs over flat
        batches of each shape class (into the scratch KV block), and sampling + VAE at each row-count class (into
        the scratch VAE row). Costs a few seconds once; a serving step then never waits for the compiler."""
        before = triton_compiles()
        param = next(self.model.parameters())
        dev, dtype, p, d = param.device, param.dtype, self.config.patch_size, self.config.feat_dim
        bs, lane = self.block_size, self.lane
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
                                       torch.zeros(n, p, d, device=dev, dtype=dtype), mask,
                                       meta.positions().long(), meta, self.caches,
                                       torch.arange(q - 1, n, q, device=dev))
        for rows in (1, 2, 16, 17):
            h = torch.zeros(rows, self.config.lm.hidden_size, device=dev, dtype=dtype)
            if self.lora:
                self.model.set_lora_indices(seqs=torch.zeros(rows, dtype=torch.long, device=dev))
            sampled = self.model.sample_patches(h, h, torch.zeros(rows, p, d, device=dev, dtype=dtype),
                                                torch.randn(rows, d, p, device=dev, dtype=dtype),
                                                self.schedules.uniform(self.model.feat_decoder.estimator,
                                                                       self.timesteps, rows, dev),
                                                torch.full((rows,), 2.0, device=dev, dtype=dtype))
            self.model.stop_flags(h)
            with lane.on_lane(join=True):
                slots = torch.full((rows,), lane.scratch_slot, device=lane.state.buffers[0].device)
                lane.decode(slots, sampled)
        # eager mixed steps: every flat bucket up to WARM_EAGER_TOKENS once, all padding (one sequence in the scratch
        # block), so each GEMM shape has met cuBLAS before a step does (larger ones come in bursts whose GPU work
        # hides that first meeting)
        if self.eager_tokens is not None:
            for tokens in eager_flat_token_buckets(min(self.eager_tokens, self.WARM_EAGER_TOKENS, self.max_positions)):
                self.flat_step((tokens, 16))
        # continuations prime their VAE rows with the prompt's last 1..CONTEXT_PATCHES patches, eagerly, a batch
        # padded to one of PRIME_BATCHES: shapes whose kernels (Triton specializations, ~1 s to compile) the decodes
        # above never run
        with lane.on_lane(join=True):
            for k in range(1, CONTEXT_PATCHES[self.config.architecture] + 1):
                for batch in PRIME_BATCHES:
                    lane.prime_contexts([lane.scratch_slot] * batch, [torch.zeros(k, p, d)] * batch)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        log.info("warm-up: %d Triton kernel specializations compiled (%d in all)", triton_compiles() - before,
                 triton_compiles())
