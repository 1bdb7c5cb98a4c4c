"""The per-patch models: LocEnc (patch -> one vector), LocDiT (velocity field) and the CFM Euler solver (its
per-row schedules: `engine.model.euler`).

Both run a small bidirectional MiniCPM stack over one patch's tokens, positions restarting at 0 for every patch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from engine.config import StackConfig
from engine.model.euler import EulerSchedules, RowSteps, cfg_zero_euler
from engine.model.layers import TimestepMLP, sinusoidal_embedding
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


class CFM(nn.Module):
    """Conditional flow matching sampler around the LocDiT (named `feat_decoder` with an `estimator`, as released)."""

    def __init__(self, estimator: LocDiT, mean_mode: bool):
        super().__init__()
        self.estimator = estimator
        self.mean_mode = mean_mode
        self._schedules: dict[int, EulerSchedules] = {}

    def schedules(self, values: Iterable[int]) -> EulerSchedules:
        """The Euler schedules of these `timesteps` values (one time table over all of them: `EulerSchedules`)."""
        return EulerSchedules(values, self.mean_mode)

    def uniform_steps(self, timesteps: int, batch: int, device: torch.device) -> RowSteps:
        """`batch` rows at `timesteps` (eager callers: the single-request path, tests, benchmarks)."""
        if timesteps < 1:
            raise ValueError(f"timesteps must be >= 1 (got {timesteps})")
        if timesteps not in self._schedules:
            self._schedules[timesteps] = self.schedules((timesteps,))
        return self._schedules[timesteps].uniform(self.estimator, timesteps, batch, device)

    def solve(self, noise: Tensor, mu: Tensor, cond: Tensor, steps: RowSteps, cfg_value: Tensor) -> Tensor:
        """Euler solve from t=1 to 0 with CFG-Zero*, each row on its own schedule (`RowSteps`). noise, cond
        [B, P, D]; mu [B, mu_tokens, H]; cfg_value [B].

        Each evaluation is one LocDiT batch of 2B (conditional, then unconditional with mu = 0) sharing x, t and
        cond. The state and the guidance arithmetic stay fp32 at any weight dtype. Returns [B, P, D] fp32."""
        dit = self.estimator
        dtype = dit.in_proj.weight.dtype
        x = noise.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # updated in place on CUDA
        mu2 = torch.cat((mu, torch.zeros_like(mu)), dim=0).to(dtype)
        cond_h = dit.cond_proj(torch.cat((cond, cond), dim=0).to(dtype))  # once, not once per evaluation
        w = cfg_value.to(x.device, torch.float32)
        # evaluation i's embedding row for each of the 2B LocDiT rows, contiguous per evaluation
        index = torch.cat((steps.index, steps.index), dim=0).t().contiguous()
        dt = steps.dt.t().contiguous()
        for i in range(index.shape[0]):
            v = dit(torch.cat((x, x), dim=0).to(dtype), mu2, steps.table.index_select(0, index[i]), cond_h)
            x = cfg_zero_euler(x, v, w, dt[i])
        return x
