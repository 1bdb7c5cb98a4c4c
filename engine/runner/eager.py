"""The eager step: the whole step op by op, the reference the GPU tests compare the graphed steps with."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.runner.records import StepOutput
from engine.runner.vae_lane import VaeLane
from engine.scheduler import ScheduledSeq

ForwardLms = Callable[[list[ScheduledSeq]], tuple[torch.Tensor, torch.Tensor]]


def noise(req, feat_dim: int, patch_size: int) -> torch.Tensor:
    """[D, P] from the request's own generator, so a request's noise never depends on its batch."""
    return torch.randn(feat_dim, patch_size, generator=req.generator) * req.spec.params.temperature


class EagerStep:
    """The whole step eagerly, rows grouped by their timesteps, each group solved on its own (the reference that
    the GPU tests compare the graphed steps with; serving steps never take it). `forward_lms`: both LMs over the
    step's flat batch, (lm_h, res_h) with row j the state of seqs[j]."""

    def __init__(self, model: torch.nn.Module, lane: VaeLane, forward_lms: ForwardLms, *, patch_size: int,
                 feat_dim: int, lora: bool):
        self.model, self.lane, self.forward_lms = model, lane, forward_lms
        self.patch_size, self.feat_dim, self.lora = patch_size, feat_dim, lora
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype

    def __call__(self, seqs: list[ScheduledSeq]) -> StepOutput:
        lm_h, res_h = self.forward_lms(seqs)
        dev = self.device
        out = StepOutput([None] * len(seqs), [False] * len(seqs), [None] * len(seqs))
        emit = [k for k, s in enumerate(seqs) if s.emit]
        if not emit:
            return out
        sampled = torch.empty(len(emit), self.patch_size, self.feat_dim, device=dev)
        by_steps: dict[int, list[int]] = {}
        for j, k in enumerate(emit):
            by_steps.setdefault(seqs[k].request.spec.params.timesteps, []).append(j)
        for timesteps, group in by_steps.items():
            reqs = [seqs[emit[j]].request for j in group]
            rows = torch.tensor([emit[j] for j in group], device=dev)
            cond = torch.stack([r.cond for r in reqs]).to(dev, self.dtype)
            noises = torch.stack([noise(r, self.feat_dim, self.patch_size) for r in reqs]).to(dev, self.dtype)
            cfg = torch.tensor([r.spec.params.cfg_value for r in reqs], device=dev, dtype=self.dtype)
            if self.lora:
                self.model.set_lora_indices(seqs=torch.tensor([r.lora_slot for r in reqs], device=dev))
            sampled[group] = self.model.sample_patches(lm_h[rows], res_h[rows], cond, noises, timesteps, cfg).float()
        stops = self.model.stop_flags(lm_h[torch.tensor(emit, device=dev)]).tolist()
        audio = self.lane.decode_audio([seqs[k].request for k in emit], sampled)
        patches_cpu = sampled.float().cpu()
        for j, k in enumerate(emit):
            out.patches[k], out.stops[k], out.audio[k] = patches_cpu[j], bool(stops[j]), audio[j]
        return out
