"""Runs one scheduled step on the device: flat LM batch -> patches -> stop flags -> streaming VAE.

The runner owns everything that lives on the device: the model, both paged KV caches (base and residual LM share
block tables), and one VAE stream state with a row per request slot. On CPU the KV pool has a fixed number of
blocks; on a GPU it takes what `gpu_memory_utilization` leaves after the weights and an activation reserve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.model.attention import AttentionMetadata, KVCache
from engine.scheduler import ScheduledSeq

if TYPE_CHECKING:
    from engine.checkpoint import LoadedModel
    from engine.worker import WorkerConfig

CPU_KV_BLOCKS = 1024


@dataclass
class StepOutput:
    """Aligned with the scheduled seqs; None where a seq only prefilled."""

    patches: list[torch.Tensor | None]  # [P, D] float32 on CPU
    stops: list[bool]
    audio: list[np.ndarray | None]  # float32 mono, one patch


class Runner:
    def __init__(self, loaded: LoadedModel, cfg: WorkerConfig):
        self.config = loaded.config
        self.model, self.vae = loaded.model, loaded.vae
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.vae_dtype = next(self.vae.parameters()).dtype
        self.block_size = cfg.block_size
        self.num_blocks = cfg.num_kv_blocks or self._blocks_from_budget(cfg)
        self.caches = tuple(KVCache.allocate(stack, self.num_blocks, self.block_size, self.device, self.dtype)
                            for stack in (self.config.lm, self.config.residual_lm))
        self.vae_state = self.vae.stream_state(cfg.max_num_seqs)

    def _blocks_from_budget(self, cfg: WorkerConfig) -> int:
        if self.device.type != "cuda":
            return CPU_KV_BLOCKS
        free, total = torch.cuda.mem_get_info(self.device)
        # Activations of the largest step (prefill tokens, DiT CFG batch, VAE) are reserved up front, so the
        # configured fraction holds without a profiling run.
        reserve = 2 * 2**30 + cfg.max_num_batched_tokens * self.config.lm.hidden_size * 64
        budget = total * cfg.gpu_memory_utilization - (total - free) - reserve
        bytes_per_block = self.block_size * 2 * self.dtype.itemsize * sum(
            s.num_hidden_layers * s.num_key_value_heads * s.head_dim
            for s in (self.config.lm, self.config.residual_lm))
        blocks = int(budget // bytes_per_block)
        if blocks < 1:
            raise MemoryError(f"no room for the KV cache: gpu_memory_utilization {cfg.gpu_memory_utilization} "
                              f"leaves {budget / 2**30:.1f} GiB after weights and activations")
        return blocks

    @torch.inference_mode()
    def step(self, seqs: list[ScheduledSeq]) -> StepOutput:
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
        last_index = torch.tensor(np.cumsum(query_lens) - 1, device=dev)
        lm_h, res_h = self.model.forward_lms(
            torch.tensor(ids, device=dev), torch.cat(patches).to(dev, self.dtype), torch.tensor(masks, device=dev),
            torch.tensor(positions, device=dev), meta, caches=self.caches, last_index=last_index)

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
        for req in reqs:
            if not req.vae_primed:
                self._prime(req)
        slots = torch.tensor([r.vae_slot for r in reqs], device=self.vae_state.buffers[0].device)
        part = self.vae_state.gather(slots)
        latents = patches.to(self.vae_dtype).transpose(1, 2)  # [B, D, P]: P latent frames per patch
        audio = self.vae.decode_stream(latents, part)
        self.vae_state.scatter_(slots, part)
        return audio.reshape(len(reqs), -1).float().cpu().numpy()

    def _prime(self, req) -> None:
        """Start the request's VAE row from silence, or from its prompt's last patches (seamless continuation)."""
        slot = torch.tensor([req.vae_slot], device=self.vae_state.buffers[0].device)
        self.vae_state.reset_(slot)
        context = req.spec.context_patches
        if context is not None and len(context):
            part = self.vae_state.gather(slot)
            latents = context.to(self.device, self.vae_dtype).reshape(1, -1, self.config.feat_dim).transpose(1, 2)
            self.vae.decode_stream(latents, part)
            self.vae_state.scatter_(slot, part)
        req.vae_primed = True

    @torch.inference_mode()
    def encode_audio(self, audio: np.ndarray, sample_rate: int, pad: str) -> torch.Tensor:
        """Prompt or reference audio -> patches [T, P, D] float32 on CPU."""
        from engine.prompt import encode_prompt_audio

        patches = encode_prompt_audio(self.vae, audio, sample_rate, patch_size=self.config.patch_size, pad=pad)
        return patches.float().cpu()
