"""`RemoteEngine`: what the gateway uses of `engine.engine.Engine`, in a front process, over the link to the host.

A request is checked and built into its `RequestSpec` here, by the same code as `Engine.generate`
(`engine.request_check`, `engine.specs`), from the model config and tokenizer loaded from the host's model path and
the state the host pushes (stored voices, adapters, KV positions): input errors raise at the call exactly as in one
process. The host only admits the spec (what it alone decides, such as `EngineOverloaded` or `TenantOverloaded`,
comes back as that same typed error at the iterator's first read) and relays its chunks. The synchronous calls
(`list_voices`, `stats`, ...) answer from the pushed state.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine.api import AudioChunk, EngineStats, LoRAInfo, ModelInfo, VoiceInfo
from engine.config import ModelConfig
from engine.errors import InvalidParameter, UnknownLoRA, UnknownVoice
from engine.generation import ChunkIterator, ChunkQueue
from engine.request_check import CheckedRequest, check_request
from engine.sampling import SamplingParams
from engine.specs import RequestSpec, request_spec
from engine.tenants import QueuedPrompts
from engine.text import Tokenizer
from gateway.link import wire

_TENANTS = QueuedPrompts(None)  # checks a tenant's type only: the host counts queued prompts

Post = Callable[[Any], None]
CallHost = Callable[..., Awaitable[Any]]


class RemoteStream:
    """The front's side of one request: the queue its chunks (or its error, or None when cancelled) go to."""

    __slots__ = ("request_id", "queue", "sent_at", "request_ms", "chunk_ms")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.queue = ChunkQueue()
        self.sent_at: float | None = None  # when its request left for the host (time.monotonic)
        self.request_ms: float | None = None  # the request's way front -> host
        self.chunk_ms: float | None = None  # its first chunk's way host -> front

    @property
    def link_ms(self) -> float | None:
        """The link's share of the time to first audio: request there + first chunk back."""
        if self.request_ms is None or self.chunk_ms is None:
            return None
        return self.request_ms + self.chunk_ms


class RemoteGeneration(ChunkIterator):
    """What `RemoteEngine.generate` returns: `Engine.generate`'s iterator over the link; closing it (or dropping
    it) cancels. `link_ms`: the link's share of the request's time to first audio, once that audio is here."""

    def __init__(self, engine: RemoteEngine, stream: RemoteStream, checked: CheckedRequest | None):
        self._engine, self._stream, self._checked = engine, stream, checked  # checked: audio to encode first
        self._unsent = checked is not None

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    @property
    def link_ms(self) -> float | None:
        return self._stream.link_ms

    @property
    def link_parts_ms(self) -> tuple[float | None, float | None]:
        """(request front -> host, first chunk host -> front)."""
        return self._stream.request_ms, self._stream.chunk_ms

    def _queue(self) -> ChunkQueue:
        return self._stream.queue

    async def _send_first(self) -> None:
        checked, self._checked = self._checked, None
        assert checked is not None
        await self._engine._submit_encoded(self._stream, checked)

    def _cancel(self) -> None:
        self._engine._cancel_stream(self._stream)

    def __del__(self) -> None:
        if not self._finished and not self._engine.loop.is_closed():
            self._engine.loop.call_soon_threadsafe(self._engine._cancel_stream, self._stream)


class RemoteEngine:
    """The gateway's engine in a front process (`gateway.engine_contract.SessionEngine` and the rest of what the
    gateway reads of `engine.engine.Engine`). Made by `gateway.link.connect`."""

    def __init__(self, welcome: wire.Welcome, config: ModelConfig, tokenizer: Tokenizer, post: Post,
                 stamp: Callable[[RemoteStream], None], call: CallHost, close: Callable[[], Awaitable[None]]):
        self.loop = asyncio.get_running_loop()
        self.name = welcome.model_name
        self.path = Path(welcome.model_path)
        self.config, self.tokenizer = config, tokenizer
        self.default_timesteps = welcome.default_timesteps
        self.sampling_ranges = welcome.sampling_ranges
        self.is_demo = welcome.status.model_info.is_demo
        self._post, self._stamp, self._call, self._close = post, stamp, call, close
        self._status = welcome.status
        self._lora_names = {i.name for i in welcome.status.loras}
        self._voices: dict[str, wire.MirrorVoice] = {}
        self.on_voices(wire.Voices(welcome.voices, []))
        self._streams: dict[str, RemoteStream] = {}
        self._lost: BaseException | None = None

    # ---- requests ------------------------------------------------------------------------------------------
    def generate(self, text: str, *, voice: str | None = None, prompt_audio: Any = None,
                 prompt_sample_rate: int | None = None, prompt_latents: Any = None, prompt_text: str | None = None,
                 reference_audio: Any = None, reference_latents: Any = None,
                 cfg_value: float = SamplingParams.cfg_value, temperature: float = SamplingParams.temperature,
                 seed: int | None = None, max_length: int | None = None, min_length: int = SamplingParams.min_length,
                 timesteps: int | None = None, priority: int = SamplingParams.priority,
                 request_id: str | None = None, lora: str | None = None, tenant: str | None = None,
                 instruction: str | None = None) -> RemoteGeneration:
        """`Engine.generate` over the link: input errors raise here; the host's refusals at the first read."""
        if self._lost is not None:
            raise wire.HostLost(str(self._lost))
        checked = check_request(
            self.config, ranges=self.sampling_ranges, default_timesteps=self.default_timesteps,
            in_flight=self._streams, voice_of=self._voice, text=text, voice=voice, prompt_audio=prompt_audio,
            prompt_sample_rate=prompt_sample_rate, prompt_latents=prompt_latents, prompt_text=prompt_text,
            reference_audio=reference_audio, reference_latents=reference_latents, cfg_value=cfg_value,
            temperature=temperature, seed=seed, max_length=max_length, min_length=min_length, timesteps=timesteps,
            priority=priority, request_id=request_id, lora=lora, tenant=tenant, instruction=instruction)
        if checked.lora is not None and checked.lora not in self._lora_names:
            raise UnknownLoRA(f"no registered LoRA adapter {checked.lora!r}")
        checked.args["tenant"] = _TENANTS.check(tenant)
        spec = None if checked.needs_encoding else self._spec(checked)
        stream = RemoteStream(checked.args["request_id"])
        self._streams[stream.request_id] = stream
        if spec is None:
            return RemoteGeneration(self, stream, checked)
        self._send(stream, spec)
        return RemoteGeneration(self, stream, None)

    def _spec(self, checked: CheckedRequest) -> RequestSpec:
        return request_spec(self.config, self.tokenizer, self._status.kv_positions, **checked.args)

    def _send(self, stream: RemoteStream, spec: RequestSpec) -> None:
        self._post(wire.Submit(spec))
        self._stamp(stream)

    async def _submit_encoded(self, stream: RemoteStream, checked: CheckedRequest) -> None:
        """At the first read: the request's audio encoded into patches by the host's workers, then sent."""
        prompt_audio, reference_audio, sr = checked.audio
        if prompt_audio is not None:
            checked.args["prompt_patches"] = await self.encode_audio(prompt_audio, sr, "left")
        if reference_audio is not None:
            checked.args["ref_patches"] = await self.encode_audio(reference_audio, sr, "right")
        spec = self._spec(checked)
        if self._streams.get(stream.request_id) is stream:  # not cancelled meanwhile
            self._send(stream, spec)

    def _voice(self, voice_id: str) -> wire.MirrorVoice:
        v = self._voices.get(voice_id)
        if v is None:
            raise UnknownVoice(f"no stored voice {voice_id!r}")
        return v

    async def cancel(self, request_id: str) -> None:
        """Stop a request; its iterator just returns."""
        stream = self._streams.get(request_id)
        if stream is not None:
            self._cancel_stream(stream)

    def _cancel_stream(self, stream: RemoteStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            stream.queue.put_nowait(None)
            self._post(wire.Cancel(stream.request_id))

    def update_buffered(self, request_id: str, audio_ms: float) -> None:
        """The listener of `request_id` has `audio_ms` of audio queued (drives deadline-first scheduling)."""
        if not isinstance(audio_ms, (int, float)) or not math.isfinite(audio_ms):
            raise InvalidParameter(f"audio_ms must be a finite number (got {audio_ms!r})")
        if request_id in self._streams:
            self._post(wire.Buffered(request_id, float(audio_ms)))

    # ---- what the host sends -------------------------------------------------------------------------------
    def on_chunks(self, msg: wire.Chunks) -> None:
        """One worker step's chunks for this front. Requests' first chunks are handed over first: their turns wake
        first, so a new listener's first frame is not queued behind this step's chunks for listeners who have audio
        left (a request's own chunks stay in order: its first comes before any other of its)."""
        now = time.monotonic()
        streams = self._streams
        rate = self.config.sample_rate
        rows = list(wire.unpack_chunks(msg))
        if len(rows) > 1:
            rows.sort(key=_not_first)  # stable
        for rid, audio, index, latents, is_last, stop_reason, step, first in rows:
            stream = streams.get(rid)
            if stream is None:  # cancelled here while the chunk travelled
                continue
            if first is not None and stream.sent_at is not None:
                stream.request_ms = (first[0] - stream.sent_at) * 1000.0
                stream.chunk_ms = (now - first[1]) * 1000.0
            if is_last:
                del streams[rid]
            stream.queue.put_nowait(AudioChunk(audio, rate, index, latents, is_last, stop_reason, rid, step))

    def on_failed(self, msg: wire.Failed) -> None:
        """A request refused by the host or failed in its worker."""
        stream = self._streams.pop(msg.request_id, None)
        if stream is not None:
            stream.queue.put_nowait(msg.error)

    def on_voices(self, msg: wire.Voices) -> None:
        for voice_id in msg.gone:
            self._voices.pop(voice_id, None)
        for v in msg.put:
            self._voices.pop(v.info.voice_id, None)  # a replaced voice moves to the end, as in the engine
            self._voices[v.info.voice_id] = v

    def on_status(self, msg: wire.Status) -> None:
        self._status = msg
        self._lora_names = {i.name for i in msg.loras}

    def on_lost(self, error: BaseException) -> None:
        """The link is gone: every open request ends with `error`, and so does every later call."""
        self._lost = error
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.queue.put_nowait(error)

    # ---- voices and adapters (changed at the host; the mirror is updated before each call returns) ----------
    async def encode_audio(self, audio: bytes | np.ndarray, sample_rate: int | None = None,
                           _pad: str = "left") -> np.ndarray:
        """Prompt audio -> patches [T, P, D] float32, by the host's workers."""
        return await self._call("engine", "encode_audio", audio, sample_rate, _pad)

    async def add_voice(self, **kwargs: Any) -> str:
        """`Engine.add_voice` at the host; adding a voice id again with the same content is a no-op."""
        return await self._call("engine", "add_voice", **kwargs)

    async def remove_voice(self, voice_id: str) -> None:
        """`Engine.remove_voice` at the host."""
        await self._call("engine", "remove_voice", voice_id)

    def list_voices(self) -> list[VoiceInfo]:
        """The host's stored voices, in the order they were added."""
        return [v.info for v in self._voices.values()]

    def voice_latents(self, voice_id: str) -> np.ndarray | None:
        """A stored voice's patches [T, P, D] float32 (None for an adapter-only voice)."""
        v = self._voice(voice_id)
        return None if v.latents is None else np.array(v.latents, dtype=np.float32)

    async def register_lora(self, name: str, source: Any, config: dict[str, Any] | None = None) -> LoRAInfo:
        """`Engine.register_lora` at the host (a path is read there: the host runs on this machine); registering a
        name again with the same weights is a no-op."""
        return await self._call("engine", "register_lora", name, source, config)

    async def unregister_lora(self, name: str) -> None:
        """`Engine.unregister_lora` at the host."""
        await self._call("engine", "unregister_lora", name)

    def list_loras(self) -> list[LoRAInfo]:
        """The host's registered adapters."""
        return list(self._status.loras)

    # ---- status --------------------------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return self._status.model_info

    def stats(self) -> EngineStats:
        """The host engine's stats as last pushed (every `gateway.link.host.STATUS_S`)."""
        return self._status.stats

    def health(self) -> dict[str, Any]:
        """The host engine's health as last pushed; "stopped" once the link is gone."""
        if self._lost is not None:
            return {**self._status.health, "status": "stopped", "error": str(self._lost)}
        return self._status.health

    async def wait_for_ready(self) -> None:
        """Wait until the host's workers have loaded their model."""
        await self._call("engine", "wait_for_ready")

    async def stop(self) -> None:
        """Close the link (the host owns the engine and keeps it running)."""
        await self._close()


def _not_first(row: wire.ChunkRow) -> bool:
    return row[2] != 0  # the chunk's index in its request
