"""Stored voices and LoRA adapters with owners: who may list, use and delete what, and the one voice-resolution
function every protocol uses.

The store holds each item (owner, `public` flag, what rebuilds it); the engine holds what this node has loaded. An
item is loaded into the engine at start (local store) or on its first use on this node (shared store). Voices and
adapters put into the engine directly by the program that embeds the gateway (not through the store) are the
operator's and shared with every key. Adapter names are per tenant: the engine knows each as `name@tenant`."""

from __future__ import annotations

import asyncio
import io
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

from engine import errors as engine_errors
from gateway.auth import Caller
from gateway.store import Item, Store, StoreUnavailable
from gateway.voice_design import Design, design_latents

log = logging.getLogger("voxgate.voices")

VOICE, LORA = "voice", "lora"
MAX_LOGGED_FALLBACKS = 1000  # distinct unknown ids whose fallback is logged once each


class VoiceRefused(Exception):
    """A voice or adapter cannot be used, listed or changed by this caller: `status` and `code` say how to answer."""

    status = 404
    code = "unknown_voice"

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status or self.status
        self.code = code or self.code


class NotVisible(VoiceRefused):
    """No such item for this caller (another key's item is answered the same way, so ids do not leak)."""


class NotAllowed(VoiceRefused):
    """The caller sees the item (it is public) but may not change it."""

    status, code = 403, "forbidden"


class Unavailable(VoiceRefused):
    """The store cannot be reached."""

    status, code = 503, "store_unavailable"


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array, dtype=np.float32), allow_pickle=False)
    return buf.getvalue()


def lora_id(tenant: str, name: str) -> str:
    """The engine's name for a tenant's adapter."""
    return name if not tenant else f"{name}@{tenant}"


class Catalog:
    """Voices and adapters as each caller sees them. `strict`: the server-wide strict mode of `voice_or_default`."""

    def __init__(self, engine: Any, store: Store, *, strict: bool = False):
        self.engine, self.store, self.strict = engine, store, strict
        self._loaded: dict[tuple[str, str], Item] = {}  # what this catalog put into the engine, as last read
        self._ours: set[tuple[str, str]] = set()  # in the engine because of the store (until freed there)
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._fallbacks_logged: set[str] = set()

    # ---- who may do what -----------------------------------------------------------------------------------
    @staticmethod
    def visible(item: Item, caller: Caller) -> bool:
        """Items of no tenant were made while keys were off: shared, like public ones."""
        return caller.operator or item.public or item.owner in ("", caller.tenant)

    @staticmethod
    def manageable(item: Item, caller: Caller) -> bool:
        return caller.operator or item.owner in ("", caller.tenant)

    async def _get(self, kind: str, item_id: str) -> Item | None:
        """The item's record; the last one read while the store is unreachable (a loaded item keeps working)."""
        try:
            return await self.store.get(kind, item_id)
        except StoreUnavailable as e:
            if (kind, item_id) in self._loaded:
                return self._loaded[(kind, item_id)]
            raise Unavailable(str(e)) from None

    async def _items(self, kind: str) -> list[Item]:
        try:
            return await self.store.items(kind)
        except StoreUnavailable as e:
            raise Unavailable(str(e)) from None

    def _engine_voices(self) -> dict[str, Any]:
        return {getattr(v, "voice_id", v): v for v in self.engine.list_voices()}

    def _operators(self, ids: dict[str, Any], kind: str) -> dict[str, Any]:
        """Engine items that the store did not make: the embedding program's, shared with every key."""
        return {i: v for i, v in ids.items() if (kind, i) not in self._ours}

    # ---- the one voice-resolution function -------------------------------------------------------------------
    async def resolve(self, voice_id: str, caller: Caller) -> str | None:
        """The engine voice id this caller may speak with under `voice_id`, loaded on this node; None if unknown to
        the caller (another key's private voice included). Unavailable if the store cannot say."""
        item = await self._get(VOICE, voice_id)
        if item is None:
            if (VOICE, voice_id) in self._loaded:  # deleted through another node: free it here too
                await self._unload(VOICE, voice_id)
                return None
            return voice_id if voice_id in self._operators(self._engine_voices(), VOICE) else None
        if not self.visible(item, caller):
            return None
        try:
            await self._ensure(item)
        except NotVisible as e:  # its adapter is gone
            log.error("stored voice %r cannot be loaded: %s", voice_id, e)
            return None
        return voice_id

    async def voice_or_default(self, voice_id: str | None, caller: Caller, protocol: str) -> str | None:
        """For protocols whose clients name foreign voices (an ElevenLabs or Cartesia id in a client's config): an
        unknown id speaks with the default voice (None), logged once per id; in strict mode (the server's or the
        key's) it is refused with NotVisible, which each protocol answers with its own not-found error."""
        if voice_id is None:
            return None
        try:
            found = await self.resolve(voice_id, caller)
        except Unavailable:
            if self.strict or caller.strict:
                raise
            found, why = None, "the store is unreachable"
        else:
            why = "no such stored voice for this key"
        if found is None:
            if self.strict or caller.strict:
                raise NotVisible(f"no stored voice {voice_id!r}")
            if voice_id not in self._fallbacks_logged and len(self._fallbacks_logged) < MAX_LOGGED_FALLBACKS:
                self._fallbacks_logged.add(voice_id)
                log.warning("%s: voice %r speaks with the default voice (%s; strict mode refuses it instead)",
                            protocol, voice_id, why)
        return found

    # ---- voices ----------------------------------------------------------------------------------------------
    async def create_voice(self, caller: Caller, *, audio: bytes | None = None, text: str | None = None,
                           lora: str | None = None, public: bool = False,
                           design: Design | None = None) -> dict[str, Any]:
        """Encode and store a voice from an audio file's bytes (or an adapter-only voice, or one designed from a
        description: gateway.voice_design); returns its listing. It is in the store before this returns:
        acknowledged voices survive restarts. Engine errors pass through."""
        if public and not caller.operator:
            raise NotAllowed("only an operator key may make a voice public")
        adapter = await self.resolve_lora(lora, caller) if lora else None
        if lora and adapter is None:
            raise NotVisible(f"no registered LoRA adapter {lora!r}", code="unknown_lora")
        voice_id = uuid.uuid4().hex[:12]
        # ours before the engine has it: until its record is stored, an engine voice no record names would read as an
        # operator's (every key's) to another session resolving the id
        self._ours.add((VOICE, voice_id))
        try:
            return await self._create_voice(caller, voice_id, adapter, audio, text, lora, public, design)
        except BaseException:
            if voice_id not in self._engine_voices():  # else it stays ours: never an operator's voice
                self._ours.discard((VOICE, voice_id))
            raise

    async def _create_voice(self, caller: Caller, voice_id: str, adapter: str | None, audio: bytes | None,
                            text: str | None, lora: str | None, public: bool, design: Design | None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"voice_id": voice_id, "lora": adapter}
        if audio is not None:
            kwargs.update(audio=audio, text=text)
        elif design is not None:  # a prompt voice (no reference mode) keeps the sample's text as its transcript
            kwargs["latents"] = await design_latents(self.engine, design, caller.tenant or None)
            if self.engine.model_info().architecture != "voxcpm2":
                kwargs["text"] = design.text
        await self.engine.add_voice(**kwargs)
        info = self._engine_voices()[voice_id]
        latents = self.engine.voice_latents(voice_id)
        item = Item(VOICE, voice_id, caller.tenant, public, created=time.time(), meta={
            "mode": info.mode, "num_patches": info.num_patches, "text": info.text, "lora": lora, "lora_id": adapter,
            "description": design.description if design is not None else None})
        try:
            await self.store.put(item, {"latents": _npy(latents)} if latents is not None else {})
        except StoreUnavailable as e:
            await self.engine.remove_voice(voice_id)
            raise Unavailable(str(e)) from None
        self._loaded[(VOICE, voice_id)] = item
        return self.voice_view(item)

    @staticmethod
    def voice_view(item: Item) -> dict[str, Any]:
        m = item.meta
        return {"voice_id": item.id, "mode": m.get("mode"), "num_patches": m.get("num_patches"),
                "text": m.get("text"), "lora": m.get("lora"), "public": item.public,
                "description": m.get("description")}

    async def list_voices(self, caller: Caller) -> list[dict[str, Any]]:
        """The voices this caller may use: its own, public ones and the operator's."""
        items = await self._items(VOICE)
        stored = {i.id for i in items}
        views = [{**(asdict(info) if not isinstance(info, str) else {"voice_id": vid}), "public": True}
                 for vid, info in self._operators(self._engine_voices(), VOICE).items() if vid not in stored]
        return views + [self.voice_view(i) for i in items if self.visible(i, caller)]

    async def delete_voice(self, caller: Caller, voice_id: str) -> None:
        """Remove a voice the caller owns (any, for an operator key)."""
        item = await self._get(VOICE, voice_id)
        if item is None:
            engine_only = voice_id in self._operators(self._engine_voices(), VOICE)
            if not engine_only or not (caller.operator or not caller.tenant):
                raise NotVisible(f"no stored voice {voice_id!r}")
            await self.engine.remove_voice(voice_id)
            return
        self._check_manage(item, caller, "voice")
        try:
            await self.store.delete(VOICE, voice_id)
        except StoreUnavailable as e:
            raise Unavailable(str(e)) from None
        await self._unload(VOICE, voice_id)

    def _check_manage(self, item: Item, caller: Caller, what: str) -> None:
        if not self.visible(item, caller):
            raise NotVisible(f"no stored {what} {item.meta.get('name', item.id)!r}",
                             code="unknown_voice" if item.kind == VOICE else "unknown_lora")
        if not self.manageable(item, caller):
            raise NotAllowed(f"this {what} is shared by an operator: only its owner or an operator key may change it")

    async def set_public(self, caller: Caller, kind: str, name: str, public: bool) -> dict[str, Any]:
        """Share an item with every key, or stop sharing it: operator keys only."""
        item = await (self._get(VOICE, name) if kind == VOICE else self._find_lora(name, caller))
        if item is None or not self.visible(item, caller):
            raise NotVisible(f"no stored {kind} {name!r}", code="unknown_voice" if kind == VOICE else "unknown_lora")
        if not caller.operator:
            raise NotAllowed(f"only an operator key may share a {kind} with every key")
        item.public = public
        try:
            if not await self.store.update(item):
                raise NotVisible(f"no stored {kind} {name!r}")
        except StoreUnavailable as e:
            raise Unavailable(str(e)) from None
        if (kind, item.id) in self._loaded:
            self._loaded[(kind, item.id)] = item
        return self.voice_view(item) if kind == VOICE else self.lora_view(item)

    # ---- adapters --------------------------------------------------------------------------------------------
    async def _find_lora(self, name: str, caller: Caller) -> Item | None:
        """The adapter a caller means by `name`: its own, else a public one, else (operator) anyone's."""
        own = await self._get(LORA, lora_id(caller.tenant, name))
        if own is not None:
            return own
        named = [i for i in await self._items(LORA) if i.meta.get("name") == name]
        return next((i for i in named if i.public or i.owner == ""), None) or \
            next((i for i in named if caller.operator), None)

    async def resolve_lora(self, name: str, caller: Caller) -> str | None:
        """The engine name of the adapter this caller means by `name`, loaded on this node; None if unknown."""
        item = await self._find_lora(name, caller)
        if item is None:
            if (LORA, lora_id(caller.tenant, name)) in self._loaded:  # deleted through another node: free it here
                await self._unload(LORA, lora_id(caller.tenant, name))
            loras = {i.name for i in self.engine.list_loras()}
            return name if name in self._operators(dict.fromkeys(loras), LORA) else None
        await self._ensure(item)
        return item.id

    async def create_lora(self, caller: Caller, name: str, weights: bytes, config: dict[str, Any],
                          public: bool = False) -> dict[str, Any]:
        """Check, load and store an adapter under the caller's namespace; returns its listing."""
        if public and not caller.operator:
            raise NotAllowed("only an operator key may make an adapter public")
        if not isinstance(name, str) or not name or "@" in name:
            raise VoiceRefused("an adapter name is a non-empty string without '@'", status=400, code="invalid_value")
        engine_name = lora_id(caller.tenant, name)
        if await self._get(LORA, engine_name) is not None:
            raise VoiceRefused(f"you already have an adapter named {name!r}: delete it first", status=409,
                               code="invalid_value")
        tensors = await asyncio.to_thread(read_safetensors, weights)
        info = await self.engine.register_lora(engine_name, tensors, config=config)
        item = Item(LORA, engine_name, caller.tenant, public, created=time.time(), meta={
            "name": name, "config": config, "rank": info.rank, "alpha": info.alpha, "num_layers": info.num_layers,
            "num_parameters": info.num_parameters})
        try:
            await self.store.put(item, {"weights": weights})
        except StoreUnavailable as e:
            await self.engine.unregister_lora(engine_name)
            raise Unavailable(str(e)) from None
        self._loaded[(LORA, engine_name)] = item
        self._ours.add((LORA, engine_name))
        return self.lora_view(item)

    def lora_view(self, item: Item) -> dict[str, Any]:
        m = item.meta
        in_flight = next((i.in_flight for i in self.engine.list_loras() if i.name == item.id), 0)
        return {"name": m.get("name", item.id), "rank": m.get("rank"), "alpha": m.get("alpha"),
                "num_layers": m.get("num_layers"), "num_parameters": m.get("num_parameters"), "in_flight": in_flight,
                "public": item.public}

    async def list_loras(self, caller: Caller) -> list[dict[str, Any]]:
        """The adapters this caller may use: its own, public ones and the operator's."""
        items = await self._items(LORA)
        stored = {i.id for i in items}
        engine = {i.name: i for i in self.engine.list_loras()}
        views = [{**asdict(info), "public": True} for name, info in self._operators(engine, LORA).items()
                 if name not in stored]
        return views + [self.lora_view(i) for i in items if self.visible(i, caller)]

    async def delete_lora(self, caller: Caller, name: str) -> None:
        """Remove an adapter the caller owns (any, for an operator key); refused while a stored voice uses it.
        Engine errors (UnknownLoRA, InvalidRequest) pass through for the operator's adapters."""
        item = await self._find_lora(name, caller)
        if item is None:
            if caller.operator or not caller.tenant:  # the operator's own adapters, put in the engine directly
                await self.engine.unregister_lora(name)
                return
            raise NotVisible(f"no registered LoRA adapter {name!r}", code="unknown_lora")
        self._check_manage(item, caller, "adapter")
        users = [v.id for v in await self._items(VOICE) if v.meta.get("lora_id") == item.id]
        if users:
            raise VoiceRefused(f"LoRA adapter {name!r} is used by stored voice(s) {users}: remove them first",
                               status=409, code="invalid_value")
        try:
            await self.store.delete(LORA, item.id)
        except StoreUnavailable as e:
            raise Unavailable(str(e)) from None
        await self._unload(LORA, item.id)

    # ---- loading into the engine ---------------------------------------------------------------------------
    async def _ensure(self, item: Item) -> None:
        """Put the item into this node's engine if it is not there yet (a voice's prefix KV is computed here)."""
        key = (item.kind, item.id)
        if key in self._loaded:
            self._loaded[key] = item
            return
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key in self._loaded:
                return
            try:
                blobs = await self.store.blobs(item.kind, item.id)
            except StoreUnavailable as e:
                raise Unavailable(str(e)) from None
            try:
                if item.kind == LORA:
                    await self._load_lora(item, blobs)
                else:
                    await self._load_voice(item, blobs)
            except (engine_errors.EngineError, ValueError, KeyError) as e:
                log.error("cannot load stored %s %r into the engine: %s", item.kind, item.id, e)
                raise VoiceRefused(f"stored {item.kind} {item.id!r} cannot be loaded now: {e}", status=503,
                                   code="engine_error") from None
            self._loaded[key] = item
            self._ours.add(key)
        self._locks.pop(key, None)

    async def _load_lora(self, item: Item, blobs: dict[str, bytes]) -> None:
        tensors = await asyncio.to_thread(read_safetensors, blobs["weights"])
        if item.id in {i.name for i in self.engine.list_loras()}:
            return
        await self.engine.register_lora(item.id, tensors, config=item.meta.get("config"))

    async def _load_voice(self, item: Item, blobs: dict[str, bytes]) -> None:
        adapter = item.meta.get("lora_id")
        if adapter:
            lora = await self._get(LORA, adapter)
            if lora is None:
                raise NotVisible(f"voice {item.id!r} names adapter {item.meta.get('lora')!r}, which is gone")
            await self._ensure(lora)
        latents = np.load(io.BytesIO(blobs["latents"]), allow_pickle=False) if "latents" in blobs else None
        kwargs: dict[str, Any] = {"voice_id": item.id, "lora": adapter}
        if latents is not None:
            kwargs.update(latents=latents, text=item.meta.get("text"))
        await self.engine.add_voice(**kwargs)

    async def _unload(self, kind: str, item_id: str) -> None:
        self._loaded.pop((kind, item_id), None)
        try:
            if kind == VOICE:
                await self.engine.remove_voice(item_id)
            else:
                await self.engine.unregister_lora(item_id)
            self._ours.discard((kind, item_id))
        except (engine_errors.UnknownVoice, engine_errors.UnknownLoRA, KeyError):
            self._ours.discard((kind, item_id))  # not in the engine: nothing to free
        except engine_errors.InvalidRequest as e:  # an adapter still named by a voice loaded here: freed with it
            log.info("keeping %s %r loaded for now: %s", kind, item_id, e)

    async def restore(self, progress: Callable[[str], None] = log.info) -> tuple[int, int]:
        """Load every stored adapter, then every voice, into the engine (the local store, at start); items that
        fail to load are logged and skipped. Returns (voices, adapters) loaded."""
        loras, voices = await self._items(LORA), await self._items(VOICE)
        if not loras and not voices:
            return 0, 0
        progress(f"restoring {len(voices)} voice(s) and {len(loras)} LoRA adapter(s) from {self.store.description}")
        done = {LORA: 0, VOICE: 0}
        started = time.monotonic()
        for n, item in enumerate([*loras, *voices], 1):
            try:
                await self._ensure(item)
                done[item.kind] += 1
            except VoiceRefused as e:
                log.error("cannot restore %s %r: %s", item.kind, item.id, e)
            if n % 25 == 0 or n == len(loras) + len(voices):
                progress(f"restored {n}/{len(loras) + len(voices)} ({time.monotonic() - started:.1f} s)")
        return done[VOICE], done[LORA]


def read_safetensors(data: bytes) -> dict[str, Any]:
    """Adapter tensors from safetensors bytes; ValueError naming the problem."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except SafetensorError as e:
        raise ValueError(f"weights: not a safetensors file ({e})") from None


async def stored_voices(engine: Any) -> dict[str, str | None]:
    """The engine's stored voices: id -> mode ("reference", "prompt", "lora"; None when unknown), from its
    `list_voices` (VoiceInfo objects, or plain ids)."""
    return {getattr(v, "voice_id", v): getattr(v, "mode", None) for v in engine.list_voices()}
