"""The per-patch models: LocEnc (patch -> one vector), LocDiT (velocity field) and the CFM Euler solver.

Both run a small bidirectional MiniCPM stack over one patch's tokens, positions restarting at 0 for every patch.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor, nn

from engine.config import StackConfig
from engine.model.layers import TimestepMLP, fused, sinusoidal_embedding
from engine.model.minicpm import MiniCPM


class LocEnc(nn.Module):
    """[N, P, D] patches -> [N, H_enc]: a learned special token before the P projected frames, output = token 0."""

    def __init__(self, stack: StackConfig, feat_dim: int):
        super().__init__()
        self.special_token = nn.Parameter(torch.zeros(1, 1, 1, stack.hidden_size))
        self.in_proj = nn.Linear(feat_dim, stack.hidden_size)
        self.encoder = MiniCPM(stack)

    def forward(self, patches: Tensor) -> Tensor:
        x = self.in_proj(patches)
        x = torch.cat((self.special_token[0].expand(x.shape[0], 1, -1), x), dim=1)
        return self.encoder.forward_dense(x)[:, 0]


class LocDiT(nn.Module):
    """Velocity estimator. Tokens v1: [mu + t_emb, cond x P, x x P]; v2: [mu_0, mu_1, t_emb, cond x P, x x P].
    The output is the last P tokens."""

    def __init__(self, stack: StackConfig, feat_dim: int, mu_tokens: int):
        super().__init__()
        hidden = stack.hidden_size
        self.mu_tokens = mu_tokens
        self.in_proj = nn.Linear(feat_dim, hidden)
        self.cond_proj = nn.Linear(feat_dim, hidden)
        self.out_proj = nn.Linear(hidden, feat_dim)
        self.time_mlp = TimestepMLP(hidden)
        self.delta_time_mlp = TimestepMLP(hidden)
        self.decoder = MiniCPM(stack)

    def time_embedding(self, t: Tensor, dt: Tensor) -> Tensor:
        """Diffusion time t and step dt [K] (fp32) -> [K, H] in the weights' dtype."""
        dtype, hidden = self.in_proj.weight.dtype, self.in_proj.out_features
        return (self.time_mlp(sinusoidal_embedding(t, hidden).to(dtype))
                + self.delta_time_mlp(sinusoidal_embedding(dt, hidden).to(dtype)))

    def forward(self, x: Tensor, mu: Tensor, t_emb: Tensor, cond_h: Tensor) -> Tensor:
        """x [B, P, D]; mu [B, mu_tokens, H]; t_emb [B, H]; cond_h [B, P, H] = cond_proj(condition patch), the same
        for every evaluation of one solve, so the solver projects it once -> velocity [B, P, D]."""
        x = self.in_proj(x)
        if self.mu_tokens == 1:
            prefix = mu + t_emb[:, None]
        else:
            prefix = torch.cat((mu, t_emb[:, None]), dim=1)
        tokens = torch.cat((prefix, cond_h, x), dim=1)
        return self.out_proj(self.decoder.forward_dense(tokens, keep_last=x.shape[1]))


@cache
def euler_schedule(timesteps: int) -> tuple[tuple[float, float], ...]:
    """(t, dt) of every Euler step from t=1 to 0 on the official sway schedule `u + cos(pi u / 2) - 1 + u`,
    accumulated in fp32 exactly as the official solver steps it (t <- t - dt)."""
    span = torch.linspace(1, 0, timesteps + 1, dtype=torch.float32)
    span = span + (torch.cos(torch.pi / 2 * span) - 1 + span)
    t, dt = span[0], span[0] - span[1]
    steps = []
    for step in range(1, timesteps + 1):
        steps.append((t.item(), dt.item()))
        t = t - dt
        if step < timesteps:
            dt = t - span[step + 1]
    return tuple(steps)


def zero_velocity_steps(timesteps: int) -> int:
    """CFG-Zero*: the first steps use velocity 0 (n=10 -> 1 step, so 9 LocDiT evaluations)."""
    return max(1, int((timesteps + 1) * 0.04))


def cfg_zero_euler(x: Tensor, v: Tensor, cfg_value: Tensor, dt: float) -> Tensor:
    """x - dt * CFG-Zero*(v): x [B, P, D] fp32, v [2B, P, D] (conditional rows, then unconditional), cfg_value [B]
    fp32. Per item s = <vc, vu> / (|vu|^2 + 1e-8), v = vu s + w (vc - vu s). CUDA: one Triton kernel, in place."""
    if fused(x):
        from engine.kernels import cfg_zero_euler_

        return cfg_zero_euler_(x, v, cfg_value, dt)
    v = v.float()
    b = x.shape[0]
    v_cond, v_uncond = v[:b], v[b:]
    scale = (v_cond * v_uncond).sum((1, 2), keepdim=True) / (v_uncond.pow(2).sum((1, 2), keepdim=True) + 1e-8)
    v = v_uncond * scale + cfg_value.view(b, 1, 1) * (v_cond - v_uncond * scale)
    return x - dt * v


class CFM(nn.Module):
    """Conditional flow matching sampler around the LocDiT (named `feat_decoder` with an `estimator`, as released)."""

    def __init__(self, estimator: LocDiT, mean_mode: bool):
        super().__init__()
        self.estimator = estimator
        self.mean_mode = mean_mode
        self._time_tables: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}

    def _times(self, timesteps: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """(t, dt) [K] fp32 of the K evaluated Euler steps (dt 0 unless mean mode), made once per (timesteps,
        device) on the first, eager call: a host->device copy cannot be captured in a CUDA graph."""
        key = (timesteps, device)
        if key not in self._time_tables:
            steps = euler_schedule(timesteps)[zero_velocity_steps(timesteps):]
            with torch.inference_mode(False), torch.no_grad():
                self._time_tables[key] = (torch.tensor([t for t, _ in steps], device=device),
                                          torch.tensor([dt if self.mean_mode else 0.0 for _, dt in steps],
                                                       device=device))
        return self._time_tables[key]

    def solve(self, noise: Tensor, mu: Tensor, cond: Tensor, timesteps: int, cfg_value: Tensor) -> Tensor:
        """Euler solve from t=1 to 0 with CFG-Zero*. noise, cond [B, P, D]; mu [B, mu_tokens, H]; cfg_value [B].

        Each evaluation is one LocDiT batch of 2B (conditional, then unconditional with mu = 0) sharing x, t and
        cond. The state and the guidance arithmetic stay fp32 at any weight dtype. Returns [B, P, D] fp32."""
        if timesteps < 1:
            raise ValueError(f"timesteps must be >= 1 (got {timesteps})")
        dit = self.estimator
        dtype = dit.in_proj.weight.dtype
        b = noise.shape[0]
        x = noise.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # updated in place on CUDA
        mu2 = torch.cat((mu, torch.zeros_like(mu)), dim=0).to(dtype)
        cond_h = dit.cond_proj(torch.cat((cond, cond), dim=0).to(dtype))  # once, not once per evaluation
        w = cfg_value.to(x.device, torch.float32)
        steps = euler_schedule(timesteps)[zero_velocity_steps(timesteps):]  # the skipped steps' v = 0 keeps x
        # every evaluation's time embedding in one batched MLP call (the schedule is known up front)
        t_embs = dit.time_embedding(*self._times(timesteps, x.device))
        for i, (_, dt) in enumerate(steps):
            v = dit(torch.cat((x, x), dim=0).to(dtype), mu2, t_embs[i].expand(2 * b, -1), cond_h)
            x = cfg_zero_euler(x, v, w, dt)
        return x
