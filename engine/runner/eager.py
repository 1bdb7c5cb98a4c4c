"""The eager step: the whole step op by op, the reference the GPU tests compare the graphed steps with."""

from __future__ import annotations

import torch

from engine.runner.records import StepOutput
from engine.scheduler import ScheduledSeq


class EagerPath:
    """The eager step (a part of `Runner`)."""

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
