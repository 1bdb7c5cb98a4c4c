"""`Engine`: the public async API over one worker process per device, routing, stored voices and LoRA adapters.

The caller's process holds the model config and tokenizer (no weights): every request is checked
(`engine.request_check`) and turned into a prompt (`engine.specs`) here, so bad input is a typed `InvalidRequest`
before anything is queued. A gateway front process does the same with its own copy of the config and tokenizer
(`gateway.link`) and hands the built spec to `submit_spec`, which admits it as `generate` admits its own.
Each new turn goes to the worker with the most headroom (`headroom`: free sequence room and free KV blocks from the
stats every worker reports each step, avoiding a worker that is late on a listener's deadline); each worker's reader
thread (`engine.worker_handle`) turns its step messages into `AudioChunk`s for the request's `Generation`.

Placement: `devices` lists CUDA indices (`[0, 1]`: one worker per GPU) or device names (`["cpu", "cpu"]`: two CPU
workers); with `tensor_parallel_size=N` every N consecutive devices form one worker whose model is split across them
(`engine.distributed`, `engine.model.parallel`). Stored voices and LoRA adapters are registered on every worker.
A worker that dies fails its in-flight requests with `WorkerCrashed` at once (its process sentinel wakes the
reader) and is started again, stored voices and adapters included. The blocking wrapper is `engine.sync.SyncEngine`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import guards, ipc
from engine.api import EngineStats, LoRAInfo, ModelInfo, VoiceInfo
from engine.checkpoint import resolve_model_dir
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.errors import (
    EngineError,
    EngineStopped,
    InvalidParameter,
    WorkerCrashed,
)
from engine.generation import ChunkQueue, ChunkSink, Generation, Stream
from engine.model.parallel import check_tensor_parallel
from engine.process_env import disable_nvls
from engine.prompt import prompt_samples
from engine.registries import LoRAEntry, LoRARegistry, Voice, VoiceRegistry, lora_info
from engine.request import RequestSpec, SamplingParams
from engine.request_check import check_request
from engine.routing import device_groups, pick_worker
from engine.specs import request_spec, voice_prefix_spec
from engine.sync import SyncEngine
from engine.tenants import QueuedPrompts
from engine.text import Tokenizer
from engine.worker import WorkerConfig
from engine.worker_handle import MAX_RESTARTS_PER_WINDOW, RESTART_WINDOW_S, CrashWindow, WorkerHandle

log = logging.getLogger(__name__)


class Engine:
    """Async streaming TTS engine: one worker process per device, continuous batching inside each."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **options: Any):
        """`model`: a directory or Hugging Face id (default: VoxCPM2 on a GPU, else the tiny demo model). `config`:
        the engine's sizes and switches (`EngineConfig`); keyword `options` are its fields, e.g. `max_num_seqs=64`
        (with `config`, they override its fields). Bad values raise `InvalidParameter` before any worker starts."""
        config = EngineConfig(**options) if config is None else replace(config, **options)
        self.loop = asyncio.get_running_loop()
        # The pool's I/O threads (requests out to the workers, chunks back) take the GIL from the event loop at every
        # hand-off; at Python's default 5 ms switch interval each hand-off could wait up to 5 ms behind a busy loop.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        self.is_demo = model is None and not torch.cuda.is_available()
        if model is None:
            from engine.random_checkpoint import demo_model_dir

            model = str(demo_model_dir()) if self.is_demo else "openbmb/VoxCPM2"
        self.path: Path = resolve_model_dir(model)
        self.name = model
        self.config = ModelConfig.from_file(self.path / "config.json")
        self.tokenizer = Tokenizer.from_dir(self.path)
        try:
            check_tensor_parallel(self.config, config.tensor_parallel_size)
        except ValueError as e:
            raise InvalidParameter(str(e)) from None
        groups = device_groups(config.devices, config.tensor_parallel_size)
        disable_nvls()  # inherited by every worker and tensor-parallel rank started from here
        self.engine_config = config
        self.default_timesteps = config.inference_timesteps
        # what a request may ask for (the gateway checks its protocol's settings against the same object)
        self.sampling_ranges = guards.SamplingRanges(max_timesteps=config.served_timesteps)
        self.max_num_seqs = config.max_num_seqs
        self.max_waiting = config.waiting_room
        self.queued_prompts = QueuedPrompts(config.max_queued_per_tenant)  # per tenant, requests without audio yet
        self._worker_configs = [WorkerConfig.for_group(config, str(self.path), group) for group in groups]
        self._streams: dict[str, Stream] = {}
        self._voices = VoiceRegistry(self.config)
        self._loras = LoRARegistry(self.config, config.max_loras, config.max_lora_rank)
        self._restarts = 0
        self._waiting_submits: set[asyncio.Future] = set()
        self.revision = 0  # counts changes of the stored voices and adapters (a front host pushes them on a change)
        self._crashes = CrashWindow()
        # Messages to the workers, sent in order at the end of the event loop's current pass (`_post`).
        self._outgoing: list[tuple[WorkerHandle, ipc.Command]] = []
        self._stopped = False
        self._fatal: str | None = None
        self._workers = [self._start_worker(i) for i in range(len(groups))]

    @classmethod
    def from_pretrained(cls, model: str | None = None, **kwargs: Any) -> Engine | SyncEngine:
        """An `Engine` when called inside a running event loop, else a blocking `SyncEngine`."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return SyncEngine(lambda: cls(model, **kwargs))
        return cls(model, **kwargs)

    # ---- workers -----------------------------------------------------------------------------------------
    def _start_worker(self, index: int) -> WorkerHandle:
        return WorkerHandle(index, self._worker_configs[index], self.config, self.loop, self._on_event,
                            self._on_exit)

    def _on_event(self, worker: WorkerHandle, msg: ipc.StepAudio | ipc.Failed | ipc.Fatal) -> None:
        match msg:
            case ipc.StepAudio(chunks=chunks):
                for chunk in chunks:
                    stream = self._streams.get(chunk.request_id)
                    if stream is not None and not stream.done:
                        self._unqueue(stream)
                        stream.queue.put_nowait(chunk)
                        if chunk.is_last:
                            self._forget(stream)
            case ipc.Failed(request_id=request_id, message=message):
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.queue.put_nowait(EngineError(f"request {request_id} failed in the worker: {message}"))
                    self._forget(stream)
            case ipc.Fatal(message=message):
                self._fatal = message
                log.error("worker %d failed to start: %s", worker.index, message)

    def _on_exit(self, worker: WorkerHandle, error: WorkerCrashed) -> None:
        """The worker process ended: fail what it held, then start a new one unless we are stopping."""
        for rid in list(worker.in_flight):
            stream = self._streams.get(rid)
            if stream is not None:
                stream.queue.put_nowait(error)
                self._forget(stream)
        if not worker.ready.is_set() and self._fatal is None:  # died while loading: restarting would loop
            self._fatal = f"worker {worker.index} exited with code {worker.process.exitcode} while starting"
        if self._stopped or self._fatal is not None:
            if self._fatal is not None:
                worker.ready.set()  # wake waiters so they see the fatal error
            return
        crashes = self._crashes.add()
        if crashes > MAX_RESTARTS_PER_WINDOW:
            self._fatal = f"{error}; {crashes} crashes in {RESTART_WINDOW_S:.0f} s, not restarting"
            log.error("%s", self._fatal)
            worker.ready.set()
            return
        log.warning("%s; restarting it", error)
        self._restarts += 1
        new = self._start_worker(worker.index)
        self._workers[worker.index] = new
        for lora in self._loras.entries.values():
            new.tell(ipc.AddLoRA, lora.adapter)
        for prefix in self._voices.prefixes():
            new.tell(ipc.StoreVoice, prefix)

    def _unqueue(self, stream: Stream) -> None:
        """The stream has its first audio (or ended): it no longer counts as its tenant's queued prompt."""
        if stream.tenant is not None:
            self.queued_prompts.release(stream.tenant)
            stream.tenant = None

    def _forget(self, stream: Stream) -> None:
        self._unqueue(stream)
        if stream.lora is not None:
            stream.lora.users.discard(stream.request_id)
            if not stream.lora.users:
                stream.lora.drained.set()
        stream.done = True
        self._streams.pop(stream.request_id, None)
        stream.worker.in_flight.discard(stream.request_id)

    def _pick_worker(self) -> WorkerHandle:
        if self._stopped:
            raise EngineStopped("the engine is stopped")
        if self._fatal is not None:
            raise EngineStopped(f"the worker cannot start: {self._fatal}")
        return pick_worker(self._workers, self.max_num_seqs, self.max_waiting)

    async def _call(self, worker: WorkerHandle, command: Callable[..., ipc.Command], *args: Any) -> Any:
        await self._wait_ready(worker)
        self._flush()  # what was posted before this call reaches the worker before it
        return await worker.call(command, *args)

    def _post(self, worker: WorkerHandle, msg: ipc.Command) -> None:
        """Send `msg` to `worker` once the event loop's current pass is over, in order with every other post.

        A burst of `generate` calls runs in one pass: its requests then reach the worker together, so its first
        step sees them all, and the worker's sender thread (which takes the GIL from the event loop to pickle and
        send) wakes once for the burst, not once per request in the middle of it."""
        if not self._outgoing:
            self.loop.call_soon(self._flush)
        self._outgoing.append((worker, msg))

    def _flush(self) -> None:
        out, self._outgoing = self._outgoing, []
        for worker, msg in out:
            worker.send(msg)

    async def _wait_ready(self, worker: WorkerHandle) -> None:
        await worker.ready.wait()
        if self._fatal is not None:
            raise EngineStopped(f"the worker cannot start: {self._fatal}")

    def kv_positions(self) -> int:
        """Positions one request may take in the smallest worker's KV cache."""
        cfg = self._worker_configs[0]
        blocks = min((w.info.get("num_blocks", math.inf) for w in self._workers), default=math.inf)
        blocks = cfg.num_kv_blocks or blocks
        return int(min(blocks * cfg.block_size, 2**62))

    # ---- requests ----------------------------------------------------------------------------------------
    def generate(self, text: str, *, voice: str | None = None, prompt_audio: Any = None,
                 prompt_sample_rate: int | None = None, prompt_latents: Any = None, prompt_text: str | None = None,
                 reference_audio: Any = None, reference_latents: Any = None,
                 cfg_value: float = SamplingParams.cfg_value, temperature: float = SamplingParams.temperature,
                 seed: int | None = None, max_length: int | None = None, min_length: int = SamplingParams.min_length,
                 timesteps: int | None = None, priority: int = SamplingParams.priority,
                 request_id: str | None = None, lora: str | None = None, tenant: str | None = None,
                 instruction: str | None = None) -> Generation:
        """Stream one patch of audio per step. Input errors raise here; closing the iterator cancels.

        The request leaves from this call when it has no audio to encode and its worker is up, else on the first
        read: close the iterator or read it to its end (one dropped unread is cancelled only when collected).
        `lora` names a registered adapter (default: the stored voice's adapter, if it names one). `tenant` (the
        caller's API key; None or "": the shared tenant) shares prefill fairly with other tenants and holds at most
        `max_queued_per_tenant` requests without audio yet (`TenantOverloaded` beyond). `instruction`: a
        style instruction (VoxCPM2 voice design), spoken as `(instruction)text`; never with a prompt."""
        checked = check_request(
            self.config, ranges=self.sampling_ranges, default_timesteps=self.default_timesteps,
            in_flight=self._streams, voice_of=self._voices.get, text=text, voice=voice, prompt_audio=prompt_audio,
            prompt_sample_rate=prompt_sample_rate, prompt_latents=prompt_latents, prompt_text=prompt_text,
            reference_audio=reference_audio, reference_latents=reference_latents, cfg_value=cfg_value,
            temperature=temperature, seed=seed, max_length=max_length, min_length=min_length, timesteps=timesteps,
            priority=priority, request_id=request_id, lora=lora, tenant=tenant, instruction=instruction)
        args = checked.args
        adapter = self._loras.get(checked.lora)
        args["tenant"] = self.queued_prompts.check(tenant)
        worker = self._pick_worker()
        spec = None if checked.needs_encoding else self._spec(**args)  # all checks done before the caller iterates
        stream = self._admit(args["request_id"], worker, adapter, args["tenant"], ChunkQueue())
        if spec is not None and worker.ready.is_set():  # what `_wait_ready` waits for (a fatal error raised above)
            # out now, with this pass's other posts, not at the first read: a reader in another task (a gateway
            # turn's) runs only after every callback ready before it
            self._post(worker, ipc.Add(spec=spec))
            return Generation(self, stream, spec, None, (None, None, None), submitted=True)
        return Generation(self, stream, spec, args if spec is None else None, checked.audio)

    def submit_spec(self, spec: RequestSpec, sink: ChunkSink) -> Stream:
        """Admit a request checked and built elsewhere (`check_request` + `request_spec` in a gateway front) as
        `generate` admits its own: its adapter, tenant and worker are checked here (`UnknownLoRA`, `UnknownVoice`
        after a race, `TenantOverloaded`, `EngineOverloaded`, `EngineStopped` raise at the call). Its chunks, then
        None (cancelled) or an `EngineError`, go to `sink.put_nowait`; `release(stream)` cancels it."""
        adapter = self._loras.get(spec.lora)
        if spec.voice_id is not None:
            self._voices.get(spec.voice_id)  # removed since the caller checked it: its prefix KV is gone
        if spec.request_id in self._streams:
            raise InvalidParameter(f"request_id {spec.request_id!r} is already in flight")
        tenant = self.queued_prompts.check(spec.tenant)
        worker = self._pick_worker()
        stream = self._admit(spec.request_id, worker, adapter, tenant, sink)
        if worker.ready.is_set():
            self._post(worker, ipc.Add(spec=spec))
        else:  # a restarted worker still loading: sent once it is up (rare, so a task is fine here)
            task = asyncio.ensure_future(self._submit_when_ready(stream, spec))
            self._waiting_submits.add(task)  # held until done: the loop keeps only a weak reference
            task.add_done_callback(self._waiting_submits.discard)
        return stream

    async def _submit_when_ready(self, stream: Stream, spec: RequestSpec) -> None:
        try:
            await self._submit(stream, spec, None, (None, None, None))
        except EngineError as e:
            if not stream.done:
                stream.queue.put_nowait(e)
                self._forget(stream)

    def release(self, stream: Stream) -> None:
        """Cancel a request of `submit_spec` unless it has ended (its sink gets None)."""
        self._cancel_nowait(stream.request_id, stream)

    def _admit(self, request_id: str, worker: WorkerHandle, adapter: LoRAEntry | None, tenant: str | None,
               sink: ChunkSink) -> Stream:
        stream = Stream(request_id, worker, queue=sink, lora=adapter, tenant=tenant)
        self.queued_prompts.add(tenant)
        if adapter is not None:
            adapter.users.add(request_id)
            adapter.drained.clear()
        self._streams[request_id] = stream
        worker.in_flight.add(request_id)
        return stream

    async def _submit(self, stream: Stream, spec: RequestSpec | None, args: dict | None,
                      audio: tuple[Any, Any, int | None]) -> None:
        """At the first read: encode the request's audio if it came as audio (the worker's VAE does it), then queue
        it."""
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
        self._post(stream.worker, ipc.Add(spec=spec))

    def _spec(self, **args: Any) -> RequestSpec:
        return request_spec(self.config, self.tokenizer, self.kv_positions(), **args)

    async def cancel(self, request_id: str) -> None:
        """Stop a request; its iterator ends with a chunk-less `is_last`-free stop (it just returns)."""
        self._cancel_nowait(request_id)

    def _cancel_nowait(self, request_id: str, only: Stream | None = None) -> None:
        """Cancel `request_id` (`only`: if it still is that stream, not a later request reusing the id)."""
        stream = self._streams.get(request_id)
        if stream is None or (only is not None and stream is not only):
            return
        self._forget(stream)
        stream.queue.put_nowait(None)
        if stream.worker.alive:
            self._post(stream.worker, ipc.Cancel(request_id=request_id))

    def update_buffered(self, request_id: str, audio_ms: float) -> None:
        """The listener of `request_id` has `audio_ms` of audio queued (drives deadline-first scheduling)."""
        if not isinstance(audio_ms, (int, float)) or not math.isfinite(audio_ms):
            raise InvalidParameter(f"audio_ms must be a finite number (got {audio_ms!r})")
        stream = self._streams.get(request_id)
        if stream is not None and stream.worker.alive:
            self._post(stream.worker, ipc.Buffered(request_id=request_id, audio_ms=float(audio_ms)))

    # ---- audio and voices --------------------------------------------------------------------------------
    async def encode_audio(self, audio: bytes | np.ndarray, sample_rate: int | None = None,
                           _pad: str = "left") -> np.ndarray:
        """Prompt audio (file bytes, or samples with their rate) -> patches [T, P, D] float32. At most
        `guards.MAX_PROMPT_AUDIO_S` long (`AudioTooLong`, from a file's header before it is decoded)."""
        return await self._encode(audio, sample_rate, _pad)

    async def _encode(self, audio: Any, sample_rate: int | None, pad: str) -> np.ndarray:
        if not isinstance(audio, (bytes, bytearray, memoryview)):
            if sample_rate is None:
                raise InvalidParameter("sample_rate is required with raw samples")
            guards.check_int("sample_rate", sample_rate, 1000, 384000)
            if not hasattr(audio, "shape"):
                audio = np.asarray(audio)
        # decoding, mixing down and resampling (a minute of audio: tens of ms) off the event loop; the worker gets
        # mono samples at its VAE's rate and encodes them in slices between steps
        samples = await asyncio.to_thread(prompt_samples, audio, sample_rate, self.config.audio_vae.sample_rate)
        return await self._call(self._pick_worker(), ipc.Encode, samples, pad)

    async def add_voice(self, *, audio: Any = None, sample_rate: int | None = None, latents: Any = None,
                        text: str | None = None, voice_id: str | None = None, lora: str | None = None) -> str:
        """Store a voice. VoxCPM2: a reference voice whose prefix KV is computed once per worker and shared by
        every request of the voice. VoxCPM 0.5B/1.5: prompt audio + its transcript `text` (continuation).
        `lora` names a registered adapter the voice's requests use; with no audio the voice is the adapter alone."""
        self._loras.get(lora)

        def prefix_spec(voice_id: str, patches: np.ndarray, lora: str | None) -> RequestSpec:
            return voice_prefix_spec(self.config, self.tokenizer, self.kv_positions(), voice_id, patches, lora)

        async def add_to_workers(prefix: RequestSpec) -> None:
            await asyncio.gather(*(self._call(w, ipc.StoreVoice, prefix) for w in self._workers))

        voice_id = await self._voices.add(voice_id, audio=audio, sample_rate=sample_rate, latents=latents,
                                          text=text, lora=lora, encode=self._encode, prefix_spec=prefix_spec,
                                          add_to_workers=add_to_workers, remove=self.remove_voice)
        self.revision += 1
        return voice_id

    async def remove_voice(self, voice_id: str) -> None:
        """Forget a stored voice (and free its prefix KV on every worker)."""
        self._voices.pop(voice_id)
        self.revision += 1
        for w in self._workers:
            if w.alive:
                self._post(w, ipc.RemoveVoice(voice_id=voice_id))

    def list_voices(self) -> list[VoiceInfo]:
        """The stored voices, in the order they were added."""
        return self._voices.infos()

    def stored_voices(self) -> dict[str, Voice]:
        """The stored voices by id, in the order they were added (a replaced voice is a new object)."""
        return dict(self._voices.entries)

    def voice_latents(self, voice_id: str) -> np.ndarray | None:
        """A stored voice's patches [T, P, D] float32 (None for an adapter-only voice): with its text and adapter,
        what `add_voice(latents=...)` needs to rebuild it exactly, e.g. after a restart."""
        return self._voices.latents(voice_id)

    # ---- LoRA adapters -----------------------------------------------------------------------------------
    async def register_lora(self, name: str, source: str | Path | dict[str, torch.Tensor],
                            config: dict[str, Any] | None = None) -> LoRAInfo:
        """Load an adapter (a directory with lora_weights.safetensors + lora_config.json, the .safetensors file,
        or tensors with `config`), check it against the model and put it on every worker. Bad adapters raise
        `InvalidLoRA` here, before any worker sees them."""
        async def first_worker_dtype() -> torch.dtype:
            await self._wait_ready(self._workers[0])
            return getattr(torch, self._workers[0].info.get("dtype", "float32"))

        def add_to_workers(adapter: Any) -> asyncio.Future:
            return asyncio.gather(*(self._call(w, ipc.AddLoRA, adapter) for w in self._workers))

        info = await self._loras.register(name, source, config, first_worker_dtype, add_to_workers)
        self.revision += 1
        return info

    async def unregister_lora(self, name: str) -> None:
        """Refuse new requests for the adapter at once, wait for those in flight to finish, then free it."""
        entry = self._loras.get(name)
        users = self._voices.users_of(name)
        if users:
            raise InvalidParameter(f"LoRA adapter {name!r} is used by stored voice(s) {users}: remove them first")
        del self._loras.entries[name]
        self.revision += 1
        await entry.drained.wait()
        await asyncio.gather(*(self._call(w, ipc.RemoveLoRA, name) for w in self._workers if w.alive))

    def list_loras(self) -> list[LoRAInfo]:
        """The registered adapters, in the order they were registered."""
        return [lora_info(e) for e in self._loras.entries.values()]

    # ---- status ------------------------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        """What the model is and how its audio is shaped."""
        info = self._workers[0].info if self._workers else {}
        c = self.config
        return ModelInfo(name=self.name, architecture=c.architecture, sample_rate=c.sample_rate,
                         samples_per_patch=c.samples_per_patch, patch_ms=c.patch_ms, max_length=c.max_length,
                         is_demo=self.is_demo, dtype=info.get("dtype", self._worker_configs[0].dtype or "auto"),
                         device=info.get("device", self._worker_configs[0].device))

    def stats(self) -> EngineStats:
        """The workers' latest reports, summed."""
        ready = [w for w in self._workers if w.ready.is_set() and w.alive]
        room = max((self.max_num_seqs + self.max_waiting - len(w.in_flight) for w in ready), default=0)
        s = EngineStats(in_flight=len(self._streams), workers=len(self._workers), workers_ready=len(ready),
                        worker_restarts=self._restarts, admission_room=max(room, 0))
        for w in self._workers:
            for key in ("running", "waiting", "free_blocks", "total_blocks", "voice_blocks", "steps", "preemptions"):
                setattr(s, key, getattr(s, key) + w.stats.get(key, 0))
        return s

    def health(self) -> dict[str, Any]:
        """Overall status ("starting", "ok", "degraded", "failed", "stopped") and each worker's state."""
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
        """Wait until every worker has loaded its model (`EngineStopped` if one cannot)."""
        for w in list(self._workers):
            await self._wait_ready(w)

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """End every request with `EngineStopped` and stop the workers (also on leaving `async with Engine(...)`;
        a program that never stops its engine has its workers stopped at exit)."""
        if self._stopped:
            return
        self._stopped = True
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(EngineStopped("the engine stopped"))
            self._forget(stream)
        for w in self._workers:
            w.fail_calls(EngineStopped("the engine stopped"))
        await asyncio.gather(*(asyncio.to_thread(w.close) for w in self._workers))
