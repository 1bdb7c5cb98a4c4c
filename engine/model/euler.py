"""The CFM solver's Euler schedules, per row: one batch samples every row at its own `timesteps`.

A row's solve is `evaluations(timesteps)` LocDiT evaluations, each with its own time embedding and Euler step dt
(the first steps of the official schedule have velocity 0 under CFG-Zero*, so they leave x as it is and cost
nothing). `EulerSchedules` lays the evaluations of every served `timesteps` value out as the rows of one time
embedding table; a batch runs W evaluations, and row r's i-th evaluation reads embedding `index[r, i]` and steps by
`dt[r, i]`. A row with fewer evaluations steps by dt = 0 in the rest: x - 0 * v is x, so its patch is exactly its
own solve's, and its batch-mates' work is unchanged (the table lookup replaces the broadcast of one embedding; the
per-row dt replaces a scalar). A row with more continues from its state (`VoxCPMModel.continue_patches`) through
its remaining columns.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
from torch import Tensor

from engine.model.fusion import fused


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


def evaluations(timesteps: int) -> int:
    """LocDiT evaluations of one solve at `timesteps` (0 at timesteps 1: the patch is the noise)."""
    return timesteps - zero_velocity_steps(timesteps)


def cfg_zero_euler(x: Tensor, v: Tensor, cfg_value: Tensor, dt: Tensor) -> Tensor:
    """x - dt * CFG-Zero*(v): x [B, P, D] fp32, v [2B, P, D] (conditional rows, then unconditional), cfg_value and
    dt [B] fp32. Per item s = <vc, vu> / (|vu|^2 + 1e-8), v = vu s + w (vc - vu s). CUDA: one Triton kernel, in
    place."""
    if fused(x):
        from engine.kernels import cfg_zero_euler_

        return cfg_zero_euler_(x, v, cfg_value, dt)
    v = v.float()
    b = x.shape[0]
    v_cond, v_uncond = v[:b], v[b:]
    scale = (v_cond * v_uncond).sum((1, 2), keepdim=True) / (v_uncond.pow(2).sum((1, 2), keepdim=True) + 1e-8)
    v = v_uncond * scale + cfg_value.view(b, 1, 1) * (v_cond - v_uncond * scale)
    return x - dt.view(b, 1, 1) * v


@dataclass
class RowSteps:
    """Each row's Euler steps for one solve: evaluation i of row r embeds time `table[index[r, i]]` and steps x by
    `dt[r, i]` (0: the row's solve has ended, x stays)."""

    table: Tensor  # [N, H] time embeddings, in the LocDiT weights' dtype
    index: Tensor  # [B, W] int64
    dt: Tensor  # [B, W] fp32

    def rows(self, n: int) -> RowSteps:
        return RowSteps(self.table, self.index[:n], self.dt[:n])


class EulerSchedules:
    """The Euler evaluations of a set of `timesteps` values, as host rows (`row`) over one time table.

    `table(dit, device)` embeds them with the LocDiT's current weights; the runner makes its table once, before it
    captures graphs over it. The times go to the device on the first (eager) call: a CUDA graph cannot capture a
    host->device copy."""

    def __init__(self, values: Iterable[int], mean_mode: bool):
        self.values = tuple(sorted(set(values)))
        if not self.values or self.values[0] < 1:
            raise ValueError(f"timesteps values must be >= 1 (got {self.values})")
        self.width = max(evaluations(n) for n in self.values)
        t: list[float] = []
        dt_embed: list[float] = []  # the delta-time MLP's input: dt in mean mode, else 0 (as the official solver)
        # row v of each: value v's schedule (rows of values not served stay unused), so a step's rows are one
        # fancy index (`rows`)
        self.index_by_value = np.zeros((self.values[-1] + 1, self.width), dtype=np.int64)
        self.dt_by_value = np.zeros((self.values[-1] + 1, self.width), dtype=np.float32)
        self.evaluations_by_value = np.array([evaluations(n) for n in range(self.values[-1] + 1)], dtype=np.int64)
        for n in self.values:
            steps = euler_schedule(n)[zero_velocity_steps(n):]
            start = len(t)
            t += [s for s, _ in steps]
            dt_embed += [d if mean_mode else 0.0 for _, d in steps]
            index = self.index_by_value[n]
            index[:] = max(start + len(steps) - 1, 0)
            index[:len(steps)] = np.arange(start, start + len(steps))
            self.dt_by_value[n, :len(steps)] = [d for _, d in steps]
        self._t, self._dt_embed = t, dt_embed
        self._times: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self._device_rows: dict[tuple[int, torch.device], tuple[Tensor, ...]] = {}

    def row(self, timesteps: int) -> tuple[np.ndarray, np.ndarray]:
        """(index [W], dt [W]) of a row sampling at `timesteps` (KeyError: not one of `values`)."""
        if timesteps not in self.values:
            raise KeyError(f"timesteps {timesteps} is not among the served {self.values}")
        return self.index_by_value[timesteps], self.dt_by_value[timesteps]

    def table(self, dit: torch.nn.Module, device: torch.device) -> Tensor:
        """[N, H] time embeddings of every evaluation (of the weights as they are now: not cached)."""
        if device not in self._times:
            with torch.inference_mode(False), torch.no_grad():
                self._times[device] = (torch.tensor(self._t, device=device),
                                       torch.tensor(self._dt_embed, device=device))
        return dit.time_embedding(*self._times[device])

    def uniform(self, dit: torch.nn.Module, timesteps: int, batch: int, device: torch.device) -> RowSteps:
        """Every one of `batch` rows at `timesteps`: its row copied to `device` on the first (eager) call, then
        broadcast (so a later call, e.g. under CUDA graph capture, copies nothing)."""
        key = (timesteps, device)
        if key not in self._device_rows:
            with torch.inference_mode(False), torch.no_grad():
                self._device_rows[key] = tuple(torch.from_numpy(a).to(device) for a in self.row(timesteps))
        index, dt = self._device_rows[key]
        return RowSteps(self.table(dit, device), index.expand(batch, -1), dt.expand(batch, -1))
