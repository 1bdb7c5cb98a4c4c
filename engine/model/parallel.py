"""Tensor parallelism for the three big stacks (base LM, residual LM, LocDiT): attention heads and MLP width.

Applied after the model is built and its whole checkpoint loaded: every rank slices the existing linears in place,
so checkpoint loading is the same at any tp size. Megatron layout: q/k/v and gate/up are column-parallel (rank r
keeps its heads, its share of the FFN width), o and down are row-parallel (rank r keeps the matching input columns)
and their partial sums meet in one all-reduce each. The KV heads split evenly too (VoxCPM2: 2 -> 1 per rank, head
h of rank r still reads the KV head it reads unsharded), so each rank's paged KV cache holds only its own KV heads.

LocEnc, the projections, FSQ, the stop head and the AudioVAE are small and stay replicated: every rank computes them
on identical inputs, and an all-reduce leaves identical sums on every rank, so all activations outside the sharded
blocks are identical across ranks.

A linear wrapped by an adapter (LoRA) is sharded through the wrapper's `shard_(dim, start, stop)` when it has one
(it slices its base weight and its own factors: B's rows for column-parallel, A's columns for row-parallel), so the
wrapper's whole output, adapter delta included, is summed by the row-parallel all-reduce around it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor, nn

from engine.config import ModelConfig, StackConfig


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's partial output, summed over the group."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        out = self.inner(x)
        dist.all_reduce(out, group=self.group)
        return out


def sharded_stacks(config: ModelConfig) -> dict[str, StackConfig]:
    return {"base_lm": config.lm, "residual_lm": config.residual_lm, "LocDiT": config.dit_lm}


def check_tensor_parallel(config: ModelConfig, world: int) -> None:
    """ValueError unless every sharded stack splits evenly into `world` ranks."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1 (got {world})")
    for name, s in sharded_stacks(config).items():
        for what, n in (("attention heads", s.num_attention_heads), ("KV heads", s.num_key_value_heads),
                        ("MLP width", s.intermediate_size)):
            if n % world:
                raise ValueError(f"tensor_parallel_size {world} does not divide the {name}'s {n} {what}")


def local_kv_stack(stack: StackConfig, world: int) -> StackConfig:
    """The stack as one rank's KV cache sees it: only its share of the KV heads."""
    return dataclasses.replace(stack, num_key_value_heads=stack.num_key_value_heads // world)


def shard_model(model: nn.Module, rank: int, world: int, group: dist.ProcessGroup) -> None:
    """Keep rank `rank`'s shard of every sharded stack of a loaded `VoxCPMModel`, in place."""
    check_tensor_parallel(model.config, world)
    stacks = {"base_lm": model.base_lm, "residual_lm": model.residual_lm,
              "LocDiT": model.feat_decoder.estimator.decoder}
    for name, stack in stacks.items():
        ffn = sharded_stacks(model.config)[name].intermediate_size // world
        for layer in stack.layers:
            attn = layer.self_attn
            q, kv = attn.heads // world * attn.head_dim, attn.kv_heads // world * attn.head_dim
            _slice(attn.q_proj, 0, rank * q, (rank + 1) * q)
            _slice(attn.k_proj, 0, rank * kv, (rank + 1) * kv)
            _slice(attn.v_proj, 0, rank * kv, (rank + 1) * kv)
            _slice(attn.o_proj, 1, rank * q, (rank + 1) * q)
            attn.o_proj = RowParallel(attn.o_proj, group)
            attn.heads, attn.kv_heads = attn.heads // world, attn.kv_heads // world
            mlp = layer.mlp
            _slice(mlp.gate_proj, 0, rank * ffn, (rank + 1) * ffn)
            _slice(mlp.up_proj, 0, rank * ffn, (rank + 1) * ffn)
            _slice(mlp.down_proj, 1, rank * ffn, (rank + 1) * ffn)
            mlp.down_proj = RowParallel(mlp.down_proj, group)
    model.tp_rank, model.tp_size, model.tp_group = rank, world, group


def tp_size(model: nn.Module) -> int:
    return getattr(model, "tp_size", 1)


def agree_min(model: nn.Module, value: int, device: torch.device) -> int:
    """The smallest `value` over the model's tensor-parallel group (every rank must size its KV cache alike)."""
    if tp_size(model) == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=model.tp_group)
    return int(t.item())


def _slice(module: nn.Module, dim: int, start: int, stop: int) -> None:
    """Keep rows (dim 0, output features) or columns (dim 1, input features) [start, stop) of a linear."""
    if hasattr(module, "shard_"):
        module.shard_(dim, start, stop)
        return
    if not isinstance(module, nn.Linear):
        raise TypeError(f"cannot shard a {type(module).__name__}: not a Linear and no shard_(dim, start, stop)")
    with torch.no_grad():
        module.weight = nn.Parameter(module.weight.narrow(dim, start, stop - start).clone(), requires_grad=False)
        if module.bias is not None and dim == 0:
            module.bias = nn.Parameter(module.bias[start:stop].clone(), requires_grad=False)
        elif module.bias is not None:  # a row-parallel bias is added once, after the sum
            raise ValueError("row-parallel linears with a bias are not supported")
    module.out_features, module.in_features = module.weight.shape
