"""One worker process per device: the step loop (Scheduler -> Runner) and its IPC with the pool.

Commands come in over one pipe, results go out over another; the messages, and the shared-memory ring each step's
audio goes through, are defined in `engine.ipc`. Prompt encodes and adapter loads are chores (`engine.chores`):
done in slices between steps, never one long stall.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine import ipc
from engine.chores import CHORE_SLICE_MS, Chores, as_array
from engine.engine_config import EngineConfig
from engine.host_memory import HeapTrimmer
from engine.ipc import AudioRing
from engine.process_env import disable_nvls
from engine.request import Status
from engine.settings import EngineSettings

if TYPE_CHECKING:
    from engine.runner import PendingStep
    from engine.scheduler import ScheduledSeq

log = logging.getLogger(__name__)


class CommandFailed(Exception):
    """A command from the pool could not be handled: the worker ends, as a crash would."""


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(EngineConfig):
    """One worker's configuration: the engine's (`EngineConfig`, every size and switch with its one default) plus
    the model, the device(s) this worker runs on and the environment switches as its parent read them."""

    model: str
    device: str
    tp_devices: tuple[str, ...] = ()  # tensor parallelism: one rank per device, this process is rank 0 on the first
    # capture decode steps on CUDA (False, or VOXGATE_CUDA_GRAPHS=0: every step eager, for debugging)
    cuda_graphs: bool = field(default_factory=lambda: EngineSettings.from_env().cuda_graphs)
    # launch each steady decode step before the previous one ends (False, or VOXGATE_ASYNC_SCHEDULING=0: one step at
    # a time, the host preparing each step while the device waits)
    async_scheduling: bool = field(default_factory=lambda: EngineSettings.from_env().async_scheduling)
    # with async_scheduling: a step launched ahead may also admit waiting prompts, so under steady arrivals the host
    # stages mixed steps while the device runs the one before (without it the device idles while each is staged,
    # steps grow and streams pile up). None: on CUDA only (a CPU runs each
    # step as it is launched: nothing to hide); VOXGATE_ASYNC_MIXED=1 / 0 forces it on / off
    async_mixed: bool | None = field(default_factory=lambda: EngineSettings.from_env().async_mixed)

    # with CUDA graphs: each step's VAE decode replayed on a second stream beside the next step's LMs and LocDiT
    # (`engine.runner`, the VAE lane); False, or VOXGATE_VAE_STREAM=0: inside the step's graph
    vae_stream: bool = field(default_factory=lambda: EngineSettings.from_env().vae_stream)
    # a step that feeds a listener's first audio leaves out the streams whose listeners reported more than this many
    # ms queued (`engine.lean_steps`; 0: off); VOXGATE_LEAN_STEPS
    lean_steps_ms: int = field(default_factory=lambda: EngineSettings.from_env().lean_steps_ms)
    # host time between two steps given to chores (prompt encodes, adapter loads) at most, one slice past it at worst
    chore_slice_ms: float = CHORE_SLICE_MS

    @classmethod
    def for_group(cls, config: EngineConfig, model: str, group: list[str]) -> WorkerConfig:
        """The config of the worker that runs on `group` (one device, or a tensor-parallel group of them)."""
        return cls(**config.as_kwargs(), model=model, device=group[0],
                   tp_devices=tuple(group) if len(group) > 1 else ())

    def mixed_ahead(self, cuda: bool) -> bool:
        """Whether steps launched ahead admit prompts (`async_mixed`, resolved for the device)."""
        return self.async_mixed if self.async_mixed is not None else cuda


@dataclass
class Launched:
    """A scheduled step: its sequences, the runner's handle once launched, its number, when it was launched."""

    seqs: list[ScheduledSeq]
    pending: PendingStep | None
    step: int
    launched_at: float


STEP_MS_EDGES = tuple(0.25 * 10 ** (i / 20) for i in range(100))  # 0.25 ms .. 22 s, 12% apart


def ms_bucket(ms: float) -> int:
    """Histogram bucket of a step time: the first edge at or above it."""
    return next((i for i, edge in enumerate(STEP_MS_EDGES) if ms <= edge), len(STEP_MS_EDGES))


def hist_percentile(hist: dict[int, int], q: float) -> float | None:
    """The q-th percentile (0..100) of a `ms_bucket` histogram, as its bucket's upper edge in ms."""
    total = sum(hist.values())
    if not total:
        return None
    seen = 0
    for bucket in sorted(hist):
        seen += hist[bucket]
        if seen >= q / 100 * total:
            return STEP_MS_EDGES[min(bucket, len(STEP_MS_EDGES) - 1)]
    return STEP_MS_EDGES[-1]


class StepStats:
    """Per-step timing that travels in the worker's stats: the last step, and cumulative histograms by step kind
    (sparse {bucket: count}) that a reader subtracts between two snapshots to get the percentiles of an interval."""

    def __init__(self) -> None:
        self.last: dict[str, Any] = {}
        self.hist: dict[str, dict[int, int]] = {}  # "<kind>_wall" / "<kind>_gpu" -> counts
        self.prefill_tokens = 0
        self.compiles = 0
        self.gpu_ms_total = 0.0  # device time between each step's start and end events (idle launch gaps included)
        self.ahead_steps = 0  # steps launched before the previous one ended (`Worker.step`)
        self.ahead_admitting = 0  # of those, steps that also admitted prompts (`WorkerConfig.async_mixed`)

    def record(self, kind: str, wall_ms: float, gpu_ms: float | None, prefill_tokens: int, decode_rows: int,
               compiles: int) -> None:
        self.last = {"kind": kind, "wall_ms": round(wall_ms, 3), "gpu_ms": None if gpu_ms is None else
                     round(gpu_ms, 3), "prefill_tokens": prefill_tokens, "decode_rows": decode_rows}
        for name, ms in ((f"{kind}_wall", wall_ms), (f"{kind}_gpu", gpu_ms)):
            if ms is not None:
                counts = self.hist.setdefault(name, {})
                b = ms_bucket(ms)
                counts[b] = counts.get(b, 0) + 1
        self.prefill_tokens += prefill_tokens
        self.compiles = compiles
        self.gpu_ms_total += gpu_ms or 0.0

    def stats(self) -> dict[str, Any]:
        return {"last_step": dict(self.last), "step_hist": {k: dict(v) for k, v in self.hist.items()},
                "prefill_tokens": self.prefill_tokens, "triton_compiles": self.compiles,
                "gpu_ms_total": round(self.gpu_ms_total, 3), "ahead_steps": self.ahead_steps,
                "ahead_admitting": self.ahead_admitting}


def run_worker(cfg: WorkerConfig, commands: Connection, results: Connection, ring: AudioRing) -> None:
    """The worker process's life (started by `engine.worker_process.worker_main`): load, then serve until stopped."""
    disable_nvls()
    torch.set_num_threads(cfg.worker_threads)
    logging.basicConfig(level=EngineSettings.from_env().log)
    try:
        worker = Worker(cfg, commands, results, ring)
    except Exception as e:  # a load failure is reported once, then the process exits
        # the caller gets the message; with VOXGATE_LOG=DEBUG the worker logs the traceback too (which op failed)
        logging.getLogger(__name__).debug("worker start failed", exc_info=True)
        results.send(ipc.Fatal(message=f"{type(e).__name__}: {e}"))
        return
    try:
        worker.loop()
    finally:
        if worker.tp is not None:
            worker.tp.close()


class Worker:
    def __init__(self, cfg: WorkerConfig, commands: Connection, results: Connection, ring: AudioRing):
        from engine.checkpoint import load_model
        from engine.runner import Runner
        from engine.scheduler import Scheduler

        self.cfg, self.commands, self.results, self.ring = cfg, commands, results, ring
        if torch.device(cfg.device).type == "cuda":  # Triton launches on the current device, not the tensors'
            torch.cuda.set_device(torch.device(cfg.device))
        self.tp = None
        if len(cfg.tp_devices) > 1:  # start the follower ranks first: every rank loads, shards and sizes in step
            from engine.distributed import TensorParallelLeader
            from engine.model.parallel import shard_model

            self.tp = TensorParallelLeader(cfg)
        self.loaded = load_model(cfg.model, cfg.device, cfg.dtype)
        if self.tp is not None:
            shard_model(self.loaded.model, 0, self.tp.world, self.tp.group)
        self.loras = None
        if cfg.max_loras:  # before the runner, so the slots count as weights in its memory budget
            from engine.lora import AdapterSlots
            from engine.model.lora import attach_lora, merge_into_weights

            if self.tp is not None:
                raise ValueError("LoRA slots do not support tensor parallelism yet")
            self.loras = AdapterSlots(attach_lora(self.loaded.model, cfg.max_loras, cfg.max_lora_rank))
            if cfg.merge_lora:
                merge_into_weights(self.loras.state, self.loaded.model)
        self.runner = Runner(self.loaded, cfg)
        config = self.loaded.config
        self.scheduler = Scheduler(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_prefill_tokens_while_speaking=cfg.max_prefill_tokens_while_speaking,
            num_blocks=self.runner.num_blocks, block_size=cfg.block_size, patch_ms=config.patch_ms,
            sit_out_ms=cfg.sit_out_ms, loras=self.loras, split_decodes_above=cfg.split_decodes_above,
            lean_ms=cfg.lean_steps_ms)
        self.voice_calls: dict[str, int] = {}  # prefix request id -> call id waiting for it
        self.chores = Chores(cfg.chore_slice_ms, self.reply)
        self.heap = HeapTrimmer()  # freed host memory back to the OS: idle, and now and then while busy
        # the last step's results, not yet sent
        self.unpublished: tuple[list[ipc.ChunkSpan], list[np.ndarray], list] | None = None
        self.ahead: Launched | None = None  # a step launched ahead of the loop: the next one to collect
        self.last_collected = time.perf_counter()
        self.step_stats = StepStats()
        self.stopping: str | None = None  # "stop" (publish, then end) or "eof" (the pool is gone), seen mid-step
        # steps are launched ahead (`_launch_ahead`), and those may admit waiting prompts (`async_mixed`)
        self.launches_ahead = cfg.async_scheduling and self.tp is None
        self.admits_ahead = self.launches_ahead and cfg.mixed_ahead(self.runner.device.type == "cuda")
        # What exists now (modules, weights, graphs, Triton's caches: about a million objects) lives as long as the
        # worker: out of the collector's sight, a full collection no longer walks it inside some step (vLLM does
        # the same after capturing its graphs)
        gc.collect()
        gc.freeze()
        results.send(ipc.Ready(info={"num_blocks": self.runner.num_blocks, "block_size": cfg.block_size,
                                     "device": str(self.runner.device), "dtype": str(self.runner.dtype).split(".")[-1],
                                     "pid": os.getpid(), "memory": self.runner.memory}))

    def loop(self) -> None:
        while True:
            if not self.scheduler.has_work and self.ahead is None and not self.chores:
                self.publish()
                if not self.commands.poll():
                    self.heap.idle()
                self.commands.poll(None)
            changed = False
            while self.stopping is None and self.commands.poll():
                self.receive()
                changed = True
            if self.stopping is not None:
                self.chores.close()
                if self.stopping == "stop":
                    self.publish()
                return
            if self.chores:
                self.chores.run()
            if self.scheduler.has_work or self.ahead is not None:
                self.step()
                self.heap.busy()
            elif changed:
                self.results.send(ipc.Stats(stats=self.stats()))

    def receive(self) -> None:
        """Handle one batch of commands (engine.worker_handle sends them in batches); note a stop or a lost pool."""
        try:
            data = self.commands.recv_bytes()
        except EOFError:
            self.stopping = "eof"
            return
        arrived = time.perf_counter()
        batch = ForkingPickler.loads(data)  # what Connection.recv does, timed apart for the DEBUG line
        if log.isEnabledFor(logging.DEBUG):
            log.debug("received %d commands (%d bytes) at %.4f, unpickled in %.2f ms", len(batch), len(data),
                      time.time() - (time.perf_counter() - arrived), 1e3 * (time.perf_counter() - arrived))
        for msg in batch:
            if isinstance(msg, ipc.Stop):
                self.stopping = "stop"
                return
            try:
                self.handle(msg)
            except Exception as e:  # a broken command ends the worker (the pool restarts it), even mid-step
                raise CommandFailed(f"command {type(msg).__name__} failed") from e

    def handle(self, msg: ipc.Command) -> None:
        match msg:
            case ipc.Add(spec=spec):
                log.debug("add %s at %.4f", spec.request_id, time.time())
                if spec.lora is not None and (self.loras is None or not self.loras.knows(spec.lora)):
                    self.results.send(ipc.Failed(request_id=spec.request_id,
                                                 message=f"LoRA adapter {spec.lora!r} is not loaded here"))
                else:
                    self.scheduler.add(spec)
            case ipc.AddLoRA() | ipc.RemoveLoRA() if self.loras is None:
                self.reply(msg.call, False, "this worker has no LoRA slots")
            case ipc.AddLoRA(call=call, adapter=adapter):  # its copies in slices between steps
                self.chores.add(self.loras.adding(adapter), call)  # a bad adapter fails its call only
            case ipc.RemoveLoRA(call=call, name=name):
                try:
                    self.loras.remove(name)
                except Exception as e:
                    self.reply(call, False, f"{type(e).__name__}: {e}")
                    return
                self.reply(call, True, None)
            case ipc.Cancel(request_id=request_id):
                self.scheduler.cancel(request_id)
            case ipc.Buffered(request_id=request_id, audio_ms=audio_ms):
                self.scheduler.update_buffered(request_id, audio_ms)
            case ipc.StoreVoice(call=call, spec=spec):
                self.voice_calls[spec.request_id] = call
                self.scheduler.add(spec)
            case ipc.RemoveVoice(voice_id=voice_id):
                self.scheduler.remove_voice(voice_id)
            case ipc.Encode(call=call, samples=samples, pad=pad):
                from engine.prompt import encode_in_slices

                self.chores.add(as_array(encode_in_slices(self.loaded.vae, samples, pad=pad,
                                                          patch_size=self.loaded.config.patch_size,
                                                          slice_ms=self.cfg.chore_slice_ms)), call)
            case _:
                log.error("unknown command %r", msg)

    def step(self) -> None:
        """Collect one step, with the device kept busy meanwhile.

        Steady decoding (`async_scheduling`): step N+1 (the same requests, `Scheduler.schedule_ahead`, with
        `async_mixed` also admitting waiting prompts) is staged and launched while the device runs step N, fed N's
        patches on the device; the host collects N, publishes it and prepares N+2 while N+1 runs. A request that
        stops at N runs one wasted row in N+1, dropped here. Otherwise (admissions, prefills, preemptions): schedule
        and launch step N, publish step N-1 while the device runs N, then collect N."""
        sched = self.scheduler
        current = self.ahead
        self.ahead = None
        if current is None:
            seqs = sched.schedule()
            if not seqs:
                self.publish()
                if sched.waiting and not sched.running:  # nothing can ever free room for it
                    req = sched.blocked or sched.waiting[0]
                    sched.finish(req, "error")
                    self.results.send(ipc.Failed(request_id=req.request_id,
                                                 message="the prompt does not fit the KV cache"))
                return
            current = Launched(seqs, None, sched.num_steps, time.perf_counter())
        if current.pending is not None:
            self.step_stats.ahead_steps += 1
            self.step_stats.ahead_admitting += any(not s.request.generated for s in current.seqs)
        try:
            if current.pending is None:
                if self.tp is not None:
                    self.tp.send_step(current.seqs, sched)
                current.pending = self.runner.launch(current.seqs, adapter=sched.single_adapter())
            self.publish()  # step N-1's audio leaves while the device runs N
            if self.admits_ahead:
                # prompts already in the pipe join the step launched ahead, not the one after it (a burst's
                # first request wakes the worker; the rest arrive while that step is staged)
                while self.stopping is None and self.commands.poll():
                    self.receive()
            ahead_at = time.perf_counter()
            self.ahead = self._launch_ahead(current) if self.stopping is None else None
            if self.ahead is not None and log.isEnabledFor(logging.DEBUG):  # bench/burst_timeline.py reads it
                log.debug("step %d launched ahead in %.2f ms", self.ahead.step, 1e3 * (time.perf_counter() - ahead_at))
            out = self.runner.collect(current.pending)
            now = time.perf_counter()
            # wall: launch to collection, or since the last collection when this step was queued behind it
            self._note_step(1000 * (now - max(current.launched_at, self.last_collected)))
            self.last_collected = now
        except CommandFailed:
            raise
        except Exception as e:  # a failed step fails its requests, not the worker
            log.error("step failed:\n%s", traceback.format_exc())
            if self.tp is not None:  # the ranks are out of step now: end the group, the pool restarts it
                self.tp.abort()
            self.publish()
            self.ahead = None  # its requests are among these
            for seq in current.seqs:
                if seq.request.request_id in sched.requests:
                    sched.finish(seq.request, "error")
                    self.fail(seq.request.request_id, f"{type(e).__name__}: {e}")
            return
        live = [seq.request.status is Status.RUNNING for seq in current.seqs]  # not cancelled or stopped since
        finished = sched.postprocess(current.seqs, out.patches, out.stops)
        chunks: list[ipc.ChunkSpan] = []
        audio_parts = []
        offset = 0
        for seq, audio, alive in zip(current.seqs, out.audio, live, strict=True):
            if audio is None or not alive:
                continue
            req = seq.request
            last = req.stop_reason is not None
            chunks.append(ipc.ChunkSpan(request_id=req.request_id, index=len(req.generated) - 1,
                                        latents=req.generated[-1].float().numpy(), start=offset,
                                        end=offset + audio.shape[0], is_last=last, stop_reason=req.stop_reason,
                                        step=current.step))
            audio_parts.append(audio)
            offset += audio.shape[0]
        self.unpublished = (chunks, audio_parts, finished)
        if self.ahead is not None:  # now, while the device runs it: its launch after this one reuses these buffers
            self.publish()

    def _launch_ahead(self, current: Launched) -> Launched | None:
        """Launch the step after `current` (a step still on the device) when it continues every request that
        `current` samples for: plain decoding, or (`async_mixed`) decoding plus waiting prompts admitted."""
        pending = current.pending
        if not self.launches_ahead or pending is None or pending.sampled is None:
            return None
        if not self.admits_ahead and pending.kind == "mixed":
            return None  # what follows a mixed step feeds a new stream's first patch: the flat path only
        seqs = self.scheduler.schedule_ahead(current.seqs, self.admits_ahead and self.runner.admits_ahead,
                                             self.runner.ahead_tokens)
        if seqs is None:
            return None
        return Launched(seqs, self.runner.launch(seqs, after=pending, adapter=self.scheduler.single_adapter()),
                        self.scheduler.num_steps, time.perf_counter())

    def _note_step(self, wall_ms: float) -> None:
        from engine.runner import triton_compiles

        t = self.runner.last_step
        if t is None:
            return
        self.step_stats.record(t.kind, wall_ms, t.gpu_ms, t.prefill_tokens, t.decode_rows, triton_compiles())
        if log.isEnabledFor(logging.DEBUG):  # wall-clock start, to line steps up with other processes' events
            log.debug("step %d %s at %.4f: wall %.2f ms, gpu %s ms, prefill %d tokens, %d decode rows, %d compiles, "
                      "lora %s, audio %s ms", self.scheduler.num_steps, t.kind, time.time() - wall_ms / 1e3, wall_ms,
                      "-" if t.gpu_ms is None else f"{t.gpu_ms:.2f}", t.prefill_tokens, t.decode_rows,
                      self.step_stats.compiles, t.lora or "-", "-" if t.audio_ms is None else f"{t.audio_ms:.2f}")

    def stats(self) -> dict[str, Any]:
        """The scheduler's stats and the step timing (`StepStats`)."""
        return {**self.scheduler.stats(), **self.step_stats.stats(), "lora_merged_steps": self.runner.merged_steps}

    def publish(self) -> None:
        """Send the last collected step's chunks (audio through the ring) and the replies it completed."""
        if self.unpublished is None:
            return
        chunks, audio_parts, finished = self.unpublished
        self.unpublished = None
        if chunks:
            audio = np.concatenate(audio_parts)
            span = self.ring.write(audio)
            self.results.send(ipc.Step(chunks=chunks, audio=span if span is not None else audio, stats=self.stats()))
            if log.isEnabledFor(logging.DEBUG):  # to line up with the clients' first chunks (bench --timeline)
                log.debug("published step %d at %.4f: %d chunks", chunks[0].step, time.time(), len(chunks))
        else:
            self.results.send(ipc.Stats(stats=self.stats()))
        for req in finished:  # after the stats, so a caller woken by the reply sees the voice's blocks
            call = self.voice_calls.pop(req.request_id, None)
            if call is not None:
                self.reply(call, True, None)

    def reply(self, call: int, ok: bool, value: Any) -> None:
        """Answer the command with id `call`."""
        self.results.send(ipc.Reply(call=call, ok=ok, value=value))

    def fail(self, request_id: str, message: str) -> None:
        """Fail a request in the worker: a voice's prefix fails its call, any other request its stream."""
        call = self.voice_calls.pop(request_id, None)
        if call is not None:
            self.reply(call, False, message)
        else:
            self.results.send(ipc.Failed(request_id=request_id, message=message))
