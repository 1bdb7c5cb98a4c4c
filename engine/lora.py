"""LoRA adapters at run time: reading and checking them (caller's process), and the worker's GPU slot cache.

An adapter is what official VoxCPM fine-tuning saves: `lora_weights.safetensors` (official state_dict names ending
in `.lora_A` [r, in] / `.lora_B` [out, r]) beside `lora_config.json` (`{"lora_config": {"r", "alpha", ...}}`, or
the LoRAConfig fields at top level). `load_adapter` checks every tensor against the model's LoRA targets and
returns float32 CPU weights; every problem is an `InvalidLoRA` naming it.

Getting an adapter to the workers (37 MB of bf16 for a VoxCPM2 rank-32 one): `LoRAAdapter.packed` gives what the
pool keeps, the model's dtype with alpha/r folded into B, all weights views of one flat buffer, and
`SharedAdapter.create` copies that buffer into one POSIX shared-memory segment, so only its name and the shapes go
through a worker's pipe and each worker copies straight from the segment into its slots' host memory. Through the
pipe (the fallback when /dev/shm cannot hold it, and a restarted worker's resend) a packed adapter pickles as one
byte buffer: pickled tensors would each travel as a shared-memory handle the worker fetches one by one.

`AdapterSlots` (one per worker) keeps every registered adapter in host memory (pinned on CUDA), padded to the max
rank with alpha/r folded into B, and copies it into one of the model's GPU slots when a request needs it. Slots are
reference-counted by the requests that hold them (admission acquires, finish/preemption releases); an unreferenced
slot is evicted least recently used first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections import OrderedDict
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engine.config import ModelConfig
from engine.errors import InvalidLoRA
from engine.model.lora import ATTENTION_TARGETS, LoRAState, lora_target_modules

log = logging.getLogger(__name__)

WEIGHTS_FILE = "lora_weights.safetensors"
CONFIG_FILE = "lora_config.json"


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    alpha: float
    weights: dict[str, tuple[Tensor, Tensor]]  # module path -> (A [r, in], B [out, r]) on CPU
    folded: bool = False  # B already holds B * alpha / r (`packed`); else B is as trained (float32 from loading)
    # one contiguous buffer every weight is a view of, in order (`packed`): what the pickle sends as is
    flat: Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def num_parameters(self) -> int:
        return sum(a.numel() + b.numel() for a, b in self.weights.values())

    @property
    def shapes(self) -> Shapes:
        """(module path, A shape, B shape) of every weight pair, in the order a packed buffer holds them."""
        return [(path, tuple(a.shape), tuple(b.shape)) for path, (a, b) in self.weights.items()]

    def packed(self, dtype: torch.dtype) -> LoRAAdapter:
        """The adapter as a worker stores it: weights in `dtype` (the model's), alpha/r folded into B in float32
        before the cast (what `AdapterSlots.add` would compute, so the slots hold the same bits), all of them views
        of one flat buffer. Half the bytes of float32 in bf16, and one buffer to pickle."""
        if self.folded:
            return self
        flat = torch.empty(self.num_parameters, dtype=dtype)
        weights = _unflatten(flat, self.shapes)
        for path, (a, b) in self.weights.items():
            weights[path][0].copy_(a)
            weights[path][1].copy_(b.float() * self.scaling)
        return LoRAAdapter(self.name, self.rank, self.alpha, weights, folded=True, flat=flat)

    # Pickled by value: every weight as one byte buffer (the flat one of a packed adapter, else a concatenation)
    # plus the shapes. Tensors pickled through a multiprocessing pipe would each go as a shared-memory handle
    # that the receiving worker fetches from a thread of this process, one round trip per tensor (~400 for
    # VoxCPM2), after copying each into shared memory.
    def __getstate__(self) -> dict:
        tensors = [t for pair in self.weights.values() for t in pair]
        flat = self.flat
        if flat is None:
            dtype = tensors[0].dtype if tensors else torch.float32
            for t in tensors:
                dtype = torch.promote_types(dtype, t.dtype)
            flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors]) if tensors else \
                torch.empty(0, dtype=dtype)
        return {"name": self.name, "rank": self.rank, "alpha": self.alpha, "folded": self.folded,
                "dtype": str(flat.dtype).removeprefix("torch."), "shapes": self.shapes,
                "data": flat.contiguous().view(torch.uint8).numpy()}

    def __setstate__(self, state: dict) -> None:
        flat = torch.from_numpy(state["data"]).view(getattr(torch, state["dtype"]))
        self.__init__(state["name"], state["rank"], state["alpha"], _unflatten(flat, state["shapes"]),
                      state["folded"], flat)


Shapes = list[tuple[str, tuple[int, ...], tuple[int, ...]]]  # (module path, A shape, B shape), in buffer order


def _unflatten(flat: Tensor, shapes: Shapes) -> dict[str, tuple[Tensor, Tensor]]:
    """{path: (A, B)} as views of `flat`, laid out one after another in `shapes` order."""
    weights, offset = {}, 0
    for path, a_shape, b_shape in shapes:
        pair = []
        for shape in (a_shape, b_shape):
            n = math.prod(shape)
            pair.append(flat[offset:offset + n].view(shape))
            offset += n
        weights[path] = (pair[0], pair[1])
    return weights


class SharedAdapter:
    """A packed adapter's buffer in a POSIX shared-memory segment: what `Engine.register_lora` sends the workers.

    Through a worker's pipe the 37 MB of a VoxCPM2 rank-32 adapter took ~90 ms of copies (pickle, pipe, read,
    unpickle), one adapter after another; from the segment a worker makes the one copy it needs anyway, into its
    slots' host memory. The creating process owns the segment: it must `unlink` it once every worker it was sent
    to has replied (or cannot), and not before."""

    def __init__(self, adapter: LoRAAdapter, shm: SharedMemory, nbytes: int):
        self.name, self.rank, self.alpha, self.folded = adapter.name, adapter.rank, adapter.alpha, adapter.folded
        assert adapter.flat is not None
        self.dtype = str(adapter.flat.dtype).removeprefix("torch.")
        self.shapes: Shapes = adapter.shapes
        self.segment, self.nbytes = shm.name, nbytes
        self._shm: SharedMemory | None = shm

    @classmethod
    def create(cls, adapter: LoRAAdapter) -> SharedAdapter | None:
        """Copy a packed adapter into a new segment; None when shared memory cannot hold it (the caller then sends
        the adapter itself)."""
        if adapter.flat is None:
            raise ValueError("SharedAdapter.create needs a packed adapter (LoRAAdapter.packed)")
        src = adapter.flat.reshape(-1).view(torch.uint8)
        try:
            shm = SharedMemory(create=True, size=max(1, src.numel()))
        except OSError as e:
            log.warning("LoRA adapter %r goes through the pipe: no shared memory segment (%s)", adapter.name, e)
            return None
        try:
            if hasattr(os, "posix_fallocate"):
                # tmpfs hands out pages on first write, and a write /dev/shm has no room for is a SIGBUS: reserve
                # them all now, so a full /dev/shm is this OSError instead
                os.posix_fallocate(shm._fd, 0, shm.size)  # SharedMemory keeps the descriptor as _fd on POSIX
            dst = torch.frombuffer(shm.buf, dtype=torch.uint8, count=src.numel())
            dst.copy_(src)
            del dst  # releases its hold on the mapping, so that close() may unmap it
        except BaseException as e:
            shm.close()
            shm.unlink()
            if not isinstance(e, OSError):
                raise
            log.warning("LoRA adapter %r goes through the pipe: shared memory is full (%s)", adapter.name, e)
            return None
        shm.close()  # the segment stays until unlink; this process needs no mapping of it
        return cls(adapter, shm, src.numel())

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_shm"] = None  # the owner's handle stays with the owner
        return state

    @contextlib.contextmanager
    def open(self) -> Iterator[LoRAAdapter | None]:
        """The adapter as views of the segment, valid inside the block; None when the segment is gone (its owner
        gave up waiting for this worker)."""
        try:
            shm = SharedMemory(self.segment)
        except FileNotFoundError:
            yield None
            return
        try:
            flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=self.nbytes).view(getattr(torch, self.dtype))
            yield LoRAAdapter(self.name, self.rank, self.alpha, _unflatten(flat, self.shapes), self.folded, flat)
        finally:
            flat = None  # noqa: F841  the views must be gone before the mapping closes
            with contextlib.suppress(BufferError):  # a view still held somewhere: unmapped when it dies
                shm.close()

    def unlink(self) -> None:
        """Remove the segment (owner only; once every worker it was sent to has replied or died)."""
        if self._shm is not None:
            shm, self._shm = self._shm, None
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()


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
        if not (_all_finite(a) and _all_finite(b)):
            raise InvalidLoRA(f"adapter {name!r}: {path} holds NaN or infinite values")
        weights[path] = (a, b)
    return LoRAAdapter(name, rank, float(alpha), weights)


def _all_finite(t: Tensor) -> bool:
    """No NaN or infinity in a non-empty tensor: its min and max are finite (NaN propagates to both). One read of
    the tensor, ~5x faster than `isfinite(t).all()`, which writes a bool mask of it first."""
    lo, hi = torch.aminmax(t)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


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
        self.pending: set[str] = set()  # being added (`adding`): its requests wait for it

    def knows(self, name: str) -> bool:
        """Whether `name` is here or on its way (requests for it may be queued)."""
        return name in self.host or name in self.pending

    def add(self, adapter: LoRAAdapter | SharedAdapter) -> None:
        """Keep `adapter` in host memory (pinned on CUDA), ranks padded to the max, alpha/r folded into B."""
        for _ in self.adding(adapter):
            pass

    def adding(self, adapter: LoRAAdapter | SharedAdapter) -> Generator[bool, None, None]:
        """`add` as a worker chore (`engine.chores`): one weight pair's host copies per slice, then the adapter
        appears at once (its requests wait meanwhile, `acquire`)."""
        self.pending.add(adapter.name)
        try:
            if isinstance(adapter, SharedAdapter):
                with adapter.open() as opened:
                    if opened is None:  # the pool stopped waiting for this worker (stopping, or the call failed)
                        log.error("LoRA adapter %r: its shared memory segment is gone; not added", adapter.name)
                    else:
                        yield from self._adding(opened)
                        del opened  # its views of the segment must be gone before the segment is unmapped
            else:
                yield from self._adding(adapter)
        finally:
            self.pending.discard(adapter.name)

    def _adding(self, adapter: LoRAAdapter) -> Generator[bool, None, None]:
        r_max, pin, rank = self.state.max_rank, self.device.type == "cuda", adapter.rank
        host = {}
        for path, (a, b) in adapter.weights.items():
            yield False
            a_pad = torch.empty(r_max, a.shape[1], dtype=self.dtype, pin_memory=pin)
            b_pad = torch.empty(b.shape[0], r_max, dtype=self.dtype, pin_memory=pin)
            a_pad[:rank].copy_(a)
            a_pad[rank:].zero_()
            b_pad[:, :rank].copy_(b if adapter.folded else b * adapter.scaling)
            b_pad[:, rank:].zero_()
            host[path] = (a_pad, b_pad)
        self.remove(adapter.name)
        self.host[adapter.name] = host
        if self.free:  # resident from the start while slots are free: its first requests wait for no slot load
            slot = self.free.pop()
            self.state.load_slot(slot, host)
            self.slot_of[adapter.name] = slot

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
        if name in self.pending:
            return None  # still being added: its requests wait
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
