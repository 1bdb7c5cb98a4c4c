"""Continuous batching: which positions of which requests run in the next step.

Every step advances every running request by one patch when it can. The order is deadline-first: a request's
urgency is the audio its listener still has queued (reported by the gateway, extrapolated in between); a request
that has not spoken yet is the most urgent. One step is a flat mix of single decode positions and prefill chunks:

1. decodes of requests whose listener has less than `sit_out_ms` buffered (one position each),
2. prefill chunks of admitted requests, then newly admitted ones (preempted ones first), under the token budget,
   shared fairly between tenants (`engine.fair_share`: the least-served tenant's next chunk first; this order
   inside each tenant),
3. decodes of well-buffered requests, with whatever budget is left (the rest sit out this step).

With lean steps (`lean_ms`, `engine.lean_steps`) a step that feeds a prompt whose listener has little or nothing
queued leaves out the decodes of listeners that reported more than `lean_ms` queued, so a new turn's first audio
waits behind shorter steps.

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

KV blocks for a prompt are taken at admission (`engine.admission`, with a small watermark kept free for running
decodes); a decode that crosses a block boundary takes one more. When none is free, the least urgent running request
is preempted: its blocks are freed and it is recomputed later (prompt + patches so far), keeping its noise generator
and VAE slot so its audio continues seamlessly. Stored voices hold their prefix blocks; requests of the voice share
the full ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.admission import Admissions
from engine.decode_halves import DecodeHalves
from engine.engine_config import EngineConfig
from engine.fair_share import FairShare
from engine.lean_steps import Listeners, leave_out, queued_ms, split_needy
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
class _Step:
    """A step being picked: its seqs so far and the positions left to it."""

    seqs: list[ScheduledSeq]
    budget: int


class _Unforeseen(Exception):
    """`Scheduler.schedule_ahead` cannot tell what `schedule` will pick."""


def _admission_order(req: Request) -> tuple:
    """Preempted requests first (they were speaking), then by priority, then first come first served."""
    return not req.generated, -req.spec.params.priority, req.arrival


class Scheduler(Admissions):
    """Picks each step's positions (the module docstring); what the requests hold is `Admissions`'."""

    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, num_blocks: int, block_size: int,
                 patch_ms: float, sit_out_ms: float = EngineConfig.sit_out_ms, loras: AdapterSlots | None = None,
                 max_prefill_tokens_while_speaking: int | None = None, split_decodes_above: int | None = None,
                 lean_ms: float = 0.0):
        super().__init__(max_num_seqs=max_num_seqs, num_blocks=num_blocks, block_size=block_size, loras=loras)
        self.max_num_seqs = max_num_seqs
        self.lean_ms = lean_ms  # lean steps (`engine.lean_steps`) above this much audio queued; 0: none
        self.listeners = Listeners()  # (lean steps) what a continuation's listener has queued when it arrives
        self.halves = DecodeHalves(split_decodes_above)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_while_speaking = max_prefill_tokens_while_speaking or max_num_batched_tokens
        self.patch_ms = patch_ms
        self.sit_out_ms = sit_out_ms
        self.fair = FairShare()  # prefill order across tenants
        self.blocked: Request | None = None  # the waiting request the last step could not admit (it holds the rest)
        self.num_steps = 0

    @property
    def split(self) -> bool:
        """Whether the decodes take turns by half (`engine.decode_halves`)."""
        return self.halves.split

    # ---- requests in and out -------------------------------------------------------------------------------
    def add(self, spec: RequestSpec) -> Request:
        req = Request(spec)
        if self.lean_ms:
            self.listeners.adopt(req)
        self.requests[spec.request_id] = req
        self.waiting.append(req)
        return req

    def cancel(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "cancelled")
        return req

    def update_buffered(self, request_id: str, audio_ms: float) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            req.report_buffered(audio_ms)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- one step ------------------------------------------------------------------------------------------
    # `schedule` picks a step from the state as it is; `schedule_ahead` applies the same rules (`_fill`: which half
    # decodes, the prefill room, the fair admissions, decode blocks) to the state that the step still on the device
    # leaves behind. A decode at position p needs KV blocks for p + 1 positions.
    def schedule(self) -> list[ScheduledSeq]:
        """The next step: urgent decodes, prompt chunks and admissions, then the other decodes (module docstring)."""
        now = time.monotonic()
        speaking = any(r.generated for r in self.running)
        urgency = {id(r): self._urgency(r, now) for r in self.running}
        order = self._deadline_order(self.running, urgency)
        step = _Step([], self.max_num_batched_tokens)
        ran: set[int] = set()

        def decode(reqs: list[Request], may_preempt: bool) -> None:
            for req in reqs:
                if step.budget < 1 or req.status is not Status.RUNNING:
                    continue
                while not self.blocks.grow(req.block_table, req.num_computed + 1):
                    victims = [r for r in reversed(order) if id(r) not in ran and r.status is Status.RUNNING]
                    if not may_preempt or not victims or victims[0] is req:
                        if may_preempt:
                            self._preempt(req)
                        break
                    self._preempt(victims[0])
                else:
                    step.seqs.append(ScheduledSeq(req, req.num_computed, 1, True))
                    ran.add(id(req))
                    step.budget -= 1

        turn, decodes = self.halves.decoding(self.halves.next_turn(lambda: [r for r in self.running if r.generated]),
                                            [r for r in order if not r.is_prefilling])
        urgent = [r for r in decodes if urgency[id(r)] <= self.sit_out_ms]
        rest = [r for r in decodes if urgency[id(r)] > self.sit_out_ms]
        self._fill(step, urgent, [r for r in order if r.is_prefilling], rest, speaking, decode, self._admit_waiting,
                   lambda r: urgency[id(r)] if id(r) in urgency else self._urgency(r, now))
        self._drop_admitted()
        return self._commit(turn, step.seqs)

    def schedule_ahead(self, seqs: list[ScheduledSeq], admit: bool = False,
                       max_tokens: int | None = None) -> list[ScheduledSeq] | None:
        """The step after `seqs`, a step still on the device: what `schedule` will pick once `seqs` is collected,
        assuming its requests come out of it running but those it ends by `max_length` (one that stops turns out a
        wasted row, dropped at collection). Those sampling in `seqs` continue from its samples; while the decodes are
        split, the other half continues from its collected patches. None where that cannot be told before the
        collection, or the step may not run ahead: a prompt chunk in `seqs`, a prompt between chunks, a running
        request that `seqs` skipped, waiting requests and not `admit` (the runner cannot admit ahead), a decode that
        would sit out or need a preemption, an admission that what `seqs` frees could change, more than `max_tokens`
        positions."""
        if (self.waiting and not admit) or any(not s.emit for s in seqs):
            return None
        after = {id(s.request): s.start + s.num_tokens for s in seqs}  # -> the request's next position
        # running requests whose last patch `seqs` samples: gone once it is collected
        running = Status.RUNNING
        ending = [r for r in (s.request for s in seqs)
                  if len(r.generated) + 1 >= r.spec.params.max_length and r.status is running]

        def staying(reqs: list[Request]) -> list[Request]:  # `reqs` (each running) without those
            if ending:
                reqs = list(reqs)
                for req in ending:  # a few, each found by identity
                    reqs.remove(req)
            return reqs

        turn = self.halves.next_turn(lambda: staying([r for r in self.running if r.generated or id(r) in after]))
        if turn is None and not self.lean_ms:
            decodes = [r for r in (s.request for s in seqs) if r.status is running]
            if len(decodes) != len(self.running):
                return None  # a request `seqs` did not run
        else:
            if any(r.is_prefilling for r in self.running if id(r) not in after):
                return None  # a prompt between chunks: the synchronous path schedules its next one
            decodes = self.running  # with those that sat out `seqs` (the other half, or lean), from their patches
        decodes = staying(decodes)
        turn, decodes = self.halves.decoding(turn, decodes)
        step = _Step([], self.max_num_batched_tokens)
        urgent, rest = decodes, []
        tight = bool(self.waiting) and step.budget - len(decodes) < self.max_prefill_while_speaking
        now = time.monotonic()
        urgency: dict[int, float] = {}
        if tight or self.lean_ms:
            # prompts may leave the least urgent decodes part of the budget, or (lean) out of the step: which ones is
            # `schedule`'s order (those in `seqs` have a patch more queued by then)
            urgency = {id(r): self._urgency(r, now, int(id(r) in after)) for r in decodes}
            decodes = self._deadline_order(decodes, urgency)
            urgent = [r for r in decodes if urgency[id(r)] <= self.sit_out_ms]
            rest = [r for r in decodes if urgency[id(r)] > self.sit_out_ms]

        def decode(reqs: list[Request], may_preempt: bool) -> None:
            if len(reqs) > step.budget:
                raise _Unforeseen  # a decode would sit out
            grow, start_of, out = self.blocks.grow, after.get, step.seqs
            for req in reqs:
                start = start_of(id(req), req.num_computed)  # continuing `seqs`, or from its collected patch
                if not grow(req.block_table, start + 1):
                    raise _Unforeseen  # a preemption may be due
                out.append(ScheduledSeq(req, start, 1, True))
            step.budget -= len(reqs)

        # `schedule` would see the KV blocks and VAE and LoRA slots that `seqs` frees, and would take the blocks of
        # the less urgent decodes after admitting: an admission that fails here but might pass there is unforeseen
        free = self.blocks.num_free
        spare: tuple[int, int, bool] | None = None
        admitted: list[tuple[Request, int | None]] = []

        def admit_ahead(req: Request) -> bool:
            nonlocal spare
            if spare is None:
                grown = 0 if tight else free - self.blocks.num_free
                watermark = self.watermark if len(ending) == len(self.running) else 0
                spare = (sum(r.vae_slot is not None for r in ending),
                         grown + watermark + sum(len(r.block_table) for r in ending), any(r.lora_slot for r in ending))
            slot = req.vae_slot
            if self._admit_waiting(req):
                admitted.append((req, slot))
                return True
            if spare[2] if self._fits(req) else self._fits(req, spare[0], spare[1]):
                raise _Unforeseen
            return False

        fair, blocked = self.fair.snapshot(), self.blocked
        try:
            self._fill(step, urgent, [], rest, bool(decodes) or turn is not None, decode, admit_ahead,
                       lambda r: urgency[id(r)] if id(r) in urgency else self._urgency(r, now))
            if not step.seqs or (max_tokens and self.max_num_batched_tokens - step.budget > max_tokens):
                raise _Unforeseen
        except _Unforeseen:
            self._unadmit(admitted)
            self.fair.restore(fair)
            self.blocked = blocked
            return None
        self._drop_admitted()
        return self._commit(turn, step.seqs)

    def _fill(self, step: _Step, urgent: list[Request], prefilling: list[Request], rest: list[Request],
              speaking: bool, decode: Callable[[list[Request], bool], None], admit: Callable[[Request], bool],
              urgency: Callable[[Request], float]) -> None:
        """The rules of a step, on either path: the `urgent` decodes (they may preempt), then prompt chunks of the
        `prefilling` requests still running and of waiting ones admitted (`admit`) in the fair order under the
        prefill room, then the `rest` of the decodes with whatever budget is left (they never preempt). With lean
        steps each tenant's needy prompts go first, and a step that feeds one leaves out the decodes of listeners
        that reported plenty queued (`engine.lean_steps`; `urgency`: a request's, as `_urgency` tells it)."""
        prompts = [r for r in prefilling if r.status is Status.RUNNING] + sorted(self.waiting, key=_admission_order)
        needy: set[int] = set()
        held: list[Request] = []  # urgent decodes left out while a needy prompt is fed
        if self.lean_ms:
            first, later = split_needy(prompts, urgency, self.lean_ms)
            prompts, needy = first + later, {id(r) for r in first}
            if needy:
                urgent, held = leave_out(urgent, urgency, self.lean_ms)
        decode(urgent, True)
        queues = self._tenant_queues(prompts)
        # prefill positions: what the urgent decodes left, at most the cap while someone waits on this step (a
        # listener, or another tenant's prompt)
        room = min(step.budget, self.max_prefill_while_speaking) if speaking or len(queues) > 1 else step.budget
        admitting = True  # until a waiting request cannot be admitted: those behind it wait too
        fed = False  # a needy prompt's chunk is in the step
        self.blocked = None
        picks = self.fair.order(queues)
        chunked = sum(r.status is Status.RUNNING for r in prompts)  # admitted prompts not yet picked
        for tenant, req in picks:
            if room <= 0:
                break
            if req.status is Status.WAITING:
                if admitting and not admit(req):
                    admitting, self.blocked = False, req
                if not admitting:
                    if not chunked:  # only waiting requests are left, and they wait
                        picks.skip_rest()
                        break
                    continue
            else:
                chunked -= 1
            n = min(req.num_pending, room)
            step.seqs.append(self._chunk(req, n))
            step.budget -= n
            room -= n
            fed = fed or id(req) in needy
            self.fair.charge(tenant, n)
        if fed and admitting:  # (a prompt that waits for room: the streams hold it, none sit out)
            rest = leave_out(rest, urgency, self.lean_ms)[0]
        elif held:
            decode(held, True)
        decode(rest, False)

    def _urgency(self, req: Request, now: float, unseen: int = 0) -> float:
        """Audio queued at `req`'s listener (its deadline); with lean steps a report before its first patch counts."""
        if self.lean_ms:
            return queued_ms(req, now, self.patch_ms, unseen)
        return req.buffered_ms(now, self.patch_ms, unseen)

    @staticmethod
    def _deadline_order(reqs: list[Request], urgency: dict[int, float]) -> list[Request]:
        """Higher priority first, then the listener with the least audio queued, then first come first served."""
        return sorted(reqs, key=lambda r: (-r.spec.params.priority, urgency[id(r)], r.arrival))

    def _commit(self, turn: int | None, seqs: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """`seqs` as the next step, and its turn (none when empty: a step not scheduled takes no turn)."""
        if seqs:
            self.num_steps += 1
            self.halves.commit(turn, [s.request for s in seqs if s.emit and not s.request.generated], self.running)
        return seqs

    @staticmethod
    def _chunk(req: Request, n: int) -> ScheduledSeq:
        """The next `n` positions of `req`; it samples when they end its pending ones (a voice prefix never does)."""
        start = req.num_computed
        return ScheduledSeq(req, start, n, start + n == req.seq_len and not req.spec.prefix_only)

    @staticmethod
    def _tenant_queues(prompts: list[Request]) -> dict[str | None, list[Request]]:
        """Each tenant's prefill candidates in their order: admitted prompts between chunks (deadline-ordered), then
        waiting ones (preempted first, then by priority, first come first)."""
        queues: dict[str | None, list[Request]] = {}
        for req in prompts:
            queues.setdefault(req.spec.tenant or None, []).append(req)
        return queues

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
            if self.lean_ms:
                now = time.monotonic()
                self.listeners.finished(req, self._urgency(req, now), now)
            finished.append(req)
        return finished

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
            "free_slots": len(self.free_slots), "steps": self.num_steps, "split_steps": self.halves.num_split_steps,
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
