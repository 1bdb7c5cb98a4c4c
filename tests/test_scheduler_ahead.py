"""`Scheduler.schedule_ahead` is `schedule`'s rules applied to the state that the step on the device leaves: on seeded
random request mixes (prompts, patch budgets, tenants, priorities, listener reports, cancellations, splits, tight KV
blocks and slots), whenever it picks a step, a fresh `schedule()` on a copy of the state after the in-flight step is
collected picks the same rows and chunks."""

import copy
import random
import types

import pytest
import torch

from engine import request as request_module
from engine import scheduler as scheduler_module
from engine.fair_share import FairShare
from engine.request import RequestSpec, SamplingParams, Status
from engine.scheduler import ScheduledSeq, Scheduler

P, D = 2, 4
pytestmark = pytest.mark.timeout(60)


class Clock:
    """The scheduler's and the requests' `time.monotonic`, moved by the test only: a step's urgencies do not drift
    between `schedule_ahead` and the `schedule` it is compared with."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    fake = types.SimpleNamespace(monotonic=c.monotonic)
    monkeypatch.setattr(scheduler_module, "time", fake)
    monkeypatch.setattr(request_module, "time", fake)
    return c


def rows(seqs: list[ScheduledSeq]) -> set[tuple[str, int, int, bool]]:
    return {(q.request.request_id, q.start, q.num_tokens, q.emit) for q in seqs}


def collect(s: Scheduler, seqs: list[ScheduledSeq], stops: list[bool]) -> None:
    s.postprocess(seqs, [torch.zeros(P, D) if q.emit else None for q in seqs], stops)


def fresh_schedule_after(s: Scheduler, in_flight: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """`schedule()` on a copy of `s` once `in_flight` is collected, nobody stopping (what `schedule_ahead` assumes)."""
    # the specs and noise generators are the same objects in the copy (the scheduler never changes them)
    memo: dict[int, object] = {id(x): x for r in s.requests.values() for x in (r.spec, r.generator)}
    copied = copy.deepcopy(s, memo)
    seqs = copy.deepcopy(in_flight, memo)  # the same memo: its requests are the copy's
    collect(copied, seqs, [False] * len(seqs))
    return copied.schedule()


def scenario(seed: int, clock: Clock, lean: bool = False) -> tuple[int, int, int]:
    """Run one random mix the way the worker does (a step launched ahead when one is picked); returns how many steps
    were picked ahead, how many of them admitted prompts, and how many of them were split."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4])
    s = Scheduler(max_num_seqs=rng.randint(3, 10), max_num_batched_tokens=rng.choice([12, 24, 64]),
                  num_blocks=rng.randint(12, 60), block_size=block_size, patch_ms=80.0,
                  sit_out_ms=rng.choice([100.0, 2000.0]),
                  max_prefill_tokens_while_speaking=rng.choice([None, 6, 16]),
                  split_decodes_above=rng.choice([None, 2, 4]),
                  lean_ms=rng.choice([100.0, 1000.0]) if lean else 0.0)
    tenants = [None, "a", "b"][:rng.randint(1, 3)]
    count = 0

    def arrive() -> None:
        nonlocal count
        for _ in range(rng.choice([0, 0, 0, 1, 1, 3])):
            n = rng.randint(1, 14)
            spec = RequestSpec(f"r{count}", list(range(n)), [0] * n, (P, D),
                               SamplingParams(max_length=rng.randint(1, 9), min_length=0,
                                              priority=rng.choice([0, 0, 1])),
                               tenant=rng.choice(tenants))
            count += 1
            s.add(spec)

    ahead_steps = admitting = split = 0
    current: list[ScheduledSeq] = []
    for _ in range(60):
        clock.now += rng.choice([0.0, 0.05, 0.5, 3.0])
        if not current:
            arrive()
            current = s.schedule()
            if not current:
                if s.waiting and not s.running:  # the worker fails what can never fit
                    s.finish(s.blocked or s.waiting[0], "error")
                continue
        arrive()  # prompts arriving while the step is on the device
        for req in list(s.running) + (list(s.waiting) if lean else []):  # lean: reports before the first patch
            if rng.random() < 0.2:
                s.update_buffered(req.request_id, rng.choice([0.0, 500.0, 5000.0]))
            elif rng.random() < 0.02:
                s.cancel(req.request_id)
        expected = fresh_schedule_after(s, current)
        ahead = s.schedule_ahead(current, admit=True)
        if ahead is not None:
            assert rows(ahead) == rows(expected), f"seed {seed}"
            ahead_steps += 1
            admitting += any(not q.request.generated for q in ahead)
            split += s.split
        collect(s, current, [rng.random() < 0.1 for _ in current])
        current = ahead or []
    return ahead_steps, admitting, split


@pytest.mark.parametrize("lean", [False, True])
def test_a_step_picked_ahead_is_what_schedule_picks_after_the_collection(clock, lean):
    totals = [0, 0, 0]
    for seed in range(40):
        for i, n in enumerate(scenario(seed, clock, lean)):
            totals[i] += n
    ahead, admitting, split = totals
    # the mixes exercise every rule, not only plain decoding
    assert ahead > 400 and admitting > 50 and split > 30, totals


def test_a_refused_step_ahead_leaves_the_state_as_it_was(clock):
    """An admission that what the in-flight step frees could change: no step, and nothing admitted or charged."""
    s = Scheduler(max_num_seqs=1, max_num_batched_tokens=16, num_blocks=16, block_size=4, patch_ms=80.0)
    last = RequestSpec("last", [0, 1], [0, 0], (P, D), SamplingParams(max_length=2, min_length=0))
    s.add(last)
    collect(s, s.schedule(), [False])
    in_flight = s.schedule()  # its second and last patch: its VAE slot is free once collected
    s.add(RequestSpec("next", [0], [0], (P, D), SamplingParams(), tenant="t"))
    served = dict(s.fair.served)
    assert s.schedule_ahead(in_flight, admit=True) is None
    assert s.requests["next"].status is Status.WAITING and [r.request_id for r in s.waiting] == ["next"]
    assert s.fair.served == served and s.free_slots == [] and s.num_steps == 2
    collect(s, in_flight, [False])
    assert rows(s.schedule()) == {("next", 0, 1, True)}  # the synchronous path admits it


def test_skipping_the_rest_of_a_fair_order_records_what_iterating_it_does():
    rng = random.Random(7)
    for _ in range(200):
        queues = {t: list(range(rng.randint(0, 5))) for t in "abcd"[:rng.randint(1, 4)]}
        a, b = FairShare(), FairShare()
        for fair in (a, b):  # the same history: some picks and charges
            for tenant, _item in fair.order({t: [0, 1] for t in queues}):
                fair.charge(tenant, 3 if tenant == "a" else 1)
                break
        taken = rng.randint(0, 3)
        for fair, skip in ((a, False), (b, True)):
            picks = fair.order(queues)
            for _ in range(taken):
                if next(picks, None) is None:
                    break
            if skip:
                picks.skip_rest()
            else:
                for _ in picks:
                    pass
        order = lambda f: sorted(f.last_pick, key=f.last_pick.get)  # noqa: E731
        assert order(a) == order(b) and a.served == b.served


def test_a_step_ahead_larger_than_the_flat_buffers_is_left_to_the_synchronous_path(clock):
    """`max_tokens` (what the runner can launch ahead) is no rule of `schedule`: a step past it is not picked ahead,
    and the prompt it would admit is admitted by the synchronous step instead."""
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=64, block_size=4, patch_ms=80.0)
    s.add(RequestSpec("talker", [0, 1], [0, 0], (P, D), SamplingParams()))
    collect(s, s.schedule(), [False])
    in_flight = s.schedule()
    s.add(RequestSpec("long", list(range(20)), [0] * 20, (P, D), SamplingParams()))
    assert s.schedule_ahead(in_flight, admit=True, max_tokens=16) is None
    assert s.requests["long"].status is Status.WAITING and s.blocks.num_free == 64 - 1
    ahead = s.schedule_ahead(in_flight, admit=True, max_tokens=64)
    assert ahead is not None and rows(ahead) == {("talker", 3, 1, True), ("long", 0, 20, True)}
