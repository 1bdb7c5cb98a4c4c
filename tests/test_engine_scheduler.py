"""Scheduler and KV block manager, without a model: which positions run in each step and who owns which block."""

import random
import types

import pytest
import torch

from engine import request as request_module
from engine import scheduler as scheduler_module
from engine.kv_cache import BlockManager
from engine.request import RequestSpec, SamplingParams, Status
from engine.scheduler import Scheduler

P, D = 2, 4
pytestmark = pytest.mark.timeout(60)


def spec(rid: str, n: int, max_length: int = 50, voice_id: str | None = None, prefix_only: bool = False,
         priority: int = 0, tenant: str | None = None) -> RequestSpec:
    return RequestSpec(rid, list(range(n)), [0] * n, (P, D),
                       SamplingParams(max_length=max_length, min_length=0, priority=priority),
                       voice_id=voice_id, prefix_only=prefix_only, tenant=tenant)


def make(num_blocks: int = 64, block_size: int = 4, seqs: int = 8, tokens: int = 64) -> Scheduler:
    return Scheduler(max_num_seqs=seqs, max_num_batched_tokens=tokens, num_blocks=num_blocks,
                     block_size=block_size, patch_ms=80.0)


def step(s: Scheduler, stop: set[str] = frozenset()):
    seqs = s.schedule()
    patches = [torch.full((P, D), float(q.request.seq_len)) if q.emit else None for q in seqs]
    s.postprocess(seqs, patches, [q.request.request_id in stop for q in seqs])
    return seqs


def test_block_manager_refcounts():
    bm = BlockManager(4, 2)
    a = bm.allocate(2)
    shared = bm.share(a)
    bm.release(a)
    assert bm.num_free == 2  # still owned through `shared`
    table = list(shared)
    assert bm.grow(table, 6) and len(table) == 3 and bm.num_free == 1
    assert not bm.grow(table, 10) and len(table) == 3  # unchanged when blocks run out
    bm.release(table)
    assert bm.num_free == 4
    with pytest.raises(MemoryError):
        bm.allocate(5)


def test_new_prefill_runs_in_the_same_step_as_running_decodes():
    s = make()
    s.add(spec("a", 5))
    step(s)
    step(s)
    s.add(spec("b", 9))
    seqs = step(s)
    kinds = {q.request.request_id: (q.num_tokens, q.emit) for q in seqs}
    assert kinds == {"a": (1, True), "b": (9, True)}  # one flat batch: a's decode and b's whole prompt


def test_long_prompt_is_chunked_under_the_token_budget_while_decodes_continue():
    history = []
    s = make(tokens=8)
    s.add(spec("a", 3))
    step(s)
    s.add(spec("long", 20))
    for _ in range(4):
        seqs = step(s)
        history.append({q.request.request_id: q.num_tokens for q in seqs})
    assert all(h["a"] == 1 for h in history)  # the running stream advances every step
    assert [h.get("long", 0) for h in history[:3]] == [7, 7, 6]
    assert all(sum(h.values()) <= 8 for h in history)


def test_preemption_recomputes_and_keeps_generated_patches():
    s = make(num_blocks=6, block_size=4, tokens=64)
    s.watermark = 0
    s.add(spec("a", 8))
    s.add(spec("b", 8))
    step(s)  # a and b take 2 blocks each, 2 free
    for _ in range(12):
        step(s)
    assert s.num_preemptions > 0
    assert all(len(r.generated) >= 1 for r in s.requests.values())
    # every block held by a running request covers its sequence; nothing leaks
    held = sum(len(r.block_table) for r in s.running)
    assert held + s.blocks.num_free == 6


def test_cancel_frees_everything_at_once():
    s = make(num_blocks=16)
    for i in range(5):
        s.add(spec(f"r{i}", 6))
    step(s)
    step(s)
    slots = len(s.free_slots)
    for i in range(5):
        s.cancel(f"r{i}")
    assert s.blocks.num_free == 16 and not s.running and not s.waiting and not s.requests
    assert len(s.free_slots) == slots + 5


def test_stored_voice_prefix_blocks_are_shared():
    s = make(num_blocks=32, block_size=4)
    s.add(spec("voice:v", 10, voice_id="v", prefix_only=True))
    while s.has_work:
        step(s)
    assert s.voices["v"].blocks and s.voices["v"].length == 10
    voice_blocks = list(s.voices["v"].blocks)  # 2 full blocks; the partial third is recomputed per request
    s.add(spec("a", 14, voice_id="v"))
    seqs = step(s)
    req = seqs[0].request
    assert req.block_table[:2] == voice_blocks and seqs[0].start == 8 and seqs[0].num_tokens == 6
    assert all(s.blocks.refcount[b] == 2 for b in voice_blocks)
    s.cancel("a")
    s.remove_voice("v")
    assert s.blocks.num_free == 32


def test_well_buffered_requests_sit_out_when_the_budget_is_short():
    s = make(tokens=3)
    for rid in ("a", "b", "c"):
        s.add(spec(rid, 1))
    step(s)
    s.update_buffered("a", 5000.0)  # seconds queued at the listener
    s.add(spec("new", 2))
    seqs = step(s)
    ran = {q.request.request_id for q in seqs}
    assert ran == {"b", "c", "new"}  # the new turn's first patch outranks a well-buffered stream


def test_length_and_stop_finish_and_free():
    s = make()
    s.add(spec("len", 3, max_length=4))
    s.add(spec("stop", 3))
    n = 0
    while s.has_work and n < 20:
        step(s, stop={"stop"})
        n += 1
    assert s.blocks.num_free == s.blocks.num_blocks and not s.requests


def test_random_churn_returns_every_block():
    rng = random.Random(0)
    s = make(num_blocks=24, block_size=4, seqs=6, tokens=16)
    live: list[str] = []
    for i in range(300):
        if rng.random() < 0.5:
            rid = f"r{i}"
            s.add(spec(rid, rng.randint(1, 12), max_length=rng.randint(1, 10), priority=rng.randint(0, 1)))
            live.append(rid)
        if live and rng.random() < 0.2:
            s.cancel(live.pop(rng.randrange(len(live))))
        step(s, stop={rid for rid in live if rng.random() < 0.05})
        owners = [0] * s.blocks.num_blocks
        for r in s.running:
            for b in r.block_table:
                owners[b] += 1
        assert owners == s.blocks.refcount  # every used block is owned by exactly its refcount
        assert all(r.status is Status.RUNNING for r in s.running)
    for rid in live:
        s.cancel(rid)
    assert s.blocks.num_free == 24 and not s.requests and len(s.free_slots) == 6


def test_a_burst_from_idle_prefills_in_one_step_but_not_while_someone_speaks():
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=128, block_size=4, patch_ms=80.0,
                  max_prefill_tokens_while_speaking=16)
    for i in range(4):
        s.add(spec(f"burst{i}", 12))
    seqs = step(s)  # nobody is listening yet: all 48 positions in one step, every request emits
    assert [(q.num_tokens, q.emit) for q in seqs] == [(12, True)] * 4
    for i in range(2):
        s.add(spec(f"late{i}", 12))
    seqs = step(s)  # four listeners wait for this step: their decodes, and at most 16 prefill positions
    decodes = [q for q in seqs if q.request.request_id.startswith("burst")]
    prefill = [q for q in seqs if q.request.request_id.startswith("late")]
    assert [(q.num_tokens, q.emit) for q in decodes] == [(1, True)] * 4
    assert sum(q.num_tokens for q in prefill) == 16 and [q.num_tokens for q in prefill] == [12, 4]


def split_scheduler(above: int = 4) -> Scheduler:
    return Scheduler(max_num_seqs=16, max_num_batched_tokens=256, num_blocks=256, block_size=4, patch_ms=80.0,
                     split_decodes_above=above)


def decoded(seqs) -> set[str]:
    return {q.request.request_id for q in seqs if q.num_tokens == 1 and q.request.generated}


def test_split_decodes_take_turns_by_half_and_rejoin_below_three_quarters():
    s = split_scheduler(above=4)
    for i in range(6):
        s.add(spec(f"r{i}", 3, max_length=12 + (i % 2)))
    step(s)  # every prompt prefilled and sampled in one step
    last: dict[str, int] = {}
    for n in range(8):  # six speaking > 4: each step decodes one half, every stream every other step
        seqs = step(s)
        ids = decoded(seqs)
        assert len(ids) == 3 and s.split
        for rid in ids:
            assert n - last.get(rid, n - 2) == 2
            last[rid] = n
    s.add(spec("new", 3, max_length=40))
    seqs = step(s)
    assert "new" in {q.request.request_id for q in seqs} and len(decoded(seqs)) == 3  # admitted in any turn
    groups = [r.decode_group for r in s.running if r.generated]
    assert sorted(groups).count(0) in (3, 4)  # it joined the smaller half
    while len(s.running) > 2:  # the twelve-patch streams end; below 3 speaking (3/4 of 4) all decode again
        step(s)
    seqs = step(s)
    assert not s.split and decoded(seqs) == {r.request_id for r in s.running}


def test_split_step_scheduled_ahead_decodes_the_other_half_from_collected_patches():
    s = split_scheduler(above=2)
    for i in range(4):
        s.add(spec(f"r{i}", 3))
    step(s)
    step(s)  # the first split step
    running = s.schedule()  # "on the device": not collected
    s.add(spec("late", 3))
    assert s.schedule_ahead(running) is None  # an admission is due and this step may not admit
    ahead = s.schedule_ahead(running, admit=True)
    assert ahead is not None
    other = [q for q in ahead if q.request.request_id != "late"]
    assert {q.request.request_id for q in other} == {f"r{i}" for i in range(4)} - decoded(running)
    for q in other:  # collected a step ago: each feeds its next position
        assert (q.start, q.num_tokens, q.emit) == (q.request.num_computed, 1, True)
    late = next(q for q in ahead if q.request.request_id == "late")
    assert (late.start, late.num_tokens, late.emit) == (0, 3, True)


def test_a_new_tenant_is_prefilled_in_the_next_step_although_another_queued_300():
    s = make(num_blocks=4096, seqs=512, tokens=64)
    for i in range(300):
        s.add(spec(f"a{i}", 8, tenant="key-a"))
    first = step(s)
    assert {q.request.spec.tenant for q in first} == {"key-a"} and len(first) == 8  # the burst fills the step
    s.add(spec("b", 8, tenant="key-b"))
    seqs = step(s)
    prefills = [q.request.request_id for q in seqs if q.num_tokens > 1]
    assert prefills[0] == "b"  # B's prompt went first, not behind A's 292 waiting ones
    assert sum(q.num_tokens for q in seqs) == 64 and len(prefills) > 1  # A's burst gets the rest of the room
    # without a tenant (the shared one) the same burst is first come, first served
    shared = make(num_blocks=4096, seqs=512, tokens=64)
    for i in range(300):
        shared.add(spec(f"a{i}", 8))
    step(shared)
    shared.add(spec("b", 8))
    step(shared)
    assert shared.requests["b"].status is Status.WAITING


def test_tenants_share_prefill_room_by_positions_and_keep_their_own_order():
    s = make(num_blocks=4096, seqs=512, tokens=40)
    for i in range(20):
        s.add(spec(f"a{i}", 10, tenant="a"))
    for i in range(20):
        s.add(spec(f"b{i}", 5, tenant="b", priority=1 if i == 7 else 0))
    served = {"a": 0, "b": 0}
    order_b = []
    for _ in range(6):
        for q in step(s):
            if q.num_tokens > 1:
                served[q.request.spec.tenant] += q.num_tokens
                if q.request.spec.tenant == "b":
                    order_b.append(q.request.request_id)
    assert abs(served["a"] - served["b"]) <= 10  # equal positions (one chunk apart), not equal prompts
    assert order_b[0] == "b7" and order_b[1:] == sorted(order_b[1:], key=lambda r: int(r[1:]))  # priority, then FIFO


def test_schedule_ahead_admits_across_tenants_fairly():
    s = make(num_blocks=4096, seqs=512, tokens=64)
    s.add(spec("talker", 4))
    running = step(s)
    for i in range(50):
        s.add(spec(f"a{i}", 8, tenant="a"))
    s.add(spec("b", 8, tenant="b"))
    ahead = s.schedule_ahead(running, admit=True)
    assert ahead is not None
    admitted = [q.request.request_id for q in ahead if q.num_tokens > 1]
    assert admitted[:2] in (["a0", "b"], ["b", "a0"])  # B is not queued behind A's 50


def test_a_burst_from_idle_is_one_step_for_one_tenant_but_capped_while_another_waits():
    def burst(second_tenant: bool) -> list:
        s = Scheduler(max_num_seqs=512, max_num_batched_tokens=4096, num_blocks=4096, block_size=4, patch_ms=80.0,
                      max_prefill_tokens_while_speaking=64)
        for i in range(100):
            s.add(spec(f"a{i}", 8, tenant="a"))
        if second_tenant:
            s.add(spec("b", 8, tenant="b"))
        return step(s)

    assert len(burst(False)) == 100  # nobody else waits: the whole burst in one step
    first = burst(True)
    assert sum(q.num_tokens for q in first) == 64  # a short step
    assert "b" in [q.request.request_id for q in first[:2]]  # B's prompt shares it, one of its first two chunks


def test_the_request_that_cannot_be_admitted_is_named_not_the_first_one_waiting():
    s = make(num_blocks=8, block_size=4)  # 32 positions of KV
    s.add(spec("small", 4, tenant="a"))
    s.add(spec("huge", 40, tenant="b", priority=5))  # goes first (priority) and never fits
    assert s.schedule() == []  # it holds the ones behind it, as admission is in order
    # what the worker fails when nothing runs: the blocking request, not whichever waits first in the list
    assert s.blocked is not None and s.blocked.request_id == "huge" and s.waiting[0].request_id == "small"
    s.finish(s.blocked, "error")
    assert [q.request.request_id for q in s.schedule()] == ["small"]


def lean_scheduler(lean_ms: float = 1000.0) -> Scheduler:
    return Scheduler(max_num_seqs=16, max_num_batched_tokens=256, num_blocks=256, block_size=4, patch_ms=80.0,
                     lean_ms=lean_ms)


def speaking(s: Scheduler, *rids: str) -> None:
    for rid in rids:
        s.add(spec(rid, 2, max_length=200))
    step(s)


@pytest.mark.parametrize("lean_ms", [0.0, 1000.0])
def test_a_lean_step_feeding_a_first_segment_leaves_out_listeners_with_plenty_queued(lean_ms):
    s = lean_scheduler(lean_ms)
    speaking(s, "full", "low", "silent")
    s.update_buffered("full", 1500.0)  # more than lean_ms queued at this listener (less than sit_out_ms)
    s.update_buffered("low", 300.0)
    # "silent" never reported: its queue is a guess, it never sits out
    s.add(spec("later", 9))
    s.update_buffered("later", 4000.0)  # a later segment of a turn whose audio still plays: no prompt waits
    s.add(spec("first", 6))  # a new turn's first segment: nothing queued
    seqs = step(s)
    ran = {q.request.request_id: q.num_tokens for q in seqs}
    if lean_ms:
        assert ran == {"low": 1, "silent": 1, "first": 6, "later": 9}
        assert [q.request.request_id for q in seqs if q.num_tokens > 1] == ["first", "later"]  # the needy one first
        # nothing needy waits now: the next step advances everyone
        assert set(r.request_id for r in (q.request for q in step(s))) == {"full", "low", "silent", "first", "later"}
    else:
        assert ran == {"full": 1, "low": 1, "silent": 1, "first": 6, "later": 9}


def test_a_later_segment_is_no_needy_prompt_until_its_listener_runs_low(monkeypatch):
    now = [100.0]
    fake = types.SimpleNamespace(monotonic=lambda: now[0])
    monkeypatch.setattr(scheduler_module, "time", fake)
    monkeypatch.setattr(request_module, "time", fake)
    s = lean_scheduler(lean_ms=1000.0)
    speaking(s, "full")
    s.update_buffered("full", 5000.0)
    for i in range(8):  # a later segment arrives before every step, its listener 1,500 ms .. 625 ms from running dry
        s.add(spec(f"later{i}", 3, max_length=1))
        s.update_buffered(f"later{i}", 1500.0 - 125.0 * i)
        ran = {q.request.request_id for q in step(s)}
        # prefilled at once either way; the well-queued stream sits out only steps that feed a needy prompt
        assert f"later{i}" in ran and ("full" in ran) == (i < 4), (i, ran)
        now[0] += 0.125
        s.update_buffered("full", 5000.0)


def test_lean_steps_never_leave_out_a_listener_below_the_bound():
    s = lean_scheduler(lean_ms=1000.0)
    speaking(s, "a", "b")
    for i in range(30):
        s.update_buffered("a", 900.0)  # under the bound: decoded in every step, prompts or not
        s.update_buffered("b", 5000.0)
        s.add(spec(f"first{i}", 2, max_length=1))
        ran = {q.request.request_id for q in step(s)}
        assert "a" in ran and "b" not in ran


def test_nobody_sits_out_while_a_prompt_waits_for_room():
    """The streams hold the VAE slots a waiting prompt needs: they run, so they finish and free them."""
    s = Scheduler(max_num_seqs=2, max_num_batched_tokens=256, num_blocks=256, block_size=4, patch_ms=80.0,
                  lean_ms=1000.0)
    speaking(s, "full")
    s.update_buffered("full", 5000.0)
    s.add(spec("first", 3))
    s.add(spec("blocked", 3))  # no slot left for it
    ran = {q.request.request_id for q in step(s)}
    assert ran == {"full", "first"} and s.blocked is s.requests["blocked"]


def test_a_continuation_of_a_finished_request_starts_from_its_listeners_queue(monkeypatch):
    """The caller's later segment carries the patches the engine made for the same listener: the listener's queue
    goes over with them, so the later segment is no needy prompt and its step leaves out no stream."""
    now = [100.0]
    fake = types.SimpleNamespace(monotonic=lambda: now[0])
    monkeypatch.setattr(scheduler_module, "time", fake)
    monkeypatch.setattr(request_module, "time", fake)
    s = lean_scheduler(lean_ms=1000.0)
    speaking(s, "full")
    s.add(spec("seg0", 3, max_length=2))
    step(s)
    s.update_buffered("seg0", 2500.0)
    s.update_buffered("full", 5000.0)
    last = next(q for q in step(s) if q.request.request_id == "seg0")  # its second and last patch
    assert last.request.stop_reason == "length"
    tail = last.request.generated[-1].numpy()[None]
    now[0] += 0.5
    s.update_buffered("full", 5000.0)
    s.add(RequestSpec("seg1", list(range(4)), [0, 0, 0, 1], (P, D), SamplingParams(max_length=5, min_length=0),
                      audio=[(3, tail)], n_context=1))
    seg1 = s.requests["seg1"]
    assert seg1.reported_ms == 2500.0 + 80.0  # the queue as estimated when seg0 ended
    assert {q.request.request_id for q in step(s)} == {"full", "seg1"}  # not needy: nobody sat out
    s.add(RequestSpec("other", list(range(4)), [0, 0, 0, 1], (P, D), SamplingParams(max_length=5, min_length=0),
                      audio=[(3, tail + 1.0)], n_context=1))  # a prompt of audio the engine did not just make
    assert s.requests["other"].reported_ms is None
    # needy: the streams whose listeners have plenty queued sit out ("full", and "seg1" with ~2.2 s)
    assert {q.request.request_id for q in step(s)} == {"other"}


def test_without_listener_reports_lean_steps_change_nothing():
    """A caller that never reports (the engine benchmark, an HTTP stream) gets the same steps either way."""
    picks = []
    for lean in (False, True):
        rng = random.Random(3)
        s = Scheduler(max_num_seqs=6, max_num_batched_tokens=24, num_blocks=40, block_size=4, patch_ms=80.0,
                      sit_out_ms=100.0, max_prefill_tokens_while_speaking=12, split_decodes_above=4,
                      lean_ms=100.0 if lean else 0.0)
        run = []
        for i in range(80):
            if rng.random() < 0.4:
                s.add(spec(f"r{i}", rng.randint(1, 14), max_length=rng.randint(1, 12)))
            run.append(sorted((q.request.request_id, q.start, q.num_tokens) for q in step(s)))
        picks.append(run)
    assert picks[0] == picks[1] and sum(map(len, picks[0])) > 150


def test_the_closed_loop_simulation_serves_every_turn_without_gaps():
    """bench/scheduler_sim.py, small: the real scheduler on simulated time, both policies, every turn finished and
    no listener ever left waiting mid-turn."""
    from bench.scheduler_sim import parse_args, simulate

    args = parse_args(["--users", "40", "--ramp", "1", "--duration", "6", "--segments", "2"])
    for lean_ms in (0.0, 750.0):
        r = simulate(args, lean_ms)
        assert r["turns"] >= 40 and r["server_gap_ms_max"] == 0.0 and r["underrun_turns"] == 0, r
        assert 0 < r["ttfb_ms_p50"] <= r["ttfb_ms_p90"] < 200, r
