"""The public engine API: async `Engine` (and blocking `SyncEngine`) over one worker process per device.

The caller's process holds the model config and tokenizer (no weights): every request is validated and turned into
a prompt here, so bad input is a typed `InvalidRequest` before anything is queued. Each new turn goes to the worker
with the most headroom (`headroom`: free sequence room and free KV blocks from the stats every worker reports each
step, avoiding a worker that is late on a listener's deadline); a reader thread per worker turns its step messages
into `AudioChunk`s and hands them to the event loop.

Placement: `devices` lists CUDA indices (`[0, 1]`: one worker per GPU) or device names (`["cpu", "cpu"]`: two CPU
workers); with `tensor_parallel_size=N` every N consecutive devices form one worker whose model is split across them
(`engine.distributed`, `engine.model.parallel`). Stored voices are registered on every worker.
A worker that dies fails its in-flight requests with `WorkerCrashed` at once (its process sentinel wakes the
reader) and is started again, stored voices included.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import multiprocessing as mp
import queue
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.checkpoint import resolve_model_dir
from engine.config import ModelConfig
from engine.distributed import disable_nvls
from engine.errors import (
    EmptyText,
    EngineError,
    EngineOverloaded,
    EngineStopped,
    InvalidAudio,
    InvalidLoRA,
    InvalidParameter,
    InvalidRequest,
    TextTooLong,
    UnknownLoRA,
    UnknownVoice,
    WorkerCrashed,
)
from engine.model.parallel import check_tensor_parallel
from engine.request import RequestSpec, SamplingParams
from engine.text import Tokenizer, normalize_text
from engine.worker import AudioRing, WorkerConfig, run_worker

log = logging.getLogger(__name__)

RING_SECONDS = 20.0  # shared-memory audio ring per worker, in seconds of audio at the model's rate
MAX_TIMESTEPS = 100
MAX_CFG = 20.0
MAX_TEMPERATURE = 5.0
RESTART_WINDOW_S = 60.0
MAX_RESTARTS_PER_WINDOW = 5
LATE_SLACK_MS = 300.0  # a worker whose most starved settled listener has less than this buffered is running late


@dataclass
class AudioChunk:
    audio: np.ndarray  # float32 mono at sample_rate, one patch
    sample_rate: int
    index: int
    latents: np.ndarray  # [P, D] the patch
    is_last: bool
    stop_reason: str | None
    request_id: str


@dataclass
class ModelInfo:
    name: str
    architecture: str
    sample_rate: int
    samples_per_patch: int
    patch_ms: float
    max_length: int
    is_demo: bool
    dtype: str
    device: str


@dataclass
class VoiceInfo:
    voice_id: str
    mode: str  # "reference" (v2: shared prefix KV) or "prompt" (continuation from the voice's audio and text)
    num_patches: int
    text: str | None
    lora: str | None = None  # the LoRA adapter every request of this voice uses


@dataclass
class LoRAInfo:
    name: str
    rank: int
    alpha: float
    num_layers: int  # target linears the adapter changes
    num_parameters: int
    in_flight: int  # requests using it now


@dataclass
class _LoRA:
    adapter: Any  # engine.lora.LoRAAdapter (float32 CPU weights: resent to a restarted worker)
    users: set[str] = field(default_factory=set)  # request ids in flight
    drained: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    in_flight: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    voice_blocks: int = 0
    steps: int = 0
    preemptions: int = 0
    workers: int = 0
    workers_ready: int = 0
    worker_restarts: int = 0


@dataclass
class _Voice:
    info: VoiceInfo
    latents: torch.Tensor  # [T, P, D]
    text: str | None
    prefix: RequestSpec | None  # v2: the reference prefix whose KV every worker keeps


@dataclass
class _Stream:
    request_id: str
    worker: _WorkerHandle
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False
    lora: _LoRA | None = None


class _WorkerHandle:
    """One worker process and the two threads that talk to it (a sender, so the event loop never blocks on a
    full pipe, and a reader, which also watches the process sentinel)."""

    def __init__(self, engine: Engine, index: int, cfg: WorkerConfig, ring_floats: int):
        self.engine, self.index, self.cfg = engine, index, cfg
        ctx = mp.get_context("spawn")
        self.shm = SharedMemory(create=True, size=4 * ring_floats)
        read_pos = ctx.Value("q", 0, lock=False)
        self.ring = AudioRing(self.shm, read_pos, owner=True)
        cmd_recv, self.cmd_send = ctx.Pipe(duplex=False)
        self.results, res_send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=run_worker, args=(cfg, cmd_recv, res_send, self.shm.name, read_pos),
                                   daemon=True, name=f"voxgate-worker-{index}")
        self.process.start()
        cmd_recv.close()
        res_send.close()
        self.info: dict[str, Any] = {}
        self.stats: dict[str, int] = {}
        self.ready = asyncio.Event()
        self.alive = True
        self.in_flight: set[str] = set()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ready_flag = threading.Event()
        threading.Thread(target=self._send_loop, daemon=True, name=f"voxgate-send-{index}").start()
        threading.Thread(target=self._read_loop, daemon=True, name=f"voxgate-read-{index}").start()

    def send(self, msg: tuple[Any, ...]) -> None:
        self._outbox.put(msg)

    def _send_loop(self) -> None:
        self._ready_flag.wait()
        while (msg := self._outbox.get()) is not None:
            try:
                self.cmd_send.send(msg)
            except (OSError, ValueError):  # the process died; the reader reports it
                return

    def _read_loop(self) -> None:
        loop = self.engine.loop
        while True:
            ready = wait([self.results, self.process.sentinel])
            if self.results in ready:
                try:
                    msg = self.results.recv()
                except (EOFError, OSError):
                    break
                if msg[0] == "ready":
                    self._ready_flag.set()
                if msg[0] == "step":
                    msg = self._unpack_step(msg)
                loop.call_soon_threadsafe(self.engine._on_message, self, msg)
            elif self.process.sentinel in ready:
                break
        self._outbox.put(None)
        loop.call_soon_threadsafe(self.engine._on_exit, self)

    def _unpack_step(self, msg: tuple[Any, ...]) -> tuple[Any, ...]:
        _, chunks, audio, stats = msg
        if isinstance(audio, tuple):  # a span of the shared ring: one copy out, then the slot is free again
            audio = self.ring.read(*audio)
        sr = self.engine.config.sample_rate
        out = [AudioChunk(audio[a:b], sr, index, latents, last, reason, rid)
               for rid, index, latents, a, b, last, reason in chunks]
        return ("step", out, stats)

    def close(self, timeout: float = 5.0) -> None:
        self.alive = False
        self.send(("stop",))
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1.0)
        self._outbox.put(None)
        self.ring.close()


class Engine:
    """Async streaming TTS engine: one worker process per device, continuous batching inside each."""

    def __init__(self, model: str | None = None, *, devices: list[int | str] | None = None,
                 tensor_parallel_size: int = 1, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 4096, gpu_memory_utilization: float = 0.9,
                 inference_timesteps: int = 10, dtype: str | None = None, block_size: int = 16,
                 num_kv_blocks: int | None = None, max_waiting: int | None = None, sit_out_ms: float = 2000.0,
                 worker_threads: int = 1, max_loras: int = 0, max_lora_rank: int = 32):
        self.loop = asyncio.get_running_loop()
        self.is_demo = model is None and not torch.cuda.is_available()
        if model is None:
            from engine.random_checkpoint import demo_model_dir

            model = str(demo_model_dir()) if self.is_demo else "openbmb/VoxCPM2"
        _check_int("max_num_seqs", max_num_seqs, 1)
        _check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        _check_int("block_size", block_size, 1)
        _check_int("inference_timesteps", inference_timesteps, 1, MAX_TIMESTEPS)
        _check_int("max_loras", max_loras, 0, 4096)
        _check_int("max_lora_rank", max_lora_rank, 1, 1024)
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise InvalidParameter(f"gpu_memory_utilization must be in (0, 1] (got {gpu_memory_utilization})")
        self.path: Path = resolve_model_dir(model)
        self.name = model
        self.config = ModelConfig.from_file(self.path / "config.json")
        self.tokenizer = Tokenizer.from_dir(self.path)
        _check_int("tensor_parallel_size", tensor_parallel_size, 1)
        try:
            check_tensor_parallel(self.config, tensor_parallel_size)
        except ValueError as e:
            raise InvalidParameter(str(e)) from None
        groups = _device_groups(devices, tensor_parallel_size)
        disable_nvls()  # inherited by every worker and tensor-parallel rank started from here
        self.default_timesteps = inference_timesteps
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_num_seqs if max_waiting is None else max_waiting
        self._worker_configs = [WorkerConfig(
            model=str(self.path), device=group[0], dtype=dtype, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            num_kv_blocks=num_kv_blocks, gpu_memory_utilization=gpu_memory_utilization,
            inference_timesteps=inference_timesteps, sit_out_ms=sit_out_ms, threads=worker_threads,
            tp_devices=tuple(group) if len(group) > 1 else (), max_loras=max_loras, max_lora_rank=max_lora_rank)
            for group in groups]
        self._ring_floats = int(RING_SECONDS * self.config.sample_rate) + max_num_seqs * self.config.samples_per_patch
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, tuple[asyncio.Future, _WorkerHandle]] = {}
        self._call_ids = itertools.count()
        self._voices: dict[str, _Voice] = {}
        self._loras: dict[str, _LoRA] = {}
        self._lora_layout: dict[str, tuple[int, int]] | None = None
        self._restarts = 0
        self._restart_times: list[float] = []
        self._stopped = False
        self._fatal: str | None = None
        self._workers = [self._start_worker(i) for i in range(len(groups))]

    @classmethod
    def from_pretrained(cls, model: str | None = None, **kwargs: Any) -> Engine | SyncEngine:
        """An `Engine` when called inside a running event loop, else a blocking `SyncEngine`."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return SyncEngine(model, **kwargs)
        return cls(model, **kwargs)

    # ---- workers -----------------------------------------------------------------------------------------
    def _start_worker(self, index: int) -> _WorkerHandle:
        return _WorkerHandle(self, index, self._worker_configs[index], self._ring_floats)

    def _on_message(self, worker: _WorkerHandle, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "step":
            worker.stats = msg[2]
            for chunk in msg[1]:
                stream = self._streams.get(chunk.request_id)
                if stream is not None and not stream.done:
                    stream.queue.put_nowait(chunk)
                    if chunk.is_last:
                        self._forget(stream)
        elif kind == "stats":
            worker.stats = msg[1]
        elif kind == "reply":
            _, call, ok, value = msg
            fut = self._calls.pop(call, (None, None))[0]
            if fut is not None and not fut.done():
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(InvalidAudio(value))
        elif kind == "failed":
            stream = self._streams.get(msg[1])
            if stream is not None:
                stream.queue.put_nowait(EngineError(f"request {msg[1]} failed in the worker: {msg[2]}"))
                self._forget(stream)
        elif kind == "ready":
            worker.info = msg[1]
            worker.ready.set()
        elif kind == "fatal":
            self._fatal = msg[1]
            log.error("worker %d failed to start: %s", worker.index, msg[1])

    def _on_exit(self, worker: _WorkerHandle) -> None:
        """The worker process ended: fail what it held, then start a new one unless we are stopping."""
        if not worker.alive:
            return
        worker.alive = False
        error = WorkerCrashed(f"worker {worker.index} ({worker.cfg.device}) exited with code "
                              f"{worker.process.exitcode}")
        for rid in list(worker.in_flight):
            stream = self._streams.get(rid)
            if stream is not None:
                stream.queue.put_nowait(error)
                self._forget(stream)
        for call, (fut, w) in list(self._calls.items()):
            if w is worker:
                del self._calls[call]
                if not fut.done():
                    fut.set_exception(error)
        worker.ring.close()
        if not worker.ready.is_set() and self._fatal is None:  # died while loading: restarting would loop
            self._fatal = f"worker {worker.index} exited with code {worker.process.exitcode} while starting"
        if self._stopped or self._fatal is not None:
            if self._fatal is not None:
                worker.ready.set()  # wake waiters so they see the fatal error
            return
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < RESTART_WINDOW_S] + [now]
        if len(self._restart_times) > MAX_RESTARTS_PER_WINDOW:  # a worker that keeps dying is broken, not unlucky
            self._fatal = f"{error}; {len(self._restart_times)} crashes in {RESTART_WINDOW_S:.0f} s, not restarting"
            log.error("%s", self._fatal)
            worker.ready.set()
            return
        log.warning("%s; restarting it", error)
        self._restarts += 1
        new = self._start_worker(worker.index)
        self._workers[worker.index] = new
        for lora in self._loras.values():
            new.send(("lora_add", next(self._call_ids), lora.adapter))
        for voice in self._voices.values():
            if voice.prefix is not None:
                new.send(("voice", next(self._call_ids), voice.prefix))

    def _forget(self, stream: _Stream) -> None:
        if stream.lora is not None:
            stream.lora.users.discard(stream.request_id)
            if not stream.lora.users:
                stream.lora.drained.set()
        stream.done = True
        self._streams.pop(stream.request_id, None)
        stream.worker.in_flight.discard(stream.request_id)

    def _pick_worker(self) -> _WorkerHandle:
        if self._stopped:
            raise EngineStopped("the engine is stopped")
        if self._fatal is not None:
            raise EngineStopped(f"the worker cannot start: {self._fatal}")
        worker = max(self._workers, key=lambda w: (w.ready.is_set() and w.alive,
                                                   headroom(w.stats, len(w.in_flight), self.max_num_seqs),
                                                   -len(w.in_flight)))
        if len(worker.in_flight) >= self.max_num_seqs + self.max_waiting:
            raise EngineOverloaded(f"{len(worker.in_flight)} requests in flight on the least loaded worker "
                                   f"(limit {self.max_num_seqs} running + {self.max_waiting} waiting)")
        return worker

    async def _call(self, worker: _WorkerHandle, *msg: Any) -> Any:
        await self._wait_ready(worker)
        call = next(self._call_ids)
        fut = self.loop.create_future()
        self._calls[call] = (fut, worker)
        worker.send((msg[0], call, *msg[1:]))
        return await fut

    async def _wait_ready(self, worker: _WorkerHandle) -> None:
        await worker.ready.wait()
        if self._fatal is not None:
            raise EngineStopped(f"the worker cannot start: {self._fatal}")

    # ---- requests ----------------------------------------------------------------------------------------
    def generate(self, text: str, *, voice: str | None = None, prompt_audio: Any = None,
                 prompt_sample_rate: int | None = None, prompt_latents: Any = None, prompt_text: str | None = None,
                 reference_audio: Any = None, reference_latents: Any = None, cfg_value: float = 2.0,
                 temperature: float = 1.0, seed: int | None = None, max_length: int | None = None,
                 min_length: int = 2, timesteps: int | None = None, priority: int = 0,
                 request_id: str | None = None, lora: str | None = None) -> Generation:
        """Stream one patch of audio per step. Input errors raise here; closing the iterator cancels.

        `lora` names a registered adapter (default: the stored voice's adapter, if it names one)."""
        if not isinstance(text, str):
            raise InvalidParameter(f"text must be a string (got {type(text).__name__})")
        if not normalize_text(text):
            raise EmptyText("text is empty")
        _check_float("cfg_value", cfg_value, 0.0, MAX_CFG)
        _check_float("temperature", temperature, 0.0, MAX_TEMPERATURE)
        timesteps = self.default_timesteps if timesteps is None else timesteps
        _check_int("timesteps", timesteps, 1, MAX_TIMESTEPS)
        _check_int("min_length", min_length, 0)
        if max_length is not None:
            _check_int("max_length", max_length, 1)
        _check_int("priority", priority, -1000, 1000)
        if seed is None:
            seed = random.getrandbits(63)
        _check_int("seed", seed, 0, 2**63 - 1)
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if not isinstance(request_id, str) or not request_id:
            raise InvalidParameter("request_id must be a non-empty string")
        if request_id in self._streams:
            raise InvalidParameter(f"request_id {request_id!r} is already in flight")
        v = None
        if voice is not None:
            v = self._voices.get(voice)
            if v is None:
                raise UnknownVoice(f"no stored voice {voice!r}")
            if prompt_audio is not None or prompt_latents is not None or reference_audio is not None \
                    or reference_latents is not None:
                raise InvalidParameter("give either a stored voice or prompt/reference audio, not both")
        if (prompt_audio is not None) + (prompt_latents is not None) > 1 or \
                (reference_audio is not None) + (reference_latents is not None) > 1:
            raise InvalidParameter("give audio or latents, not both")
        if (prompt_audio is not None or prompt_latents is not None) and not prompt_text:
            raise InvalidParameter("prompt audio needs its transcript (prompt_text)")
        if prompt_text and prompt_audio is None and prompt_latents is None:
            raise InvalidParameter("prompt_text needs prompt audio (prompt_audio or prompt_latents)")
        if (reference_audio is not None or reference_latents is not None) and not self.config.is_v2:
            raise InvalidParameter(f"reference audio needs a VoxCPM2 model ({self.config.architecture} has none)")
        params = SamplingParams(cfg_value=float(cfg_value), temperature=float(temperature), seed=seed,
                                max_length=max_length or 0, min_length=min_length, timesteps=timesteps,
                                priority=priority)
        prompt_patches = self._latents(prompt_latents, "prompt_latents") if prompt_latents is not None else None
        ref_patches = self._latents(reference_latents, "reference_latents") if reference_latents is not None \
            else None
        if v is not None:
            ref_patches = v.latents if v.info.mode == "reference" else None
            if v.text is not None:
                prompt_text, prompt_patches = v.text, v.latents
            lora = v.info.lora if lora is None else lora
        adapter = self._lora(lora)
        worker = self._pick_worker()
        # the voice's shared prefix KV was computed under the voice's adapter: another adapter recomputes it
        shared = v is not None and v.prefix is not None and lora == v.info.lora
        args = dict(text=text, prompt_text=prompt_text, prompt_patches=prompt_patches, ref_patches=ref_patches,
                    params=params, request_id=request_id, voice_id=voice if shared else None, lora=lora)
        spec = None
        if prompt_audio is None and reference_audio is None:
            spec = self._spec(**args)  # all checks done before the caller iterates
        stream = _Stream(request_id, worker, lora=adapter)
        if adapter is not None:
            adapter.users.add(request_id)
            adapter.drained.clear()
        self._streams[request_id] = stream
        worker.in_flight.add(request_id)
        audio = (prompt_audio, reference_audio, prompt_sample_rate)
        return Generation(self, stream, spec, args if spec is None else None, audio)

    async def _submit(self, stream: _Stream, spec: RequestSpec | None, args: dict | None,
                      audio: tuple[Any, Any, int | None]) -> None:
        if spec is None:
            assert args is not None
            prompt_audio, reference_audio, sr = audio
            if prompt_audio is not None:
                args["prompt_patches"] = await self._encode(prompt_audio, sr, "left")
            if reference_audio is not None:
                args["ref_patches"] = await self._encode(reference_audio, sr, "right")
            spec = self._spec(**args)
        await self._wait_ready(stream.worker)
        if stream.done:
            return
        stream.worker.send(("add", spec))

    def _spec(self, *, text: str, prompt_text: str | None, prompt_patches: torch.Tensor | None,
              ref_patches: torch.Tensor | None, params: SamplingParams, request_id: str,
              voice_id: str | None, lora: str | None = None) -> RequestSpec:
        from engine.prompt import build_prompt, length_cap

        try:
            prompt = build_prompt(self.config, self.tokenizer, text, prompt_text=prompt_text,
                                  prompt_patches=prompt_patches, reference_patches=ref_patches)
        except EngineError:
            raise
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        n = len(prompt.token_ids)
        room = self._kv_positions() - n
        cap = length_cap(prompt.n_target_tokens, params.max_length or self.config.max_length)
        cap = min(cap, self.config.max_length - n, room)
        if cap < 1:
            raise TextTooLong(f"the prompt takes {n} positions; the model has {self.config.max_length} and the KV "
                              f"cache {self._kv_positions()}: no room left to speak")
        params.max_length = cap
        return RequestSpec(
            request_id=request_id, token_ids=[int(t) for t in prompt.token_ids],
            patches=torch.as_tensor(prompt.patches, dtype=torch.float32),
            audio_mask=[int(m) for m in prompt.audio_mask], cond=torch.as_tensor(prompt.cond, dtype=torch.float32),
            context_patches=None if prompt.context_patches is None else
            torch.as_tensor(prompt.context_patches, dtype=torch.float32),
            params=params, voice_id=voice_id, lora=lora)

    def _kv_positions(self) -> int:
        cfg = self._worker_configs[0]
        blocks = min((w.info.get("num_blocks", math.inf) for w in self._workers), default=math.inf)
        blocks = cfg.num_kv_blocks or blocks
        return int(min(blocks * cfg.block_size, 2**62))

    def _latents(self, latents: Any, name: str) -> torch.Tensor:
        shape = (self.config.patch_size, self.config.feat_dim)
        try:
            t = torch.as_tensor(np.asarray(latents), dtype=torch.float32)
        except (TypeError, ValueError) as e:
            raise InvalidAudio(f"{name}: not an array of numbers ({e})") from None
        if t.ndim != 3 or tuple(t.shape[1:]) != shape or t.shape[0] == 0:
            raise InvalidAudio(f"{name} must be [T, {shape[0]}, {shape[1]}] with T >= 1 (got {tuple(t.shape)})")
        if not torch.isfinite(t).all():
            raise InvalidAudio(f"{name} holds NaN or infinite values")
        return t

    async def cancel(self, request_id: str) -> None:
        """Stop a request; its iterator ends with a chunk-less `is_last`-free stop (it just returns)."""
        self._cancel_nowait(request_id)

    def _cancel_nowait(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        self._forget(stream)
        stream.queue.put_nowait(None)
        if stream.worker.alive:
            stream.worker.send(("cancel", request_id))

    def update_buffered(self, request_id: str, audio_ms: float) -> None:
        """The listener of `request_id` has `audio_ms` of audio queued (drives deadline-first scheduling)."""
        if not isinstance(audio_ms, (int, float)) or not math.isfinite(audio_ms):
            raise InvalidParameter(f"audio_ms must be a finite number (got {audio_ms!r})")
        stream = self._streams.get(request_id)
        if stream is not None and stream.worker.alive:
            stream.worker.send(("buffered", request_id, float(audio_ms)))

    # ---- audio and voices --------------------------------------------------------------------------------
    async def encode_audio(self, audio: bytes | np.ndarray, sample_rate: int | None = None,
                           _pad: str = "left") -> np.ndarray:
        """Prompt audio (file bytes, or samples with their rate) -> patches [T, P, D] float32."""
        return (await self._encode(audio, sample_rate, _pad)).numpy()

    async def _encode(self, audio: Any, sample_rate: int | None, pad: str) -> torch.Tensor:
        from engine.prompt import _mono, read_audio

        if isinstance(audio, (bytes, bytearray, memoryview)):
            audio, sample_rate = read_audio(bytes(audio))
        elif sample_rate is None:
            raise InvalidParameter("sample_rate is required with raw samples")
        _check_int("sample_rate", sample_rate, 1000, 384000)
        samples = _mono(audio)  # raises InvalidAudio here, in the caller, before the worker sees it
        return await self._call(self._pick_worker(), "encode", samples, sample_rate, pad)

    async def add_voice(self, *, audio: Any = None, sample_rate: int | None = None, latents: Any = None,
                        text: str | None = None, voice_id: str | None = None, lora: str | None = None) -> str:
        """Store a voice. VoxCPM2: a reference voice whose prefix KV is computed once per worker and shared by
        every request of the voice. VoxCPM 0.5B/1.5: prompt audio + its transcript `text` (continuation).
        `lora` names a registered adapter the voice's requests use; with no audio the voice is the adapter alone."""
        self._lora(lora)
        if lora is not None and audio is None and latents is None and text is None:
            voice_id = voice_id or uuid.uuid4().hex[:12]
            if not isinstance(voice_id, str):
                raise InvalidParameter("voice_id must be a string")
            if voice_id in self._voices:
                await self.remove_voice(voice_id)
            self._voices[voice_id] = _Voice(VoiceInfo(voice_id, "lora", 0, None, lora), None, None, None)
            return voice_id
        if (audio is None) == (latents is None):
            raise InvalidParameter("give the voice as audio or as latents (exactly one)")
        if text is not None and not normalize_text(text):
            raise InvalidParameter("text is empty")
        if not self.config.is_v2 and text is None:
            raise InvalidParameter(f"a {self.config.architecture} voice is a prompt: give its transcript (text)")
        voice_id = voice_id or uuid.uuid4().hex[:12]
        if not isinstance(voice_id, str):
            raise InvalidParameter("voice_id must be a string")
        reference = self.config.is_v2
        pad = "right" if reference else "left"
        patches = self._latents(latents, "latents") if latents is not None else \
            await self._encode(audio, sample_rate, pad)
        prefix = self._voice_prefix(voice_id, patches, lora) if reference else None
        if voice_id in self._voices:
            await self.remove_voice(voice_id)
        voice = _Voice(VoiceInfo(voice_id, "reference" if reference else "prompt", int(patches.shape[0]), text,
                                 lora), patches, text, prefix)
        if prefix is not None:
            await asyncio.gather(*(self._call(w, "voice", prefix) for w in self._workers))
        self._voices[voice_id] = voice
        return voice_id

    def _voice_prefix(self, voice_id: str, ref: torch.Tensor, lora: str | None = None) -> RequestSpec:
        """`[103, ref..., 104]`: the first positions of every prompt of this voice, as a prefix-only request."""
        from engine.prompt import build_prompt

        prompt = build_prompt(self.config, self.tokenizer, "a", reference_patches=ref)
        n = ref.shape[0] + 2
        if n > self._kv_positions():
            raise TextTooLong(f"the voice takes {n} positions, more than the KV cache holds")
        return RequestSpec(
            request_id=f"voice:{voice_id}:{uuid.uuid4().hex[:8]}", token_ids=[int(t) for t in prompt.token_ids[:n]],
            patches=torch.as_tensor(prompt.patches[:n], dtype=torch.float32),
            audio_mask=[int(m) for m in prompt.audio_mask[:n]],
            cond=torch.zeros(self.config.patch_size, self.config.feat_dim), context_patches=None,
            params=SamplingParams(), voice_id=voice_id, prefix_only=True, lora=lora)

    async def remove_voice(self, voice_id: str) -> None:
        if self._voices.pop(voice_id, None) is None:
            raise UnknownVoice(f"no stored voice {voice_id!r}")
        for w in self._workers:
            if w.alive:
                w.send(("remove_voice", voice_id))

    def list_voices(self) -> list[VoiceInfo]:
        return [v.info for v in self._voices.values()]

    # ---- LoRA adapters -----------------------------------------------------------------------------------
    def _lora(self, name: str | None) -> _LoRA | None:
        if name is None:
            return None
        if not isinstance(name, str):
            raise InvalidParameter(f"lora must be an adapter name (got {type(name).__name__})")
        entry = self._loras.get(name)
        if entry is None:
            raise UnknownLoRA(f"no registered LoRA adapter {name!r}")
        return entry

    async def register_lora(self, name: str, source: str | Path | dict[str, torch.Tensor],
                            config: dict[str, Any] | None = None) -> LoRAInfo:
        """Load an adapter (a directory with lora_weights.safetensors + lora_config.json, the .safetensors file,
        or tensors with `config`), check it against the model and put it on every worker. Bad adapters raise
        `InvalidLoRA` here, before any worker sees them."""
        from engine.lora import load_adapter, lora_layout

        max_loras, max_rank = self._worker_configs[0].max_loras, self._worker_configs[0].max_lora_rank
        if not max_loras:
            raise InvalidLoRA("this engine has no LoRA slots: start it with max_loras >= 1")
        if isinstance(name, str) and name in self._loras:
            raise InvalidLoRA(f"a LoRA adapter named {name!r} is already registered: unregister it first")
        if self._lora_layout is None:
            self._lora_layout = lora_layout(self.config)
        adapter = await asyncio.to_thread(load_adapter, name, source, self._lora_layout, max_rank, config)
        if name in self._loras:  # registered meanwhile
            raise InvalidLoRA(f"a LoRA adapter named {name!r} is already registered: unregister it first")
        await asyncio.gather(*(self._call(w, "lora_add", adapter) for w in self._workers))
        entry = _LoRA(adapter)
        entry.drained.set()
        self._loras[name] = entry
        return self._lora_info(entry)

    async def unregister_lora(self, name: str) -> None:
        """Refuse new requests for the adapter at once, wait for those in flight to finish, then free it."""
        entry = self._lora(name)
        users = [v.info.voice_id for v in self._voices.values() if v.info.lora == name]
        if users:
            raise InvalidParameter(f"LoRA adapter {name!r} is used by stored voice(s) {users}: remove them first")
        del self._loras[name]
        await entry.drained.wait()
        await asyncio.gather(*(self._call(w, "lora_remove", name) for w in self._workers if w.alive))

    def list_loras(self) -> list[LoRAInfo]:
        return [self._lora_info(e) for e in self._loras.values()]

    def _lora_info(self, entry: _LoRA) -> LoRAInfo:
        a = entry.adapter
        return LoRAInfo(a.name, a.rank, a.alpha, len(a.weights), a.num_parameters, len(entry.users))

    # ---- status ------------------------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        info = self._workers[0].info if self._workers else {}
        c = self.config
        return ModelInfo(name=self.name, architecture=c.architecture, sample_rate=c.sample_rate,
                         samples_per_patch=c.samples_per_patch, patch_ms=c.patch_ms, max_length=c.max_length,
                         is_demo=self.is_demo, dtype=info.get("dtype", self._worker_configs[0].dtype or "auto"),
                         device=info.get("device", self._worker_configs[0].device))

    def stats(self) -> EngineStats:
        s = EngineStats(in_flight=len(self._streams), workers=len(self._workers),
                        workers_ready=sum(w.ready.is_set() and w.alive for w in self._workers),
                        worker_restarts=self._restarts)
        for w in self._workers:
            for key in ("running", "waiting", "free_blocks", "total_blocks", "voice_blocks", "steps", "preemptions"):
                setattr(s, key, getattr(s, key) + w.stats.get(key, 0))
        return s

    def health(self) -> dict[str, Any]:
        ready = [w.ready.is_set() and w.alive for w in self._workers]
        status = "stopped" if self._stopped else "failed" if self._fatal else \
            "ok" if all(ready) else "degraded" if any(ready) else "starting"
        return {"status": status, "workers": [{"device": w.cfg.device, "devices": list(w.cfg.tp_devices or
                                                                                  [w.cfg.device]),
                                               "ready": r, "pid": w.process.pid, "in_flight": len(w.in_flight),
                                               "stats": dict(w.stats)}
                                              for w, r in zip(self._workers, ready, strict=True)],
                "error": self._fatal, "restarts": self._restarts, "in_flight": len(self._streams)}

    async def wait_for_ready(self) -> None:
        for w in list(self._workers):
            await self._wait_ready(w)

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(EngineStopped("the engine stopped"))
            self._forget(stream)
        for call, (fut, _) in list(self._calls.items()):
            del self._calls[call]
            if not fut.done():
                fut.set_exception(EngineStopped("the engine stopped"))
        await asyncio.gather(*(asyncio.to_thread(w.close) for w in self._workers))


class Generation(AsyncIterator[AudioChunk]):
    """The async iterator `Engine.generate` returns: submits on first use; closing it (or dropping it) cancels."""

    def __init__(self, engine: Engine, stream: _Stream, spec: RequestSpec | None, args: dict | None,
                 audio: tuple[Any, Any, int | None]):
        self._engine, self._stream, self._spec, self._args, self._audio = engine, stream, spec, args, audio
        self._submitted = False
        self._finished = False

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> AudioChunk:
        if self._finished:
            raise StopAsyncIteration
        try:
            if not self._submitted:
                self._submitted = True
                await self._engine._submit(self._stream, self._spec, self._args, self._audio)
            item = await self._stream.queue.get()
        except BaseException:
            self._close()
            raise
        if item is None:  # cancelled
            self._finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        if item.is_last:
            self._finished = True
        return item

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        if not self._finished:
            self._finished = True
            self._engine._cancel_nowait(self._stream.request_id)

    def __del__(self) -> None:
        if not self._finished and not self._engine.loop.is_closed():
            self._engine.loop.call_soon_threadsafe(self._engine._cancel_nowait, self._stream.request_id)


class SyncEngine:
    """The same API, blocking, for code without an event loop: an `Engine` runs on a private loop thread."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="voxgate-engine")
        self._thread.start()

        async def make() -> Engine:
            return Engine(model, **kwargs)

        self.engine: Engine = self._run(make())

    def _run(self, coro: Any) -> Any:
        if not self._loop.is_running():
            coro.close()
            raise EngineStopped("the engine is stopped")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        async def call() -> Any:
            return fn(*args, **kwargs)

        return self._run(call())

    def generate(self, text: str, **kwargs: Any) -> Iterator[AudioChunk]:
        """Input errors raise here, at the call; the chunks come as the returned iterator is consumed."""
        return self._iterate(self._call(self.engine.generate, text, **kwargs))

    def _iterate(self, gen: Generation) -> Iterator[AudioChunk]:
        try:
            while True:
                try:
                    yield self._run(gen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(gen.aclose())

    def cancel(self, request_id: str) -> None:
        self._run(self.engine.cancel(request_id))

    def update_buffered(self, request_id: str, audio_ms: float) -> None:
        self._call(self.engine.update_buffered, request_id, audio_ms)

    def add_voice(self, **kwargs: Any) -> str:
        return self._run(self.engine.add_voice(**kwargs))

    def remove_voice(self, voice_id: str) -> None:
        self._run(self.engine.remove_voice(voice_id))

    def list_voices(self) -> list[VoiceInfo]:
        return self._call(self.engine.list_voices)

    def register_lora(self, name: str, source: Any, config: dict[str, Any] | None = None) -> LoRAInfo:
        return self._run(self.engine.register_lora(name, source, config))

    def unregister_lora(self, name: str) -> None:
        self._run(self.engine.unregister_lora(name))

    def list_loras(self) -> list[LoRAInfo]:
        return self._call(self.engine.list_loras)

    def encode_audio(self, audio: bytes | np.ndarray, sample_rate: int | None = None) -> np.ndarray:
        return self._run(self.engine.encode_audio(audio, sample_rate))

    def model_info(self) -> ModelInfo:
        return self._call(self.engine.model_info)

    def health(self) -> dict[str, Any]:
        return self._call(self.engine.health)

    def stats(self) -> EngineStats:
        return self._call(self.engine.stats)

    def wait_for_ready(self) -> None:
        self._run(self.engine.wait_for_ready())

    def stop(self) -> None:
        if self._loop.is_running():
            self._run(self.engine.stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)


def headroom(stats: dict[str, Any], in_flight: int, max_num_seqs: int) -> float:
    """How much more a worker can take, from the stats it reports every step: the tighter of its free sequence
    room and its free KV blocks (both fractions), less one whole unit while it is late on a deadline (a listener
    about to starve), so a late worker gets new turns only when every worker is late."""
    seqs = max(in_flight, int(stats.get("running", 0)) + int(stats.get("waiting", 0)))
    room = 1.0 - seqs / max_num_seqs
    total = stats.get("total_blocks") or 0
    if total:  # requests routed since the last report hold no blocks yet: charge them the average
        used = total - stats.get("free_blocks", total) - stats.get("voice_blocks", 0)
        reported = int(stats.get("running", 0)) + int(stats.get("waiting", 0))
        unseen = max(0, in_flight - reported)
        per_seq = used / reported if reported else 0.0
        room = min(room, (stats.get("free_blocks", total) - unseen * per_seq) / total)
    slack = stats.get("min_slack_ms")
    if slack is not None and slack < LATE_SLACK_MS:
        room -= 1.0
    return room


def _device_groups(devices: list[int | str] | None, tp: int) -> list[list[str]]:
    """Device names, one list per worker: `tp` consecutive devices form one tensor-parallel group.

    `devices` holds CUDA indices (0, 1) or torch device names ("cuda:1", "cpu"); "cpu" may repeat, for several CPU
    workers (or ranks). Default: the first `tp` GPUs, or `tp` CPU ranks without a GPU."""
    if devices is None:
        devices = list(range(tp)) if torch.cuda.is_available() else ["cpu"] * tp
    if not isinstance(devices, (list, tuple)) or not devices:
        raise InvalidParameter("devices must be a non-empty list of CUDA indices or device names")
    names = []
    for d in devices:
        try:
            dev = torch.device(f"cuda:{d}" if isinstance(d, int) and not isinstance(d, bool) else d)
        except (RuntimeError, TypeError):
            raise InvalidParameter(f"devices: {d!r} is neither a CUDA index nor a device name") from None
        if dev.type == "cuda" and not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
            raise InvalidParameter(f"devices: {d!r} is not a CUDA device available here")
        if dev.type not in ("cuda", "cpu"):
            raise InvalidParameter(f"devices: {d!r}: only CUDA devices and the CPU are supported")
        names.append(f"cuda:{dev.index or 0}" if dev.type == "cuda" else "cpu")
    if len(names) % tp:
        raise InvalidParameter(f"{len(names)} devices do not split into tensor-parallel groups of {tp}")
    groups = [names[i:i + tp] for i in range(0, len(names), tp)]
    for g in groups:
        if len({torch.device(n).type for n in g}) > 1:
            raise InvalidParameter(f"a tensor-parallel group cannot mix the CPU and GPUs ({g})")
        if g[0] != "cpu" and len(set(g)) < len(g):
            raise InvalidParameter(f"a tensor-parallel group needs distinct GPUs ({g})")
    return groups


def _check_int(name: str, value: Any, lo: int, hi: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidParameter(f"{name} must be an integer in [{lo}, {hi}] (got {value!r})")


def _check_float(name: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise InvalidParameter(f"{name} must be a finite number in [{lo}, {hi}] (got {value!r})")


__all__ = ["AudioChunk", "Engine", "EngineStats", "Generation", "LoRAInfo", "ModelInfo", "SyncEngine", "VoiceInfo"]
