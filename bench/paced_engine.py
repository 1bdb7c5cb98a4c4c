"""BENCHMARK-ONLY stand-in for `engine.Engine`: no model, a fixed speech-like waveform delivered at real-time pace.

It exists to measure the gateway's own cost at session counts no GPU here can feed (one H200 tops out near 220
real-time VoxCPM2 streams). It implements the part of the engine API the gateway calls (`generate` -> async
iterator of `AudioChunk`, `cancel`, `update_buffered`, `model_info`, `list_voices`, `health`, `stats`, ...) and,
like the real engine's steps, it hands one 160 ms patch to every running request at each tick: one timer for all
streams, chunks for all of them at once (the real engine's reader thread delivers one step's chunks in one go too).
A request's first chunk comes at the next tick. Nothing here is used by the gateway or the engine themselves.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

import numpy as np

from engine.api import AudioChunk, EngineStats, ModelInfo
from engine.errors import EngineOverloaded, InvalidRequest, UnknownLoRA, UnknownVoice
from engine.generation import ChunkIterator, ChunkQueue

SAMPLE_RATE = 48000  # VoxCPM2's output rate
PATCH_MS = 160.0  # one VoxCPM2 patch (4 latent frames of 40 ms)
LATENT_SHAPE = (4, 64)  # [P, D] per patch, as the engine hands them (the session keeps them for continuation)


def speech_like(seconds: float = 4.8, rate: int = SAMPLE_RATE, seed: int = 0) -> np.ndarray:
    """A deterministic speech-like signal (float32, peak 0.5): syllables of 120-260 ms, voiced (a glottal pulse
    train at a gliding pitch, shaped by three formants), fricative (high-band noise) or pause, with a syllabic
    envelope. Opus has to work on it as on speech; a sine would encode several times faster and flatter the result."""
    rng = np.random.default_rng(seed)
    hop = rate // 100  # 10 ms frames
    n_frames = int(seconds * 100)
    n = n_frames * hop
    f0 = np.zeros(n)  # per sample; 0 where unvoiced
    gain = np.zeros(n)
    frames: list[tuple[str, tuple[float, ...]]] = []
    t = 0
    while t < n_frames:
        length = min(int(rng.integers(12, 27)), n_frames - t)
        kind = str(rng.choice(["voiced", "fricative", "pause"], p=[0.7, 0.2, 0.1]))
        params = (rng.uniform(300, 850), rng.uniform(900, 2300), rng.uniform(2400, 3200)) if kind == "voiced" else \
            (rng.uniform(4000, 7000),)
        a, b = t * hop, (t + length) * hop
        if kind == "voiced":
            start = rng.uniform(95, 210)
            f0[a:b] = np.linspace(start, start * (1 + rng.uniform(-0.25, 0.25)), b - a)
        gain[a:b] = np.sin(np.pi * (np.arange(b - a) + 0.5) / (b - a)) ** 0.6 * (0.0 if kind == "pause" else 1.0)
        frames += [(kind, params)] * length
        t += length
    # excitation: pulses where the integrated pitch phase wraps (continuous across frames), noise elsewhere
    phase = np.cumsum(f0 / rate)
    pulses = np.zeros(n)
    pulses[1:][np.floor(phase[1:]) > np.floor(phase[:-1])] = 1.0
    excitation = np.where(f0 > 0, pulses + rng.normal(0, 0.02, n), rng.normal(0, 0.3, n)) * gain
    excitation += rng.normal(0, 0.001, n)  # room noise in the pauses
    # time-varying filter: each 20 ms Hann-windowed frame (hop 10 ms, the windows sum to one) shaped in frequency
    size = 2 * hop
    window = np.hanning(size + 1)[:-1]
    freqs = np.fft.rfftfreq(size, 1.0 / rate)
    padded = np.concatenate([np.zeros(hop), excitation, np.zeros(size)])
    out = np.zeros(len(padded))
    for i, (kind, params) in enumerate(frames):
        if kind == "voiced":
            shape = sum(np.exp(-0.5 * ((freqs - f) / (60 + 0.06 * f)) ** 2) / (j + 1) for j, f in enumerate(params))
            shape = (shape + 0.01) / (1 + freqs / 3000)
        else:
            shape = np.exp(-0.5 * ((freqs - params[0]) / 1500.0) ** 2)
        seg = padded[i * hop:i * hop + size] * window
        out[i * hop:i * hop + size] += np.fft.irfft(np.fft.rfft(seg) * shape, size)
    out = out[hop:hop + n]
    out *= 0.5 / max(1e-9, float(np.max(np.abs(out))))
    return out.astype(np.float32)


class _Request:
    __slots__ = ("request_id", "remaining", "index", "queue", "done", "continuation")

    def __init__(self, request_id: str, patches: int, continuation: bool = False):
        self.request_id, self.remaining, self.index = request_id, patches, 0
        self.queue = ChunkQueue()
        self.done = False
        self.continuation = continuation  # carries a prompt: the previous segment's tail


class PacedStream(ChunkIterator):
    """What `generate` returns, its request already running: `aclose()` cancels (as `engine.generation.Generation`
    of a request with no audio to encode: `Engine.generate` sends those at once)."""

    def __init__(self, engine: PacedEngine, request: _Request):
        self._engine, self._request = engine, request

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def _queue(self) -> ChunkQueue:
        return self._request.queue

    def _cancel(self) -> None:
        self._engine._drop(self._request.request_id)


class PacedEngine:
    """`engine.Engine`'s API over a fixed waveform: one patch per request per tick (default: real time)."""

    def __init__(self, *, sample_rate: int = SAMPLE_RATE, patch_ms: float = PATCH_MS, tick_ms: float | None = None,
                 ms_per_char: float = 65.0, max_requests: int = 100_000, waveform: np.ndarray | None = None,
                 compile_stall_ms: float = 0.0):
        self.sample_rate = sample_rate
        # the tick that first serves a continuation request (a prompt from the previous segment) takes this much
        # longer, once: models an engine whose continuation path compiles a kernel the first time it runs (the real
        # engine's VAE priming did, ~1.2 s of Triton compile inside a step), which stalls every stream at once
        self.compile_stall_s = compile_stall_ms / 1000.0
        self.patch_ms = patch_ms
        self.samples_per_patch = int(round(sample_rate * patch_ms / 1000.0))
        self.tick_s = (patch_ms if tick_ms is None else tick_ms) / 1000.0  # < patch_ms: faster than real time
        self.ms_per_char = ms_per_char  # audio per character of text, ~speech rate, when max_length does not cap it
        self.max_requests = max_requests
        wave = speech_like(rate=sample_rate) if waveform is None else np.asarray(waveform, dtype=np.float32)
        # whole patches, so every chunk is a read-only view (no copy per chunk)
        n = max(1, len(wave) // self.samples_per_patch)
        wave = np.resize(wave, n * self.samples_per_patch)
        wave.flags.writeable = False
        self._patches = [wave[i * self.samples_per_patch:(i + 1) * self.samples_per_patch] for i in range(n)]
        self._latents = np.zeros(LATENT_SHAPE, dtype=np.float32)
        self._latents.flags.writeable = False
        self._running: dict[str, _Request] = {}
        self._buffered: dict[str, float] = {}
        self._ticker: asyncio.TimerHandle | None = None
        self._next_tick = 0.0
        self.ticks = 0
        self.chunks = 0
        self.late_ticks_ms: list[float] = []  # how late each tick ran: the gateway's event loop was busy

    # ---- requests ----------------------------------------------------------------------------------------
    def generate(self, text: str, *, max_length: int | None = None, request_id: str | None = None,
                 voice: str | None = None, prompt_latents: Any = None, **_: Any) -> PacedStream:
        """A stream of ceil(len(text) * ms_per_char / patch_ms) patches (at most max_length)."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidRequest("text is empty")
        if voice is not None:
            raise UnknownVoice(f"no stored voice {voice!r} (the paced stand-in has none)")
        if len(self._running) >= self.max_requests:
            raise EngineOverloaded(f"{len(self._running)} requests running")
        patches = max(1, math.ceil(len(text) * self.ms_per_char / self.patch_ms))
        if max_length is not None:
            patches = min(patches, max_length)
        request = _Request(request_id or uuid.uuid4().hex, patches, prompt_latents is not None)
        self._submit(request)
        return PacedStream(self, request)

    def _submit(self, request: _Request) -> None:
        self._running[request.request_id] = request
        if self._ticker is None:
            loop = asyncio.get_running_loop()
            self._next_tick = loop.time() + self.tick_s
            self._ticker = loop.call_at(self._next_tick, self._tick)

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self.compile_stall_s and any(r.continuation for r in self._running.values()):
            # compiling now, once: this tick's chunks (every stream's) come that much later
            stall, self.compile_stall_s = self.compile_stall_s, 0.0
            self._next_tick = now + stall
            self._ticker = loop.call_at(self._next_tick, self._tick)
            return
        self.late_ticks_ms.append((now - self._next_tick) * 1000.0)
        self.ticks += 1
        n = len(self._patches)
        for rid, req in list(self._running.items()):
            req.remaining -= 1
            last = req.remaining <= 0
            req.queue.put_nowait(AudioChunk(self._patches[req.index % n], self.sample_rate, req.index,
                                            self._latents, last, "length" if last else None, rid))
            req.index += 1
            self.chunks += 1
            if last:
                self._drop(rid, notify=False)
        if self._running:
            self._next_tick += self.tick_s
            if self._next_tick < now:  # fell behind by more than a tick: skip, as a real engine would run late
                self._next_tick = now + self.tick_s
            self._ticker = loop.call_at(self._next_tick, self._tick)
        else:
            self._ticker = None

    def _drop(self, request_id: str, notify: bool = True) -> None:
        req = self._running.pop(request_id, None)
        self._buffered.pop(request_id, None)
        if req is not None and notify:
            req.queue.put_nowait(None)

    async def cancel(self, request_id: str) -> None:
        self._drop(request_id)

    def update_buffered(self, request_id: str, audio_ms: float) -> None:
        if request_id in self._running:
            self._buffered[request_id] = float(audio_ms)

    # ---- voices and adapters: none -----------------------------------------------------------------------
    def list_voices(self) -> list[Any]:
        return []

    async def add_voice(self, **_: Any) -> str:
        raise InvalidRequest("the paced stand-in stores no voices")

    async def remove_voice(self, voice_id: str) -> None:
        raise UnknownVoice(f"no stored voice {voice_id!r}")

    def list_loras(self) -> list[Any]:
        return []

    async def register_lora(self, name: str, *_: Any, **__: Any) -> Any:
        raise InvalidRequest("the paced stand-in takes no LoRA adapters")

    async def unregister_lora(self, name: str) -> None:
        raise UnknownLoRA(f"no registered LoRA adapter {name!r}")

    # ---- status ------------------------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return ModelInfo(name="paced-stand-in (benchmark only: fixed waveform, real-time pace)",
                         architecture="stand-in", sample_rate=self.sample_rate,
                         samples_per_patch=self.samples_per_patch, patch_ms=self.patch_ms, max_length=4096,
                         is_demo=True, dtype="float32", device="cpu")

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._running), in_flight=len(self._running), steps=self.ticks, workers=1,
                           workers_ready=1)

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "workers": [], "error": None, "restarts": 0, "in_flight": len(self._running)}

    async def wait_for_ready(self) -> None:
        return None

    async def stop(self) -> None:
        for rid in list(self._running):
            self._drop(rid)
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
