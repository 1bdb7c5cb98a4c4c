"""The request builder's fast path (`Tokenizer.encode` on the backend's ids, `prompt_layout` lists, numpy patch runs
and no torch op on the caller's thread, expanded zero patches in the worker, deferred sends) gives exactly what the
reference path (one vocabulary lookup per token string, tensors for every position, as the code before it) gives:
the same token ids and, in the worker, the same prompt tensors, before and after the pickle that carries the
`RequestSpec` to it. `generate` sends a request from the call when it has no audio to encode and its worker is up
(else at the first read); an unread request is still cancelled and freed when closed or dropped."""

from __future__ import annotations

import asyncio
import pickle
import re
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine import guards, ipc
from engine.config import ModelConfig
from engine.errors import InvalidAudio, InvalidRequest, TextTooLong, WorkerCallFailed
from engine.model_configs import tiny
from engine.prompt import AUDIO_START, CONTEXT_PATCHES, REF_AUDIO_END, REF_AUDIO_START, build_prompt, length_cap
from engine.random_checkpoint import write_tokenizer
from engine.request import Request, RequestSpec, SamplingParams
from engine.specs import request_spec, voice_prefix_spec
from engine.text import Tokenizer, normalize_text

TEXTS = [
    "Sure, I can help with that. The quickest way is to restart the router, wait for the lights to settle.",
    "你好，世界！今天天气很好。我们可以说中文", "Mixed 中文 and English 语音合成, ok? 我们可以说中文 again",
    "  odd   spaces\t\tand\ttabs\nnew lines ", "emoji 😀🎉 café naïve ß 日本語のテキスト 한국어",
    "<s>literal</s> <|audio_start|> ▁already marked 3.14", "中文", "a",
]
PROMPT_TEXTS = ["This is the prompt.", "这是提示文本。", "Prompt 中文 mixed "]


@pytest.fixture(scope="module", params=[512, 73448], ids=["tiny-vocab", "release-vocab"])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp(f"tok{request.param}")
    write_tokenizer(d, request.param)
    return Tokenizer.from_dir(d)


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return ModelConfig.from_dict(tiny("voxcpm2"))


def reference_spec(config: ModelConfig, tokenizer: Tokenizer, kv_positions: int, *, text: str,
                   prompt_text: str | None, prompt_patches: torch.Tensor | None, ref_patches: torch.Tensor | None,
                   params: SamplingParams, request_id: str) -> SimpleNamespace:
    """The request builder as it was: the target tokenized twice by the per-token-string lookup, a tensor for
    every position, ids and mask read back element by element; the prompt's tensors as the worker must see them."""
    target = normalize_text(text)
    shape = (config.patch_size, config.feat_dim)
    n_target = len(tokenizer.encode_reference(target))
    text_ids = tokenizer.encode_reference(prompt_text + target if prompt_text is not None else target) + [AUDIO_START]
    ids: list[int] = []
    audio: list[bool] = []
    feats: list[torch.Tensor] = []

    def add_text(tokens: list[int]) -> None:
        ids.extend(tokens)
        audio.extend([False] * len(tokens))
        feats.append(torch.zeros(len(tokens), *shape))

    def add_audio(patches: torch.Tensor) -> None:
        ids.extend([0] * len(patches))
        audio.extend([True] * len(patches))
        feats.append(patches.detach().float().cpu())

    if ref_patches is not None:
        add_text([REF_AUDIO_START])
        add_audio(ref_patches)
        add_text([REF_AUDIO_END])
    add_text(text_ids)
    if prompt_patches is not None:
        add_audio(prompt_patches)
    patches = torch.cat(feats)
    n_context = min(CONTEXT_PATCHES[config.architecture], len(prompt_patches)) if prompt_patches is not None else 0
    token_ids, mask = torch.tensor(ids, dtype=torch.long), torch.tensor(audio, dtype=torch.bool)
    n = len(token_ids)
    cap = min(length_cap(n_target, params.max_length or config.max_length), config.max_length - n, kv_positions - n)
    params.max_length = cap
    return SimpleNamespace(request_id=request_id, token_ids=[int(t) for t in token_ids], patches=patches,
                           audio_mask=[int(m) for m in mask], cond=patches[-1].clone(),
                           context_patches=patches[len(patches) - n_context:], params=params)


def assert_same_spec(a: RequestSpec, b: SimpleNamespace) -> None:
    """`a` (and the worker's tensors of it) is the reference's request `b`."""
    assert a.request_id == b.request_id
    assert a.token_ids == b.token_ids
    assert all(type(t) is int for t in a.token_ids)
    assert a.audio_mask == b.audio_mask
    assert all(type(m) is int for m in a.audio_mask)
    assert all(isinstance(p, np.ndarray) and p.dtype == np.float32 for _, p in a.audio)  # the caller makes no tensor
    worker = Request(a)
    for name in ("patches", "context_patches"):
        x, y = getattr(worker, name), getattr(b, name)
        assert x.dtype == y.dtype == torch.float32 and x.shape == y.shape and torch.equal(x, y), name
    assert torch.equal(worker.prompt_cond, b.cond) and torch.equal(worker.cond, b.cond)
    assert a.params == b.params
    assert (a.voice_id, a.prefix_only, a.lora) == (None, False, None)


def test_encode_matches_the_per_token_lookup(tokenizer):
    for text in TEXTS + PROMPT_TEXTS + [t + u for t in PROMPT_TEXTS for u in TEXTS]:
        for t in (text, normalize_text(text)):
            ids = tokenizer.encode(t)
            assert ids == tokenizer.encode_reference(t), t
            assert all(type(i) is int for i in ids)
    assert tokenizer._rewrite, "the test tokenizer must hold multi-character CJK tokens"
    split = tokenizer.encode("我们可以说中文")
    assert not set(split) & tokenizer._rewrite.keys()  # every CJK word came out as characters


def test_normalize_text_as_the_official_rule():
    # runs mixing spaces and other whitespace, lone non-space whitespace (Unicode too), edges
    for text in TEXTS + ["a\nb\r\n  c\t\td ", "\n\n", "x\u3000y\u00a0z", " \ta\t b \x0b\x1c c\u2028", "\t", " ", ""]:
        assert normalize_text(text) == re.sub(r"\s+", " ", text.replace("\n", " "))


@pytest.mark.parametrize("mode", ["zero-shot", "continuation", "reference", "reference+continuation"])
def test_request_spec_matches_reference(tokenizer, config, mode):
    gen = torch.Generator().manual_seed(0)
    shape = (config.patch_size, config.feat_dim)
    for k, text in enumerate(TEXTS):
        prompt_text = PROMPT_TEXTS[k % len(PROMPT_TEXTS)] if "continuation" in mode else None
        prompt = torch.randn(3 + k, *shape, generator=gen) if prompt_text is not None else None
        ref = torch.randn(5 + k, *shape, generator=gen) if mode.startswith("reference") else None
        for max_length in (0, 7):
            args = dict(text=text, prompt_text=prompt_text, request_id=f"r{k}")
            p = SamplingParams(seed=k, max_length=max_length)
            ours = request_spec(config, tokenizer, 10_000, params=p, voice_id=None, **args,
                                prompt_patches=None if prompt is None else prompt.numpy(),
                                ref_patches=None if ref is None else ref.numpy())
            ref_spec = reference_spec(config, tokenizer, 10_000, params=SamplingParams(seed=k, max_length=max_length),
                                      prompt_patches=prompt, ref_patches=ref, **args)
            assert_same_spec(ours, ref_spec)
            assert_same_spec(pickle.loads(pickle.dumps(ours)), ref_spec)
            # build_prompt (the offline path) agrees with the request builder
            built = build_prompt(config, tokenizer, text, prompt_text=prompt_text, prompt_patches=prompt,
                                 reference_patches=ref)
            assert built.token_ids.tolist() == ours.token_ids
            assert torch.equal(built.patches, ref_spec.patches) and torch.equal(built.cond, ref_spec.cond)
            assert torch.equal(built.context_patches, ref_spec.context_patches)


def test_text_only_patches_allocate_nothing_on_either_side(tokenizer, config):
    spec = request_spec(config, tokenizer, 10_000, text=TEXTS[0], prompt_text=None, prompt_patches=None,
                        ref_patches=None, params=SamplingParams(), request_id="r", voice_id=None)
    assert spec.audio == [] and spec.n_context == 0  # no patches travel
    # the worker's patches are a view of one zero (a burst of 64 fresh zero tensors cost the worker milliseconds of
    # page faults before the burst's first step) that reads like zeros of the shape and cannot be written through
    req = Request(pickle.loads(pickle.dumps(spec)))
    shape = (spec.prompt_len, config.patch_size, config.feat_dim)
    assert req.patches.shape == shape and req.patches.stride() == (0, 0, 0)
    assert torch.equal(req.patches, torch.zeros(shape)) and torch.equal(req.cond, torch.zeros(shape[1:]))
    with pytest.raises(RuntimeError):
        req.patches[0] += 1
    # what the worker reads them through: a prompt's positions, then past its end
    n, patch = req.spec.prompt_len, torch.ones(*shape[1:])
    req.generated.append(patch)
    _, patches, _ = req.inputs(n - 2, n + 1)
    assert torch.equal(patches, torch.cat((torch.zeros(2, *patch.shape), patch[None])))


def test_voice_prefix_spec_matches_reference(tokenizer, config):
    ref = torch.randn(6, config.patch_size, config.feat_dim, generator=torch.Generator().manual_seed(1))
    ours = voice_prefix_spec(config, tokenizer, 10_000, "v", ref.numpy())
    full = reference_spec(config, tokenizer, 10_000, text="a", prompt_text=None, prompt_patches=None,
                          ref_patches=ref, params=SamplingParams(), request_id="x")
    n = len(ref) + 2
    assert ours.token_ids == full.token_ids[:n] and ours.audio_mask == full.audio_mask[:n]
    assert torch.equal(Request(ours).patches, full.patches[:n]) and ours.prefix_only
    back = Request(pickle.loads(pickle.dumps(ours)))
    assert torch.equal(back.patches, full.patches[:n]) and len(back.context_patches) == 0
    with pytest.raises(TextTooLong):
        voice_prefix_spec(config, tokenizer, n - 1, "v", ref.numpy())


def test_new_request_ids_are_unique_hex_and_skip_ids_in_flight():
    ids = [guards.request_id_or_new(None, {}) for _ in range(1000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    # a caller-chosen id that happens to be the next fresh one is skipped, not reused
    taken = guards.new_request_id()
    nxt = f"{taken[:16]}{int(taken[16:], 16) + 1:016x}"
    assert guards.request_id_or_new(None, {nxt: object()}) != nxt
    assert guards.request_id_or_new("mine", {}) == "mine"


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.timeout(60)
async def test_a_burst_reaches_the_worker_together_and_in_order(engine):
    """A burst of `generate` calls in one event-loop pass is sent after the pass, every request of it at once; a
    cancel posted in the same pass follows its request's add, so the worker frees what it just admitted."""
    worker = engine._workers[0]
    started: list[str] = []
    sent: list[tuple[str, str, int]] = []  # (kind, request id, requests started when it was sent)
    send = worker.send

    def spy(msg: ipc.Command) -> None:
        rid = msg.spec.request_id if isinstance(msg, ipc.Add) else msg.request_id if isinstance(msg, ipc.Cancel) \
            else ""
        sent.append((type(msg).__name__, rid, len(started)))
        send(msg)

    async def one(i: int) -> list:
        gen = engine.generate("Hello there, how are you?", seed=i, max_length=3, min_length=3)
        started.append(gen.request_id)
        return [c async for c in gen]

    worker.send = spy
    try:
        results = await asyncio.gather(*(one(i) for i in range(6)))
        assert all(len(r) == 3 and r[-1].is_last for r in results)
        adds = [s for s in sent if s[0] == "Add"]
        assert sorted(s[1] for s in adds) == sorted(started)
        assert all(s[2] == 6 for s in adds)  # none left before every request of the burst was built

        sent.clear()
        gen = engine.generate("Cancel me right away.", seed=99, max_length=20, min_length=20)
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)  # the request's add is posted, not yet sent
        await engine.cancel(gen.request_id)
        with pytest.raises(StopAsyncIteration):
            await first
        await asyncio.sleep(0)
        assert [s[:2] for s in sent] == [("Add", gen.request_id), ("Cancel", gen.request_id)]
    finally:
        worker.send = send
    for _ in range(200):  # the worker reports the cancelled request gone
        if not worker.stats.get("running") and not worker.stats.get("waiting"):
            break
        await asyncio.sleep(0.02)
    assert not worker.stats.get("running") and not worker.stats.get("waiting")
    assert engine.stats().in_flight == 0


class CountTorchOps(TorchFunctionMode):
    """Counts the torch functions and tensor methods called on the thread that entered it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.calls.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.timeout(60)
async def test_generate_makes_no_torch_op_on_the_callers_thread(engine):
    """`generate` checks and builds a request on the caller's thread (a gateway's event loop) without a torch op:
    each drops the GIL and waits to take it back behind the loop's other threads. The spec carries numpy arrays; the
    worker makes the tensors. Plain, continuation (a gateway turn's later segments), reference and stored-voice
    requests, and the chunks they give are served as usual."""
    c = engine.config
    rng = np.random.default_rng(0)
    tail = rng.standard_normal((3, c.patch_size, c.feat_dim)).astype(np.float32)
    ref = rng.standard_normal((5, c.patch_size, c.feat_dim)).astype(np.float32)
    voice = await engine.add_voice(latents=ref)
    kinds = {"plain": {}, "instruction": {"instruction": "calm"},
             "continuation": {"prompt_latents": tail, "prompt_text": "Before."},
             "float64 continuation": {"prompt_latents": tail.astype(np.float64), "prompt_text": "Before."},
             "reference": {"reference_latents": ref},
             "voice + continuation": {"voice": voice, "prompt_latents": tail, "prompt_text": "Before."}}
    worker = engine._workers[0]
    sent: list[ipc.Add] = []
    send = worker.send
    worker.send = lambda msg: (sent.append(msg) if isinstance(msg, ipc.Add) else None, send(msg))
    try:
        for name, kwargs in kinds.items():
            sent.clear()
            with CountTorchOps() as ops:
                gen = engine.generate("Spoken after it.", seed=1, max_length=2, min_length=2, **kwargs)
            assert ops.calls == [], name
            chunks = [chunk async for chunk in gen]
            assert len(chunks) == 2 and chunks[-1].is_last, name
            assert all(isinstance(p, np.ndarray) for _, p in sent[0].spec.audio), name
        run = sent[0].spec.audio[-1][1]
        assert np.array_equal(run, tail) and not np.shares_memory(run, tail)  # the tail as it was at the call
        assert sent[0].spec.n_context == len(tail)  # it primes the VAE stream

        # the caller may reuse its array once `generate` returns: the request still has what it was given
        sent.clear()
        mine = tail.copy()
        gen = engine.generate("Spoken after it.", seed=1, max_length=2, min_length=2, prompt_latents=mine,
                              prompt_text="Before.")
        mine[:] = np.nan  # before the request leaves (at the end of this pass of the event loop)
        assert len([chunk async for chunk in gen]) == 2
        assert np.array_equal(sent[0].spec.audio[-1][1], tail)
    finally:
        worker.send = send
        await engine.remove_voice(voice)


async def _until(done: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def _idle(engine: Any) -> bool:
    s = engine.stats()
    return (s.running, s.waiting, s.in_flight) == (0, 0, 0) and s.free_blocks == s.total_blocks - s.voice_blocks


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.timeout(60)
async def test_generate_sends_the_request_before_any_read(engine):
    """With nothing to encode and the worker up, the request is under way from `generate`: it runs to its end with
    nobody reading, its chunks waiting for the reader."""
    gen = engine.generate("Sent without being read.", seed=5, max_length=3, min_length=3)
    await _until(lambda: engine.stats().in_flight == 0)  # the pool forgets a request after its last chunk
    assert engine.stats().in_flight == 0 and not engine._workers[0].in_flight
    chunks = [c async for c in gen]
    assert [c.index for c in chunks] == [0, 1, 2] and chunks[-1].is_last


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.timeout(60)
async def test_an_unread_generation_closed_or_dropped_is_cancelled(engine):
    worker = engine._workers[0]
    for how in ("closed", "dropped"):
        gen = engine.generate("Long enough to be running still.", seed=6, max_length=400, min_length=400)
        await _until(lambda: worker.stats.get("running") == 1)
        assert worker.stats.get("running") == 1, how
        if how == "closed":
            await gen.aclose()
            assert engine.stats().in_flight == 0 and not worker.in_flight  # the pool lets go at once
            assert [c async for c in gen] == []
        else:
            del gen  # its finalizer cancels it (on the loop's next pass)
        await _until(lambda: _idle(engine))
        assert _idle(engine), (how, engine.stats())


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.timeout(60)
async def test_closing_a_finished_generation_spares_a_later_request_with_its_id(engine):
    old = engine.generate("Short.", seed=7, max_length=2, min_length=2, request_id="reused")
    await _until(lambda: _idle(engine))  # it ran to its end unread; the pool forgot it
    new = engine.generate("Longer, still running.", seed=8, max_length=400, min_length=400, request_id="reused")
    await old.aclose()  # late: must not cancel the request now holding the id
    first = await new.__anext__()
    assert first.audio.size and engine.stats().in_flight == 1
    await new.aclose()
    await _until(lambda: _idle(engine))
    assert _idle(engine)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.timeout(60)
async def test_prompt_audio_or_a_worker_not_up_is_sent_at_the_first_read(engine):
    worker = engine._workers[0]
    sent: list[str] = []
    send = worker.send
    worker.send = lambda msg: (sent.append(type(msg).__name__), send(msg))
    try:
        audio = np.random.default_rng(0).standard_normal(8000).astype(np.float32) * 0.1
        gen = engine.generate("After the prompt.", prompt_audio=audio, prompt_sample_rate=16000,
                              prompt_text="A prompt.", seed=1, max_length=2, min_length=2)
        await asyncio.sleep(0.1)
        assert sent == []  # neither the audio to encode nor the request
        assert len([c async for c in gen]) == 2
        assert sent == ["Encode", "Add"]

        sent.clear()
        worker.ready.clear()  # as while it loads
        gen = engine.generate("Once the worker is up.", seed=2, max_length=2, min_length=2)
        await asyncio.sleep(0.1)
        assert sent == []
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.1)
        assert sent == []  # the first read waits for the worker
        worker.ready.set()
        assert (await first).index == 0 and len([c async for c in gen]) == 1
        assert sent == ["Add"]
    finally:
        worker.send = send
        worker.ready.set()


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.timeout(120)
async def test_unread_generations_of_an_adapter_let_it_drain(tiny_v2_dir, config):
    """An adapter's users are requests in flight, read or not: one closed unread and one that ran to its end unread
    both leave it, so unregistering it does not wait for a reader."""
    from engine import Engine
    from engine.lora import lora_layout

    gen_t = torch.Generator().manual_seed(0)
    tensors = {}
    for path, (fan_in, fan_out) in lora_layout(config).items():
        tensors[f"{path}.lora_A"] = torch.randn(4, fan_in, generator=gen_t)
        tensors[f"{path}.lora_B"] = torch.randn(fan_out, 4, generator=gen_t) / 3
    eng = Engine(str(tiny_v2_dir), max_num_seqs=2, num_kv_blocks=32, block_size=4, max_num_batched_tokens=32,
                 inference_timesteps=2, max_loras=1, max_lora_rank=4)
    try:
        await eng.wait_for_ready()
        await eng.register_lora("a", tensors, {"r": 4, "alpha": 8.0})
        closed = eng.generate("Closed before it is read.", lora="a", seed=1, max_length=200, min_length=200)
        ran = eng.generate("Runs to its end unread.", lora="a", seed=2, max_length=2, min_length=2)
        assert eng.list_loras()[0].in_flight == 2
        await closed.aclose()
        assert eng.list_loras()[0].in_flight == 1
        await asyncio.wait_for(eng.unregister_lora("a"), 30)
        assert eng.list_loras() == [] and len([c async for c in ran]) == 2
        await _until(lambda: _idle(eng))
        assert _idle(eng)
    finally:
        await eng.stop()


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.timeout(60)
async def test_a_failed_worker_call_is_typed_by_its_cause(engine):
    """An encode the worker cannot do is the audio's fault (`InvalidAudio`); any other failed call is the worker's
    (`WorkerCallFailed`: an engine error, not a bad request), and the worker keeps serving."""
    worker = engine._workers[0]
    with pytest.raises(WorkerCallFailed, match="no LoRA slots") as failed:
        await worker.call(ipc.AddLoRA, None)
    assert not isinstance(failed.value, InvalidRequest)
    with pytest.raises(InvalidAudio):
        await worker.call(ipc.Encode, np.zeros(0, np.float32), "left")
    chunks = [c async for c in engine.generate("Still serving.", seed=3, max_length=2, min_length=2)]
    assert len(chunks) == 2 and chunks[-1].is_last
