"""Batched multi-adapter LoRA: many adapters (and none) in one forward, Punica/S-LoRA style.

`attach_lora` gives every LoRA-capable linear of a VoxCPMModel stacked slot weights A [S, r_max, in] and
B [S, out, r_max] (ranks zero-padded to r_max, alpha/r folded into B; slot 0 is all zeros = no adapter) and a
forward hook adding `B[slot] (A[slot] x)` row by row. The linear itself is untouched (it may be any module with
in/out features, e.g. a tensor-parallel one), and the slot tensors are non-persistent buffers: state_dict names stay
the official ones and a model without `attach_lora` pays nothing.

Which slot a row uses comes from index tensors set once per step with `VoxCPMModel.set_lora_indices`:
- `tokens` [N]: one per flat LM position (both LMs' q/k/v/o, enc_to_lm_proj, fusion_concat_proj);
- `seqs` [B]: one per sampled sequence (lm_to_dit_proj, res_to_dit_proj);
- the LocDiT rows [2B] (CFG runs conditional then unconditional rows) are `cat(seqs, seqs)`, made in
  `sample_patches` so a CUDA graph captures it.
The hooks read whatever tensors are set, so a graph that captured static index buffers replays with new slots.

Targets follow the official `_apply_lora`: q/k/v/o (configurable names) of base_lm + residual_lm ("lm") and of the
LocDiT ("dit"), and the projections ("proj"); never the LocEnc.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from engine.model.layers import fused

LM_STACKS = ("base_lm", "residual_lm")
DIT_STACK = "feat_decoder.estimator.decoder"
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
PROJ_TARGETS = {"enc_to_lm_proj": "tokens", "fusion_concat_proj": "tokens",
                "lm_to_dit_proj": "seqs", "res_to_dit_proj": "seqs"}


@dataclass
class LoRAState:
    """Shared by every LoRA layer of one model: the slot layers by module path and this step's row slots."""

    num_slots: int  # including slot 0 (no adapter)
    max_rank: int
    layers: dict[str, LoRALayer] = field(default_factory=dict)
    tokens: Tensor | None = None
    seqs: Tensor | None = None
    dit: Tensor | None = None

    def rows(self, group: str) -> Tensor | None:
        return self.tokens if group == "tokens" else self.seqs if group == "seqs" else self.dit

    def begin_sampling(self) -> None:
        """The LocDiT's row slots for this step's 2B CFG rows."""
        self.dit = None if self.seqs is None else torch.cat((self.seqs, self.seqs))

    @torch.no_grad()
    def load_slot(self, slot: int, weights: dict[str, tuple[Tensor, Tensor]]) -> None:
        """Fill `slot` from {module path: (A [r_max, in], B [out, r_max] scaled)}; layers not named are zeroed."""
        if not 1 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range 1..{self.num_slots - 1}")
        unknown = set(weights) - set(self.layers)
        if unknown:
            raise ValueError(f"no LoRA layer named {sorted(unknown)[0]!r}")
        for path, layer in self.layers.items():
            if path in weights:
                a, b = weights[path]
                layer.lora_A[slot].copy_(a, non_blocking=True)
                layer.lora_B[slot].copy_(b, non_blocking=True)
            else:
                layer.lora_A[slot].zero_()
                layer.lora_B[slot].zero_()

    def clear_slot(self, slot: int) -> None:
        self.load_slot(slot, {})


class LoRALayer(nn.Module):
    """The slot weights of one linear and the batched delta it adds to the linear's output."""

    def __init__(self, in_features: int, out_features: int, state: LoRAState, group: str,
                 device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.state, self.group = state, group
        self.register_buffer("lora_A", torch.zeros(state.num_slots, state.max_rank, in_features, device=device,
                                                   dtype=dtype), persistent=False)
        self.register_buffer("lora_B", torch.zeros(state.num_slots, out_features, state.max_rank, device=device,
                                                   dtype=dtype), persistent=False)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        index = self.state.rows(self.group)
        if index is None:  # no indices set: the base model
            return y
        rows = index.shape[0]
        if x.shape[0] != rows:
            raise ValueError(f"LoRA {self.group} indices cover {rows} rows, the input has {x.shape[0]}")
        return lora_delta_add(y, x, self.lora_A, self.lora_B, index)


def lora_delta_add(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, index: Tensor) -> Tensor:
    """y + per-row LoRA of x: x [R, ..., in], y [R, ..., out], row r uses slot index[r] of A [S, r, in] and
    B [S, out, r]. CUDA: the Triton kernels, in place on y; elsewhere gather + bmm."""
    rows = index.shape[0]
    if fused(y):
        from engine.model.lora_triton import lora_add_

        x2 = x.reshape(-1, x.shape[-1])
        lora_add_(y.view(-1, y.shape[-1]), x2 if x2.stride(-1) == 1 else x2.contiguous(), lora_a, lora_b, index,
                  x2.shape[0] // max(rows, 1))
        return y
    x3 = x.reshape(rows, -1, x.shape[-1])
    t = torch.bmm(x3, lora_a[index].transpose(1, 2))
    return y + torch.bmm(t, lora_b[index].transpose(1, 2)).view_as(y)


def _add_lora(linear: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> Tensor:
    return linear.lora(args[0], out)


def lora_target_modules(model: nn.Module, lm: tuple[str, ...] = ATTENTION_TARGETS,
                        dit: tuple[str, ...] = ATTENTION_TARGETS, proj: bool = True
                        ) -> dict[str, tuple[nn.Module, str]]:
    """{module path: (linear, row group)} of every LoRA-capable linear (paths as in the official state_dict)."""
    found: dict[str, tuple[nn.Module, str]] = {}
    for stack, names, group in [(s, lm, "tokens") for s in LM_STACKS] + [(DIT_STACK, dit, "dit")]:
        for name, module in model.get_submodule(stack).named_modules():
            if name.rsplit(".", 1)[-1] in names and hasattr(module, "in_features"):
                found[f"{stack}.{name}"] = (module, group)
    if proj:
        for name, group in PROJ_TARGETS.items():
            module = getattr(model, name, None)
            if module is not None:
                found[name] = (module, group)
    return found


def attach_lora(model: nn.Module, num_adapters: int, max_rank: int, lm: tuple[str, ...] = ATTENTION_TARGETS,
                dit: tuple[str, ...] = ATTENTION_TARGETS, proj: bool = True) -> LoRAState:
    """Give `model` `num_adapters` LoRA slots (plus slot 0) of rank up to `max_rank` on its target linears."""
    if num_adapters < 1 or max_rank < 1:
        raise ValueError(f"attach_lora needs num_adapters >= 1 and max_rank >= 1 (got {num_adapters}, {max_rank})")
    if getattr(model, "lora", None) is not None:
        raise ValueError("this model already has LoRA slots")
    param = next(model.parameters())
    state = LoRAState(num_slots=num_adapters + 1, max_rank=max_rank)
    for path, (linear, group) in lora_target_modules(model, lm, dit, proj).items():
        layer = LoRALayer(linear.in_features, linear.out_features, state, group, param.device, param.dtype)
        linear.lora = layer
        linear.register_forward_hook(_add_lora)
        state.layers[path] = layer
    model.lora = state
    return state
