"""LoRA adapters at run time: reading and checking them (caller's process), and the worker's GPU slot cache.

An adapter is what official VoxCPM fine-tuning saves: `lora_weights.safetensors` (official state_dict names ending
in `.lora_A` [r, in] / `.lora_B` [out, r]) beside `lora_config.json` (`{"lora_config": {"r", "alpha", ...}}`, or
the LoRAConfig fields at top level). `load_adapter` checks every tensor against the model's LoRA targets and
returns float32 CPU weights; every problem is an `InvalidLoRA` naming it.

`AdapterSlots` (one per worker) keeps every registered adapter in host memory (pinned on CUDA), padded to the max
rank with alpha/r folded into B, and copies it into one of the model's GPU slots when a request needs it. Slots are
reference-counted by the requests that hold them (admission acquires, finish/preemption releases); an unreferenced
slot is evicted least recently used first.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engine.config import ModelConfig
from engine.errors import InvalidLoRA
from engine.model.lora import ATTENTION_TARGETS, LoRAState, lora_target_modules

WEIGHTS_FILE = "lora_weights.safetensors"
CONFIG_FILE = "lora_config.json"


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    alpha: float
    weights: dict[str, tuple[Tensor, Tensor]]  # module path -> (A [r, in], B [out, r]) float32 on CPU, unscaled

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def num_parameters(self) -> int:
        return sum(a.numel() + b.numel() for a, b in self.weights.values())


def lora_layout(config: ModelConfig, lm: tuple[str, ...] = ATTENTION_TARGETS, dit: tuple[str, ...] = ATTENTION_TARGETS,
                proj: bool = True) -> dict[str, tuple[int, int]]:
    """{module path: (in_features, out_features)} of the LoRA targets of a model with this config (no weights)."""
    from engine.model.voxcpm import VoxCPMModel

    with torch.device("meta"):
        model = VoxCPMModel(config)
    return {path: (m.in_features, m.out_features) for path, (m, _) in lora_target_modules(model, lm, dit, proj).items()}


def read_adapter(source: str | Path | Mapping[str, Tensor], config: Mapping[str, Any] | None = None
                 ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(tensors, LoRA config) from a directory, a .safetensors file (lora_config.json beside it), or tensors +
    `config`. An explicit `config` wins over the file."""
    if isinstance(source, Mapping):
        tensors = dict(source)
        if config is None:
            raise InvalidLoRA(f"adapter given as tensors needs its LoRA config ({CONFIG_FILE}: r, alpha)")
    else:
        path = Path(source)
        weights = path / WEIGHTS_FILE if path.is_dir() else path
        if not weights.is_file():
            raise InvalidLoRA(f"no {WEIGHTS_FILE} at {path}")
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(weights))
        except (SafetensorError, OSError, ValueError) as e:
            raise InvalidLoRA(f"{weights}: not a readable safetensors file ({e})") from None
        if config is None:
            config_file = weights.parent / CONFIG_FILE
            if not config_file.is_file():
                raise InvalidLoRA(f"missing {CONFIG_FILE} beside {weights}")
            try:
                config = json.loads(config_file.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise InvalidLoRA(f"{config_file}: not valid JSON ({e})") from None
    if not isinstance(config, Mapping):
        raise InvalidLoRA(f"the LoRA config must be a JSON object (got {type(config).__name__})")
    inner = config.get("lora_config", config)  # official saves {"base_model": ..., "lora_config": {...}}
    if not isinstance(inner, Mapping):
        raise InvalidLoRA("lora_config must be a JSON object")
    return tensors, dict(inner)


def load_adapter(name: str, source: str | Path | Mapping[str, Tensor], layout: Mapping[str, tuple[int, int]],
                 max_rank: int, config: Mapping[str, Any] | None = None) -> LoRAAdapter:
    """Read and check an adapter against a model's LoRA `layout` (see `lora_layout`)."""
    if not isinstance(name, str) or not name or len(name) > 128:
        raise InvalidLoRA("an adapter name is a non-empty string of at most 128 characters")
    tensors, cfg = read_adapter(source, config)
    rank, alpha = cfg.get("r"), cfg.get("alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidLoRA(f"lora config: r must be a positive integer (got {rank!r})")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise InvalidLoRA(f"lora config: alpha must be a finite number (got {alpha!r})")
    if rank > max_rank:
        raise InvalidLoRA(f"adapter {name!r} has rank {rank}, above this engine's max_lora_rank {max_rank}")
    if not tensors:
        raise InvalidLoRA(f"adapter {name!r} holds no tensors")
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        key = key.replace("._orig_mod.", ".").removeprefix("_orig_mod.")  # saved from a torch.compile'd model
        path, _, part = key.rpartition(".")
        if part not in ("lora_A", "lora_B"):
            raise InvalidLoRA(f"adapter {name!r}: {key!r} is not a LoRA tensor (names end in .lora_A / .lora_B)")
        if path not in layout:
            raise InvalidLoRA(f"adapter {name!r}: {path!r} is not a LoRA target of this model")
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            raise InvalidLoRA(f"adapter {name!r}: {key} must be a floating-point tensor")
        pairs.setdefault(path, {})[part] = tensor
    weights = {}
    for path, pair in pairs.items():
        if len(pair) != 2:
            missing = "lora_B" if "lora_A" in pair else "lora_A"
            raise InvalidLoRA(f"adapter {name!r}: {path}.{missing} is missing")
        a, b = pair["lora_A"], pair["lora_B"]
        fan_in, fan_out = layout[path]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise InvalidLoRA(f"adapter {name!r}: {path} needs lora_A [{rank}, {fan_in}] and lora_B [{fan_out}, "
                              f"{rank}] for r={rank} (got {list(a.shape)} and {list(b.shape)})")
        a, b = a.detach().float().cpu(), b.detach().float().cpu()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise InvalidLoRA(f"adapter {name!r}: {path} holds NaN or infinite values")
        weights[path] = (a, b)
    return LoRAAdapter(name, rank, float(alpha), weights)


class AdapterSlots:
    """The worker's adapters: all in host memory, the ones in use in the model's GPU slots (LRU eviction)."""

    def __init__(self, state: LoRAState):
        self.state = state
        first = next(iter(state.layers.values()))
        self.device, self.dtype = first.lora_A.device, first.lora_A.dtype
        self.host: dict[str, dict[str, tuple[Tensor, Tensor]]] = {}
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # resident adapters, least recently used first
        self.refs: dict[str, int] = {}
        self.free = list(range(state.num_slots - 1, 0, -1))
        self.doomed: set[str] = set()  # removed while referenced: freed at the last release

    def add(self, adapter: LoRAAdapter) -> None:
        r_max, pin = self.state.max_rank, self.device.type == "cuda"
        host = {}
        for path, (a, b) in adapter.weights.items():
            a_pad = torch.zeros(r_max, a.shape[1], dtype=self.dtype, pin_memory=pin)
            b_pad = torch.zeros(b.shape[0], r_max, dtype=self.dtype, pin_memory=pin)
            a_pad[:adapter.rank].copy_(a)
            b_pad[:, :adapter.rank].copy_(b * adapter.scaling)
            host[path] = (a_pad, b_pad)
        self.remove(adapter.name)
        self.host[adapter.name] = host

    def remove(self, name: str) -> None:
        if self.refs.get(name):
            self.doomed.add(name)
            return
        self.host.pop(name, None)
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self.free.append(slot)

    def acquire(self, name: str) -> int | None:
        """The slot holding `name` (loaded now if needed), referenced until `release`; None when every slot is
        held by running requests. Raises KeyError for an adapter this worker does not have."""
        if name not in self.host or name in self.doomed:
            raise KeyError(name)
        slot = self.slot_of.get(name)
        if slot is None:
            if not self.free:
                idle = next((n for n in self.slot_of if not self.refs.get(n)), None)
                if idle is None:
                    return None
                self.free.append(self.slot_of.pop(idle))
            slot = self.free.pop()
            self.state.load_slot(slot, self.host[name])
            self.slot_of[name] = slot
        self.slot_of.move_to_end(name)
        self.refs[name] = self.refs.get(name, 0) + 1
        return slot

    def release(self, name: str) -> None:
        self.refs[name] -= 1
        if not self.refs[name]:
            del self.refs[name]
            if name in self.doomed:
                self.doomed.discard(name)
                self.remove(name)

    def stats(self) -> dict[str, int]:
        return {"loras": len(self.host), "lora_slots_used": len(self.slot_of),
                "lora_slots": self.state.num_slots - 1}
