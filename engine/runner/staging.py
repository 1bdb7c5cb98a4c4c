"""Host staging: a step's rows and flat LM batch written into the static buffers, uploaded, padded, and its
outputs downloaded."""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.cuda_graphs import (
    DecodeBuffers,
    DecodeResult,
    FlatBuffers,
    bucket_for,
    eager_flat_key,
    large_lm_graph_key,
    lm_graph_key,
)
from engine.runner.records import PendingStep
from engine.scheduler import ScheduledSeq

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.model.euler import EulerSchedules
    from engine.runner.vae_lane import VaeLane
    from engine.step_tail import StepTail


@dataclass
class HostStaging:
    """Where a step's inputs are written on the host before their upload (on CPU: the device inputs)."""

    buffers: DecodeBuffers
    arrays: dict[str, np.ndarray]  # numpy views of `buffers`: element writes without torch's per-call overhead
    lora_rows: torch.Tensor  # each row's LoRA slot
    flat: FlatBuffers | None = None  # a mixed step's flat batch (`Runner.allocate_flat`), and its numpy views
    flat_arrays: dict[str, np.ndarray] | None = None
    # pinned buffers (CUDA): re-recorded on the stream behind each upload from them. The copies read the buffers
    # when the stream gets there, so the host must not write them again before (`writable`)
    uploaded: torch.cuda.Event | None = None

    @classmethod
    def of(cls, buffers: DecodeBuffers, rows: int, pin: bool) -> HostStaging:
        return cls(buffers, {name: t.numpy() for name, t in vars(buffers).items()},
                   torch.zeros(rows, dtype=torch.long, pin_memory=pin), uploaded=torch.cuda.Event() if pin else None)

    def mark_uploaded(self) -> None:
        """Note an upload just enqueued from these buffers (nothing to note on CPU: they are the device inputs)."""
        if self.uploaded is not None:
            self.uploaded.record()

    def writable(self) -> None:
        """Wait until the device has read the last upload from these buffers (returns at once before any). A
        serving step finds it done (steps alternate two stagings and collect one before staging into it again);
        the warm-up, staging bucket after bucket into one, waits here. Without this wait a host ahead of the device
        would rewrite a bucket's lengths under the previous bucket's pending copy, and the attention would read past
        its tensors."""
        if self.uploaded is not None:
            self.uploaded.synchronize()


def fed_rows(seqs: list[ScheduledSeq], after: PendingStep) -> dict[int, int]:
    """{k: j}: seqs[k] continues a request that sampled row j of `after` (a step still on the device)."""
    assert after.sampled is not None, "a step that sampled"
    emit = after.emit if after.emit is not None else range(len(after.seqs))
    row = {id(after.seqs[k].request): j for j, k in enumerate(emit)}
    return {k: row[id(s.request)] for k, s in enumerate(seqs) if id(s.request) in row}


def device_index(values: Sequence[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    """Host ints as a device index, from pageable memory: the driver copies them to a staging buffer at once (no
    stream sync, unlike torch.tensor(..., device=)), and nothing pinned is reused before its copy ran (a launch may
    gather twice)."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(device, non_blocking=True)


class Staging:
    """A step's inputs on their way to the device: the static decode buffers (`inputs`) and their host mirrors
    (two pinned ones on CUDA, used in turn: a step launched ahead is staged while the previous one's inputs may
    still be on their way), the flat LM batch (`allocate_flat`), each row's LoRA slot, and the pinned outputs a
    step comes back into. `scratch_block`: the KV block padding rows write into (the runner sets it once the KV
    cache is sized); `tail`: the step tail, which stages its rows with each step's (`engine.step_tail`)."""

    def __init__(self, config: ModelConfig, device: torch.device, rows: int, *, block_size: int, max_positions: int,
                 schedules: EulerSchedules, timesteps: int, buckets: list[int] | None, lane: VaeLane, lora: bool,
                 tail: StepTail | None):
        self.config, self.device, self.block_size, self.tail = config, device, block_size, tail
        self.schedules, self.timesteps, self.buckets, self.lane, self.lora = schedules, timesteps, buckets, lane, lora
        p, d = config.patch_size, config.feat_dim
        width, evals = -(-max_positions // block_size), schedules.width
        cuda = device.type == "cuda"
        self.inputs = DecodeBuffers.allocate(rows, p, d, width, evals, device)
        mirrors = [DecodeBuffers.allocate(rows, p, d, width, evals, torch.device("cpu"), pin=True)
                   for _ in range(2)] if cuda else [self.inputs]
        self.stagings = [HostStaging.of(m, rows, pin=cuda) for m in mirrors]
        self.host_turn = 0
        self.staging = self.stagings[0]
        # LoRA slot of each static row (padding rows: 0, no adapter); the graphs read it in place
        self.lora_rows = torch.zeros(rows, dtype=torch.long, device=device)
        self.outputs = [self._host_outputs(rows) for _ in range(2)] if cuda else []
        self.parity = 0
        self._zero_patch = torch.zeros(1, p, d)  # a fed row's staged input (`stage_flat`)
        self.scratch_block = 0
        self.flat: FlatBuffers | None = None
        self.lm_keys: list[tuple[int, ...]] = []  # LM graph buckets: (tokens, seqs) and large (tokens, seqs, audio)
        self.eager_flat: tuple[int, int] | None = None  # the largest eager flat batch (`eager_flat_key`)

    def use_host(self, turn: int) -> None:
        """Stage into host mirror `turn` from now on (once the device has read its last upload)."""
        self.host_turn = turn
        self.staging = self.stagings[turn]
        self.staging.writable()

    def next_host(self) -> None:
        """The other host mirror, for the step being launched (nothing to switch on CPU)."""
        if len(self.stagings) > 1:
            self.use_host(1 - self.host_turn)

    def stage_rows(self, reqs: list, conds: list[torch.Tensor | None] | None) -> int:
        """Host rows of the sampling inputs (condition patch, noise, cfg, VAE row) of `reqs`, padding up to the
        bucket; returns the bucket size. Primes new VAE rows first (eagerly, ahead of the step on the stream).
        conds None (or a None entry): the condition patches come later, on the device (`gather`)."""
        d, p = self.config.feat_dim, self.config.patch_size
        host = self.staging
        h = host.arrays
        self.lane.prime([r for r in reqs if not r.vae_primed])
        for j, req in enumerate(reqs):
            params = req.spec.params
            if conds is not None and conds[j] is not None:
                host.buffers.patches[j].copy_(conds[j])
            noise = host.buffers.noise[j]
            torch.randn(d, p, generator=req.generator, out=noise)
            if params.temperature != 1.0:
                noise.mul_(params.temperature)
            h["cfg"][j] = params.cfg_value
            h["vae_slots"][j] = req.vae_slot
            host.lora_rows[j] = req.lora_slot
        n = len(reqs)
        # each row's Euler schedule, one fancy index for all (the guard admits served values only)
        timesteps = np.fromiter((r.spec.params.timesteps for r in reqs), dtype=np.int64, count=n)
        h["steps_index"][:n] = self.schedules.index_by_value[timesteps]
        h["steps_dt"][:n] = self.schedules.dt_by_value[timesteps]
        if self.tail is not None:
            self.tail.stage(timesteps)
        rows = bucket_for(n, self.buckets) if self.buckets else n
        self.stage_padding(rows, first=n)
        return rows

    def index(self, values: Sequence[int] | np.ndarray) -> torch.Tensor:
        """`device_index` on this device."""
        return device_index(values, self.device)

    def gather(self, dst: torch.Tensor, dst_rows: list[int], after: PendingStep, rows: list[int]) -> None:
        """dst[dst_rows] = the patches `after` sampled at `rows`: on the device, behind that step's work and this
        step's uploads on the one stream."""
        assert after.sampled is not None
        n = len(rows)
        if dst_rows == rows == list(range(n)):  # no request left in between: the rows line up
            dst[:n].copy_(after.sampled[:n])
            return
        src = after.sampled.index_select(0, self.index(rows))
        if dst_rows == list(range(n)):
            dst[:n].copy_(src)
        else:
            dst.index_copy_(0, self.index(dst_rows), src)

    def stage_positions(self, seqs: list[ScheduledSeq]) -> None:
        """Host rows of a decode step's attention inputs (the fed position, its slot, the block table)."""
        h, bs = self.staging.arrays, self.block_size
        for j, seq in enumerate(seqs):
            pos, table = seq.start, seq.request.block_table
            h["positions"][j] = pos
            h["slots"][j] = table[pos // bs] * bs + pos % bs
            h["seq_lens"][j] = pos + 1
            h["block_tables"][j, :len(table)] = table

    def upload(self, rows: int) -> None:
        host = self.staging
        if host.buffers is not self.inputs:
            self.inputs.copy_rows_(host.buffers, rows)
        if self.lora:
            self.lora_rows[:rows].copy_(host.lora_rows[:rows], non_blocking=True)
        host.mark_uploaded()

    def download(self, seqs: list[ScheduledSeq], result: DecodeResult, n: int, emit: list[int] | None
                  ) -> PendingStep:
        """The first n result rows: as they are on CPU; on CUDA copied D2H into pinned memory behind an event."""
        if self.device.type != "cuda":
            return PendingStep(seqs, result=DecodeResult(result.patches[:n], result.stops[:n], result.audio[:n]),
                               emit=emit)
        out = self.outputs[self.parity]
        self.parity ^= 1
        lane = self.lane.stream
        copies = [(out.patches, result.patches), (out.stops, result.stops)]
        if lane is None:  # else the audio comes back on the lane, below
            copies.append((out.audio, result.audio))
        for dst, src in copies:
            dst[:n].copy_(src[:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        audio_event = None
        if lane is not None:  # behind the step's VAE decode on its lane
            with torch.cuda.stream(lane):
                out.audio[:n].copy_(result.audio[:n], non_blocking=True)
                audio_event = torch.cuda.Event(enable_timing=True)  # `collect` times the audio's return too
                audio_event.record()
        return PendingStep(seqs, result=DecodeResult(out.patches[:n], out.stops[:n], out.audio[:n]), event=event,
                           emit=emit, audio_event=audio_event)

    def stage_padding(self, rows: int, first: int = 0) -> None:
        """Host rows [first, rows): sequences of length 1 in the scratch KV block, decoding into the scratch VAE row."""
        h = self.staging.arrays
        for name in ("patches", "noise", "positions"):
            h[name][first:rows] = 0
        h["cfg"][first:rows] = 1.0
        h["steps_index"][first:rows], h["steps_dt"][first:rows] = self.schedules.row(self.timesteps)
        h["slots"][first:rows] = self.scratch_block * self.block_size
        h["seq_lens"][first:rows] = 1
        h["block_tables"][first:rows, 0] = self.scratch_block
        h["vae_slots"][first:rows] = self.lane.scratch_slot
        self.staging.lora_rows[first:rows] = 0

    def pad_all(self, rows: int) -> None:
        self.staging.writable()
        self.stage_padding(rows)
        self.upload(rows)

    def _host_outputs(self, rows: int) -> DecodeResult:
        c = self.config
        return DecodeResult(torch.empty(rows, c.patch_size, c.feat_dim, pin_memory=True),
                            torch.empty(rows, dtype=torch.bool, pin_memory=True),
                            torch.empty(rows, c.samples_per_patch, pin_memory=True))

    def allocate_flat(self, keys: list[tuple[int, ...]], eager: tuple[int, int] | None = None) -> None:
        """Static flat-batch buffers (and their pinned host mirror on CUDA) for LM graphs of these buckets (small
        (tokens, seqs) and large (tokens, seqs, audio rows) ones) and, with `eager` (the largest `eager_flat_key`),
        for eager mixed steps up to that size."""
        self.lm_keys, self.eager_flat = keys, eager
        sizes = keys + ([eager] if eager else [])
        tokens, seqs = max(k[0] for k in sizes), max(k[1] for k in sizes)
        audio = max((k[2] for k in keys if len(k) > 2), default=0)
        p, d, width = self.config.patch_size, self.config.feat_dim, self.staging.buffers.block_tables.shape[1]
        self.flat = FlatBuffers.allocate(tokens, seqs, p, d, width, self.device, audio_rows=audio)
        cuda = self.device.type == "cuda"
        for staging in self.stagings:  # one pinned mirror per staging: a step launched ahead stages into the other
            staging.flat = FlatBuffers.allocate(tokens, seqs, p, d, width, torch.device("cpu"), pin=True,
                                                audio_rows=audio) if cuda else self.flat
            staging.flat_arrays = {name: t.numpy() for name, t in vars(staging.flat).items()}

    @property
    def flat_host(self) -> FlatBuffers:
        """The current staging's flat batch."""
        assert self.staging.flat is not None, "allocate_flat first"
        return self.staging.flat

    @property
    def flat_np(self) -> dict[str, np.ndarray]:
        assert self.staging.flat_arrays is not None, "allocate_flat first"
        return self.staging.flat_arrays

    def flat_key(self, tokens: int, seqs: int) -> tuple[int, int] | None:
        """The padded flat batch of a mixed step: the smallest small LM graph bucket holding it, else its eager
        bucket when the buffers hold that; None: neither (the unpadded eager path). `stage_flat` may then pick a
        large LM graph instead of the eager bucket."""
        key = lm_graph_key(tokens, seqs, self.lm_keys)
        if key is None and self.eager_flat is not None:
            key = eager_flat_key(tokens, seqs)
            if key[0] > self.eager_flat[0] or key[1] > self.eager_flat[1]:
                return None
        return key

    def stage_flat(self, seqs: list[ScheduledSeq], fed: Container[int] = ()) -> tuple[int, ...] | None:
        """Stage the scheduled chunks into the flat buffers, padded to their bucket (`flat_key`, or a large LM
        graph's when one holds the chunks and their audio rows; the padding positions form one extra sequence in
        the scratch KV block); the bucket, or None when none holds them.
        `fed`: seqs (one audio position each) whose patch is still on the device: zeros here, fed in later."""
        tokens = sum(s.num_tokens for s in seqs)
        key = self.flat_key(tokens, len(seqs))
        if key is None:
            return None
        h, bs, pos = self.flat_np, self.block_size, 0
        for j, seq in enumerate(seqs):
            n, start, req = seq.num_tokens, seq.start, seq.request
            ids, patches, masks = ([0], self._zero_patch, [1]) if j in fed else req.inputs(start, start + n)
            at = np.arange(start, start + n)
            table = np.asarray(req.block_table)
            h["ids"][pos:pos + n], h["masks"][pos:pos + n], h["positions"][pos:pos + n] = ids, masks, at
            h["slots"][pos:pos + n] = table[at // bs] * bs + at % bs
            h["lora"][pos:pos + n] = req.lora_slot
            self.flat_host.patches[pos:pos + n].copy_(patches)
            h["cu_seqlens"][j], h["seq_lens"][j], h["last_index"][j] = pos, start + n, pos + n - 1
            h["block_tables"][j, :len(table)] = table
            pos += n
        if key not in self.lm_keys:
            key = self._large_key(pos, len(seqs)) or key
        self._stage_flat_padding(pos, len(seqs), key)
        return key

    def _large_key(self, tokens: int, seqs: int) -> tuple[int, int, int] | None:
        """The large LM graph for the staged flat batch, its audio rows listed for LocEnc; None: none holds it."""
        h = self.flat_np
        audio = np.flatnonzero(h["masks"][:tokens])
        key = large_lm_graph_key(tokens, seqs, len(audio), self.lm_keys)
        if key is not None and key[2]:
            h["audio_rows"][:len(audio)] = audio
            h["audio_rows"][len(audio):key[2]] = audio[0]  # a repeat writes the same LocEnc row again
        return key

    def _stage_flat_padding(self, tokens: int, seqs: int, key: tuple[int, ...]) -> None:
        """Positions [tokens, T) as sequence `seqs` (writing K/V only into the scratch block), empty sequences after."""
        total, rows = key[:2]
        h, q = self.flat_np, total - tokens
        for name in ("ids", "masks", "lora"):
            h[name][tokens:total] = 0
        h["positions"][tokens:total] = np.arange(q)
        h["slots"][tokens:total] = self.scratch_block * self.block_size
        self.flat_host.patches[tokens:total].zero_()
        h["cu_seqlens"][seqs:rows + 1] = total
        h["cu_seqlens"][seqs] = tokens
        h["seq_lens"][seqs:rows] = 0
        h["seq_lens"][seqs] = q
        h["block_tables"][seqs:rows, :-(-max(q, 1) // self.block_size)] = self.scratch_block
        h["last_index"][seqs:rows] = 0

    def pad_flat(self, key: tuple[int, ...]) -> None:
        """Stage and upload an all-padding flat batch of bucket `key` (warm-up and graph capture only)."""
        self.staging.writable()
        self._stage_flat_padding(0, 0, key)
        if len(key) > 2:
            self.flat_np["audio_rows"][:key[2]] = 0
        self.upload_flat(key)

    def upload_flat(self, key: tuple[int, ...]) -> None:
        if self.flat_host is not self.flat:
            self.flat.copy_(self.flat_host, key)
            self.staging.mark_uploaded()
