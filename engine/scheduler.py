"""Continuous batching: which positions of which requests run in the next step.

Every step advances every running request by one patch when it can. The order is deadline-first: a request's
urgency is the audio its listener still has queued (reported by the gateway, extrapolated in between); a request
that has not spoken yet is the most urgent. One step is a flat mix of single decode positions and prefill chunks:

1. decodes of requests whose listener has less than `sit_out_ms` buffered (one position each),
2. prefill chunks of admitted requests, then newly admitted ones (preempted ones first), under the token budget,
   shared fairly between tenants (`engine.fair_share`: the least-served tenant's next chunk first; this order
   inside each tenant),
3. decodes of well-buffered requests, with whatever budget is left (the rest sit out this step).

A step's positions are capped by `max_num_batched_tokens`; its prefill positions, while any stream is speaking, by
the smaller `max_prefill_tokens_while_speaking`: a step's length is every running listener's wait for its next
patch. With nobody speaking yet (a burst from idle) nobody waits, and one step can prefill the whole burst: every
request's first audio then comes after one long step instead of after one short step per slice of the burst. That
holds for one tenant's burst only: while prompts of several tenants wait, the smaller cap applies too, so another
tenant's prompt (first in the step by the fair order) waits for a short step, not for the whole burst's.

Under high load (`split_decodes_above` speaking streams) the decodes split into two halves that take turns: each step
advances one half (plus the prefills and admissions), so a step is about half as long. A new prompt waits for the
step on the device, the one launched behind it and its own, so its first audio comes about twice as fast, while
every stream still gets a patch every two steps: its gap stays about one full-batch step. A stream joins the smaller
half at its first patch. The split ends below 3/4 of the bound.

KV blocks for a prompt are taken at admission (with a small watermark kept free for running decodes); a decode that
crosses a block boundary takes one more. When none is free, the least urgent running request is preempted: its
blocks are freed and it is recomputed later (prompt + patches so far), keeping its noise generator and VAE slot so
its audio continues seamlessly. Stored voices hold their prefix blocks; requests of the voice share the full ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.engine_config import EngineConfig
from engine.fair_share import FairShare
from engine.kv_cache import BlockManager
from engine.lora import AdapterSlots
from engine.request import Request, RequestSpec, Status

SETTLED_MS = 1000.0  # a stream's deadline slack counts for routing once it has spoken this long


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # first position fed this step
    num_tokens: int
    emit: bool  # the chunk ends the sequence: a patch is sampled


@dataclass
class VoicePrefix:
    blocks: list[int]  # full blocks only, so no request ever writes into them
    length: int  # prefix positions


def _admission_order(req: Request) -> tuple:
    """Preempted requests first (they were speaking), then by priority, then first come first served."""
    return not req.generated, -req.spec.params.priority, req.arrival


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, num_blocks: int, block_size: int,
                 patch_ms: float, sit_out_ms: float = EngineConfig.sit_out_ms, loras: AdapterSlots | None = None,
                 max_prefill_tokens_while_speaking: int | None = None, split_decodes_above: int | None = None):
        self.max_num_seqs = max_num_seqs
        self.split_decodes_above = split_decodes_above
        self.split = False  # the decodes take turns by half (`Request.decode_group`)
        self.turn = 0  # the half the last step decoded while split
        self.num_split_steps = 0
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_while_speaking = max_prefill_tokens_while_speaking or max_num_batched_tokens
        self.patch_ms = patch_ms
        self.sit_out_ms = sit_out_ms
        self.loras = loras  # LoRA slots: an admitted request holds its adapter's slot until it finishes or yields
        self.blocks = BlockManager(num_blocks, block_size)
        self.watermark = max(1, num_blocks // 100)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.voices: dict[str, VoicePrefix] = {}
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))  # VAE stream slots
        self.fair = FairShare()  # prefill order across tenants
        self.blocked: Request | None = None  # the waiting request the last step could not admit (it holds the rest)
        self.num_steps = 0
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------------------------
    def add(self, spec: RequestSpec) -> Request:
        req = Request(spec)
        self.requests[spec.request_id] = req
        self.waiting.append(req)
        return req

    def cancel(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "cancelled")
        return req

    def finish(self, req: Request, reason: str) -> None:
        """Frees everything the request holds, at once."""
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status, req.stop_reason = Status.FINISHED, reason
        self.blocks.release(req.block_table)
        req.block_table = []
        self._release_lora(req)
        if req.vae_slot is not None:
            self.free_slots.append(req.vae_slot)
            req.vae_slot = None
        del self.requests[req.request_id]

    def update_buffered(self, request_id: str, audio_ms: float) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            req.report_buffered(audio_ms)

    def remove_voice(self, voice_id: str) -> None:
        voice = self.voices.pop(voice_id, None)
        if voice is not None:
            self.blocks.release(voice.blocks)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- one step ------------------------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        now = time.monotonic()
        budget = self.max_num_batched_tokens
        speaking = any(r.generated for r in self.running)
        urgency = {id(r): r.buffered_ms(now, self.patch_ms) for r in self.running}
        order = sorted(self.running, key=lambda r: (-r.spec.params.priority, urgency[id(r)], r.arrival))
        seqs: list[ScheduledSeq] = []
        scheduled: set[int] = set()

        def run(req: Request, n: int) -> None:
            nonlocal budget
            seqs.append(self._chunk(req, n))
            scheduled.add(id(req))
            budget -= n

        def decode(req: Request, may_preempt: bool) -> None:
            if budget < 1 or req.status is not Status.RUNNING:
                return
            while not self.blocks.grow(req.block_table, req.seq_len):
                victims = [r for r in reversed(order) if id(r) not in scheduled and r.status is Status.RUNNING]
                if not may_preempt or not victims or victims[0] is req:
                    if may_preempt:
                        self._preempt(req)
                    return
                self._preempt(victims[0])
            run(req, 1)

        turn = self._next_turn()
        decodes = [r for r in order if not r.is_prefilling]
        if turn is not None:
            if not any(r.decode_group == turn for r in decodes):
                turn = 1 - turn  # that half has nothing to decode (yet): the other one's turn again
            decodes = [r for r in decodes if r.decode_group == turn]
        for req in decodes:
            if urgency[id(req)] <= self.sit_out_ms:
                decode(req, may_preempt=True)
        admitting = True  # until a waiting request cannot be admitted: those behind it wait too
        self.blocked = None
        prefilling = [r for r in order if r.is_prefilling and r.status is Status.RUNNING]
        queues = self._tenant_queues(prefilling)
        # prefill positions: what the urgent decodes left, at most the cap while someone waits on this step (a
        # listener, or another tenant's prompt)
        room = min(budget, self.max_prefill_while_speaking) if speaking or len(queues) > 1 else budget
        for tenant, req in self.fair.order(queues):
            if room <= 0:
                break
            if req.status is Status.WAITING:
                if admitting and not self._admit_waiting(req):
                    admitting, self.blocked = False, req
                if not admitting:
                    continue
            n = min(req.num_pending, room)
            run(req, n)
            room -= n
            self.fair.charge(tenant, n)
        self._drop_admitted()
        for req in decodes:
            if id(req) not in scheduled:
                decode(req, may_preempt=False)
        if seqs:
            self.num_steps += 1
            self._take_turn(turn, seqs)
        return seqs

    def schedule_ahead(self, seqs: list[ScheduledSeq], admit: Callable[[Request], bool] | None = None,
                       max_tokens: int | None = None) -> list[ScheduledSeq] | None:
        """The step after `seqs`, a step still on the device, assuming each of its requests comes out of it running
        (one that stops turns out one wasted row, dropped at collection): one decode position for each request
        that samples in `seqs`. None unless that is what `schedule` would pick: every running request in `seqs`
        and sampling there, a KV block for each, and nothing waiting, or (`admit`) waiting requests that `admit`
        accepts, admitted with their prompt chunks under the prefill cap (and `max_tokens` positions in all), as
        `schedule` admits them. While the decodes are split, the step decodes the other half instead: the requests
        of that half that `seqs` does not run continue from their collected patches, those it runs (a new stream
        that joined that half) from its samples."""
        if (self.waiting and admit is None) or any(not s.emit for s in seqs):
            return None  # admissions due, or a prompt chunk whose next one depends on it
        in_flight = {id(s.request): s for s in seqs}
        turn = self._next_turn()
        if turn is None:
            if {id(r) for r in self.running} - in_flight.keys():
                return None  # a request `seqs` did not run
            continuing = [s.request for s in seqs]
        else:
            if any(r.is_prefilling for r in self.running if id(r) not in in_flight):
                return None  # a prompt between chunks: the synchronous path schedules its next one
            continuing = [r for r in self.running if r.decode_group == turn]
        nxt = []
        for req in continuing:
            seq = in_flight.get(id(req))
            if seq is None:
                start = req.num_computed  # collected: its input is its last patch
            elif req.status is not Status.RUNNING or len(req.generated) + 1 >= req.spec.params.max_length:
                continue  # finished since, or ends with `seqs`
            else:
                start = seq.start + seq.num_tokens
            if not self.blocks.grow(req.block_table, start + 1):
                return None  # a preemption may be due: the synchronous path decides
            nxt.append(ScheduledSeq(req, start, 1, True))
        budget = min(self.max_num_batched_tokens, max_tokens) if max_tokens else self.max_num_batched_tokens
        room = min(budget - len(nxt), self.max_prefill_while_speaking)
        if admit is not None:
            for tenant, req in self.fair.order(self._tenant_queues([])):
                if room <= 0 or not admit(req) or not self._admit_waiting(req):
                    break
                nxt.append(self._chunk(req, min(req.num_pending, room)))
                room -= nxt[-1].num_tokens
                self.fair.charge(tenant, nxt[-1].num_tokens)
            self._drop_admitted()
        if not nxt or len(nxt) > self.max_num_batched_tokens:
            return None
        self.num_steps += 1
        self._take_turn(turn, nxt)
        return nxt

    def _next_turn(self) -> int | None:
        """The half whose decodes the next step runs, or None while all decode every step. Splitting starts above
        `split_decodes_above` speaking streams (they alternate between the halves in arrival order) and ends below
        3/4 of it. Nothing is committed until `_take_turn`: a step that is not scheduled takes no turn."""
        if self.split_decodes_above is None:
            return None
        speaking = [r for r in self.running if r.generated]
        bound = self.split_decodes_above * (0.75 if self.split else 1.0)
        if len(speaking) <= bound:
            return None
        if not self.split:
            for i, req in enumerate(sorted(speaking, key=lambda r: r.arrival)):
                req.decode_group = i % 2
        return 1 - self.turn

    def _take_turn(self, turn: int | None, seqs: list[ScheduledSeq]) -> None:
        """Commit a scheduled step's turn; while split, its new streams (first patch) join the smaller half."""
        self.split = turn is not None
        if turn is None:
            return
        self.turn = turn
        self.num_split_steps += 1
        new = [s.request for s in seqs if s.emit and not s.request.generated]
        if new:
            sizes = [0, 0]
            for req in self.running:
                if req.generated:
                    sizes[req.decode_group] += 1
            for req in new:
                req.decode_group = int(sizes[1] < sizes[0])
                sizes[req.decode_group] += 1

    @staticmethod
    def _chunk(req: Request, n: int) -> ScheduledSeq:
        """The next `n` positions of `req`; it samples when they end its pending ones (a voice prefix never does)."""
        start = req.num_computed
        return ScheduledSeq(req, start, n, start + n == req.seq_len and not req.spec.prefix_only)

    def _tenant_queues(self, prefilling: list[Request]) -> dict[str | None, list[Request]]:
        """Each tenant's prefill candidates in its own order: its admitted prompts between chunks (`prefilling`,
        already deadline-ordered), then its waiting ones (preempted first, then by priority, first come first)."""
        queues: dict[str | None, list[Request]] = {}
        for req in prefilling + sorted(self.waiting, key=_admission_order):
            queues.setdefault(req.spec.tenant or None, []).append(req)
        return queues

    def _admit_waiting(self, req: Request) -> bool:
        """Admit the waiting `req` (it runs from now on) when it can be; `_drop_admitted` takes it off `waiting`."""
        if not self._admit(req):
            return False
        self.running.append(req)
        return True

    def _drop_admitted(self) -> None:
        """`waiting` without the requests admitted since: one pass, not a search per admission."""
        self.waiting = [r for r in self.waiting if r.status is Status.WAITING]

    def _admit(self, req: Request) -> bool:
        needs_slot = req.vae_slot is None and not req.spec.prefix_only
        if needs_slot and not self.free_slots:
            return False
        voice = self.voices.get(req.spec.voice_id) if req.spec.voice_id and not req.spec.prefix_only else None
        shared = voice.blocks if voice is not None and req.seq_len > voice.length else []
        need = self.blocks.blocks_for(req.seq_len) - len(shared)
        if self.blocks.num_free - need < (self.watermark if self.running else 0):
            return False
        if req.spec.lora is not None:
            slot = self.loras.acquire(req.spec.lora) if self.loras is not None else None
            if slot is None:  # every LoRA slot is held by a running request
                return False
            req.lora_slot = slot
        req.block_table = self.blocks.share(shared) + self.blocks.allocate(need)
        req.num_computed = len(shared) * self.blocks.block_size
        if needs_slot:
            req.vae_slot = self.free_slots.pop()
        req.status = Status.RUNNING
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.release(req.block_table)
        req.block_table, req.num_computed, req.status = [], 0, Status.WAITING
        self._release_lora(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)

    def postprocess(self, seqs: list[ScheduledSeq], patches: list[torch.Tensor | None],
                    stops: list[bool]) -> list[Request]:
        """Record one step's results; returns the requests that finished (already freed)."""
        finished = []
        for seq, patch, stop in zip(seqs, patches, stops, strict=True):
            req = seq.request
            if req.status is not Status.RUNNING:
                continue
            req.num_computed += seq.num_tokens
            if req.spec.prefix_only:
                if req.num_computed == req.seq_len:
                    self._keep_as_voice(req)
                    finished.append(req)
                continue
            if not seq.emit:
                continue
            assert patch is not None
            req.append(patch, self.patch_ms)
            i = len(req.generated) - 1
            if stop and i > req.spec.params.min_length:
                self.finish(req, "stop")
            elif len(req.generated) >= req.spec.params.max_length:
                self.finish(req, "length")
            else:
                continue
            finished.append(req)
        return finished

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot:
            assert self.loras is not None and req.spec.lora is not None
            self.loras.release(req.spec.lora)
            req.lora_slot = 0

    def _keep_as_voice(self, req: Request) -> None:
        full = req.seq_len // self.blocks.block_size
        voice_id = req.spec.voice_id
        assert voice_id is not None
        self.remove_voice(voice_id)
        self.voices[voice_id] = VoicePrefix(self.blocks.share(req.block_table[:full]), req.seq_len)
        self.finish(req, "stop")

    def single_adapter(self) -> int:
        """The LoRA slot that every running request uses, when they all use the same one; else 0 (at once without
        LoRA slots: this runs every step)."""
        if self.loras is None:
            return 0
        slots = {r.lora_slot for r in self.running}
        return slots.pop() if len(slots) == 1 else 0

    def stats(self) -> dict[str, int | float | None]:
        return {
            "running": len(self.running), "waiting": len(self.waiting),
            "free_blocks": self.blocks.num_free, "total_blocks": self.blocks.num_blocks,
            "voice_blocks": sum(len(v.blocks) for v in self.voices.values()),
            "free_slots": len(self.free_slots), "steps": self.num_steps, "split_steps": self.num_split_steps,
            "preemptions": self.num_preemptions,
            "min_slack_ms": self.min_slack_ms(),
        }

    def min_slack_ms(self) -> float | None:
        """Audio buffered at the most starved listener among streams past their first second (a stream that has
        just started has little buffered by nature); None when there is none. Low means this worker is late."""
        now = time.monotonic()
        slack = [r.buffered_ms(now, self.patch_ms) for r in self.running
                 if len(r.generated) * self.patch_ms >= SETTLED_MS]
        return min(slack, default=None)
