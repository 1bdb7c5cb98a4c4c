"""What the engine keeps registered on every worker: stored voices and LoRA adapters (resent to a restarted
worker)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import guards
from engine.api import LoRAInfo, VoiceInfo
from engine.config import ModelConfig
from engine.errors import InvalidLoRA, InvalidParameter, UnknownLoRA, UnknownVoice
from engine.request import RequestSpec


@dataclass
class LoRAEntry:
    """A registered adapter and the requests using it."""

    adapter: Any  # engine.lora.LoRAAdapter, packed in the workers' dtype (resent to a restarted worker)
    users: set[str] = field(default_factory=set)  # request ids in flight
    drained: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Voice:
    """A stored voice: its patches, transcript (prompt voices) and, on VoxCPM2, the prefix every worker keeps."""

    info: VoiceInfo
    latents: np.ndarray | None  # float32 [T, P, D]
    text: str | None
    prefix: RequestSpec | None  # v2: the reference prefix whose KV every worker keeps

    @property
    def shared_prefix(self) -> bool:
        """Every worker keeps the voice's prefix KV."""
        return self.prefix is not None


def lora_info(entry: LoRAEntry) -> LoRAInfo:
    """The public description of a registered adapter."""
    a = entry.adapter
    return LoRAInfo(a.name, a.rank, a.alpha, len(a.weights), a.num_parameters, len(entry.users))


class LoRARegistry:
    """The registered LoRA adapters by name: loaded, checked and packed off the event loop, one name at a time."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int) -> None:
        self.config, self.max_loras, self.max_rank = config, max_loras, max_rank
        self.entries: dict[str, LoRAEntry] = {}
        self._layout: asyncio.Future | None = None  # {module path: (in, out)}, built once in a thread
        self._registering: set[str] = set()  # names being registered now: a second one is refused

    def get(self, name: str | None) -> LoRAEntry | None:
        """The adapter `name` names (None for None); `UnknownLoRA` when none is registered under it."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise InvalidParameter(f"lora must be an adapter name (got {type(name).__name__})")
        entry = self.entries.get(name)
        if entry is None:
            raise UnknownLoRA(f"no registered LoRA adapter {name!r}")
        return entry

    async def register(self, name: str, source: str | Path | dict[str, torch.Tensor], config: dict[str, Any] | None,
                       first_worker_dtype: Callable[[], Awaitable[torch.dtype]],
                       add_to_workers: Callable[[Any], asyncio.Future]) -> LoRAInfo:
        """Load an adapter (a directory with lora_weights.safetensors + lora_config.json, the .safetensors file,
        or tensors with `config`), check it against the model and put it on every worker. Bad adapters raise
        `InvalidLoRA` here, before any worker sees them. `first_worker_dtype`: the model's dtype once the first worker
        is up; `add_to_workers`: the calls that put the packed adapter on every worker."""
        from engine.lora import SharedAdapter, load_adapter, lora_layout

        if not self.max_loras:
            raise InvalidLoRA("this engine has no LoRA slots: start it with max_loras >= 1")
        if isinstance(name, str) and (name in self.entries or name in self._registering):
            raise InvalidLoRA(f"a LoRA adapter named {name!r} is already registered: unregister it first")
        if self._layout is None:  # a meta-device model: ~1 s at VoxCPM2 size, off the event loop
            self._layout = asyncio.ensure_future(asyncio.to_thread(lora_layout, self.config))
        # Registrations may run concurrently (the reading, checking and packing run in threads, the workers take
        # the adapters one after another); the name is held from here so two of one name cannot both pass.
        held = isinstance(name, str)
        if held:
            self._registering.add(name)
        try:
            try:
                layout = await asyncio.shield(self._layout)
            except Exception:
                self._layout = None  # let the next registration try again
                raise
            adapter = await asyncio.to_thread(load_adapter, name, source, layout, self.max_rank, config)
            # sent and kept in the model's dtype with alpha/r folded in: half the bytes of float32 in bf16, and
            # the slots get the same bits as packing in the worker would give
            dtype = await first_worker_dtype()
            adapter = await asyncio.to_thread(adapter.packed, dtype)
            shared = await asyncio.to_thread(SharedAdapter.create, adapter)  # None: send it through the pipe
            calls = add_to_workers(shared or adapter)

            def ended(f: asyncio.Future) -> None:
                # the segment must outlive every worker's read: it goes when the calls end (a reply, a crash or
                # the engine stopping), even if this registration was cancelled meanwhile
                if shared is not None:
                    shared.unlink()
                if not f.cancelled():
                    f.exception()  # retrieved: a cancelled registration no longer awaits it

            calls.add_done_callback(ended)
            await asyncio.shield(calls)
        finally:
            if held:
                self._registering.discard(name)
        entry = LoRAEntry(adapter)
        entry.drained.set()
        self.entries[name] = entry
        return lora_info(entry)


class VoiceRegistry:
    """The stored voices by id, in the order they were added; a reference voice's prefix is kept on every worker."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.entries: dict[str, Voice] = {}

    def get(self, voice_id: str) -> Voice:
        """The voice stored as `voice_id`; `UnknownVoice` when there is none."""
        v = self.entries.get(voice_id)
        if v is None:
            raise UnknownVoice(f"no stored voice {voice_id!r}")
        return v

    def pop(self, voice_id: str) -> Voice:
        """Forget the voice stored as `voice_id` (`UnknownVoice` when there is none)."""
        v = self.entries.pop(voice_id, None)
        if v is None:
            raise UnknownVoice(f"no stored voice {voice_id!r}")
        return v

    def prefixes(self) -> Iterator[RequestSpec]:
        """The prefixes every worker keeps (what a restarted worker is sent again)."""
        return (v.prefix for v in self.entries.values() if v.prefix is not None)

    def infos(self) -> list[VoiceInfo]:
        """The stored voices, in the order they were added."""
        return [v.info for v in self.entries.values()]

    def users_of(self, lora: str) -> list[str]:
        """The ids of the stored voices that use the adapter `lora`."""
        return [v.info.voice_id for v in self.entries.values() if v.info.lora == lora]

    def latents(self, voice_id: str) -> np.ndarray | None:
        """A stored voice's patches [T, P, D] float32 (None for an adapter-only voice)."""
        v = self.get(voice_id)
        return None if v.latents is None else v.latents.copy()

    async def add(self, voice_id: str | None, *, audio: Any, sample_rate: int | None, latents: Any, text: str | None,
                  lora: str | None, encode: Callable[[Any, int | None, str], Awaitable[np.ndarray]],
                  prefix_spec: Callable[[str, np.ndarray, str | None], RequestSpec],
                  add_to_workers: Callable[[RequestSpec], Awaitable[Any]],
                  remove: Callable[[str], Awaitable[None]]) -> str:
        """Store a voice (see `Engine.add_voice`) and return its id. `encode`: audio -> patches on a worker;
        `prefix_spec`: a reference voice's prefix; `add_to_workers`: the calls that put the prefix on every worker;
        `remove`: forget a voice stored under the same id first."""
        if lora is not None and audio is None and latents is None and text is None:
            voice_id = guards.voice_id_or_new(voice_id)
            if voice_id in self.entries:
                await remove(voice_id)
            self.entries[voice_id] = Voice(VoiceInfo(voice_id, "lora", 0, None, lora), None, None, None)
            return voice_id
        guards.check_voice_source(self.config, audio=audio, latents=latents, text=text)
        voice_id = guards.voice_id_or_new(voice_id)
        reference = self.config.is_v2
        pad = "right" if reference else "left"
        patches = guards.check_latents(self.config, latents, "latents") if latents is not None else \
            await encode(audio, sample_rate, pad)
        prefix = prefix_spec(voice_id, patches, lora) if reference else None
        if voice_id in self.entries:
            await remove(voice_id)
        voice = Voice(VoiceInfo(voice_id, "reference" if reference else "prompt", int(patches.shape[0]), text,
                                lora), patches, text, prefix)
        if prefix is not None:
            await add_to_workers(prefix)
        self.entries[voice_id] = voice
        return voice_id
