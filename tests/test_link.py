"""The engine served to gateway fronts (`gateway.link`): one host and two front links in this process, over a real
unix socket, with the real tiny engine behind them."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch

from engine.errors import EngineOverloaded, InvalidParameter, TenantOverloaded, UnknownLoRA, UnknownVoice
from gateway.link import EngineHost, HostLost, connect, wire
from gateway.link.remote_engine import ChunkQueue, RemoteEngine, RemoteStream
from gateway.store import Item, LocalStore

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(tiny_v2_dir, tmp_path_factory):
    """(engine, host, front 1, front 2): an engine with small limits, so overload is reachable."""
    from engine import Engine

    eng = Engine(str(tiny_v2_dir), max_num_seqs=4, max_waiting=2, max_queued_per_tenant=2, inference_timesteps=4,
                 max_loras=1)
    await eng.wait_for_ready()
    path = tmp_path_factory.mktemp("link") / "host.sock"
    host = EngineHost(eng, LocalStore(), path)
    await host.start()
    one, two = await connect(path, 1), await connect(path, 2)
    yield eng, host, one, two
    await one.close()
    await two.close()
    await host.close()
    await eng.stop()


async def settled(eng, timeout_s: float = 5.0) -> None:
    """Wait until the engine holds no request and no tenant count."""
    deadline = time.monotonic() + timeout_s
    while eng.stats().in_flight or eng.queued_prompts.counts:
        assert time.monotonic() < deadline, (eng.stats(), eng.queued_prompts.counts)
        await asyncio.sleep(0.02)


def same_audio(got: np.ndarray, want: np.ndarray) -> None:
    """Equal up to float rounding: once the worker has run a batch of several requests, a lone request's audio may
    differ from an earlier lone run by ~2e-6 (engine state, not the link: the same happens with no link)."""
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


async def chunks_of(stream) -> list:
    return [c async for c in stream]


async def audio_of(stream) -> np.ndarray:
    return np.concatenate([c.audio async for c in stream])


async def test_same_seed_same_audio_as_the_engine_and_the_asked_ids(served):
    eng, host, one, two = served
    assert host.fronts() == 2
    assert isinstance(one.engine, RemoteEngine) and one.store.shared
    direct = await audio_of(eng.generate("Hello there, link.", seed=11, max_length=6))
    alone = one.engine.generate("Hello there, link.", seed=11, max_length=6)
    # the engine's first requests, one at a time: bit for bit
    np.testing.assert_array_equal(await audio_of(alone), direct)
    # both fronts use the same request id at once: the host keeps them apart, each sees the id it asked for (batched
    # together, their float sums may round differently from one alone)
    s1 = one.engine.generate("Hello there, link.", seed=11, max_length=6, request_id="same")
    s2 = two.engine.generate("Hello there, link.", seed=11, max_length=6, request_id="same")
    c1, c2 = await asyncio.gather(chunks_of(s1), chunks_of(s2))
    assert {c.request_id for c in c1 + c2} == {"same"}
    np.testing.assert_allclose(np.concatenate([c.audio for c in c1]), direct, atol=1e-4)
    np.testing.assert_allclose(np.concatenate([c.audio for c in c2]), direct, atol=1e-4)
    assert s1.link_ms is not None and s1.link_ms >= 0
    assert one.engine.model_info() == eng.model_info()
    await settled(eng)


async def test_prompt_audio_is_encoded_by_the_host_and_speaks_the_same(served):
    eng, _, one, _ = served
    t = np.arange(8000) / 16000
    audio = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    kwargs = dict(prompt_audio=audio, prompt_sample_rate=16000, prompt_text="A prompt.", seed=4, max_length=4)
    direct = await audio_of(eng.generate("Continue from the prompt.", **kwargs))
    remote = await audio_of(one.engine.generate("Continue from the prompt.", **kwargs))
    same_audio(remote, direct)
    await settled(eng)


async def test_input_errors_raise_at_the_call_like_the_engine(served):
    eng, _, one, _ = served
    for kwargs, error in [(dict(cfg_value=float("nan")), InvalidParameter), (dict(voice="nope"), UnknownVoice),
                          (dict(lora="nope"), UnknownLoRA), (dict(timesteps=99), InvalidParameter)]:
        with pytest.raises(error) as remote:
            one.engine.generate("Hi.", **kwargs)
        with pytest.raises(error) as local:
            eng.generate("Hi.", **kwargs)
        assert str(remote.value) == str(local.value)
    with pytest.raises(InvalidParameter):
        one.engine.update_buffered("x", float("inf"))


async def test_cancel_and_close_free_the_request_at_the_host(served):
    eng, _, one, two = served
    stream = one.engine.generate("A long one to cancel.", seed=1, min_length=400, max_length=500, tenant="k")
    await anext(stream)
    assert eng.stats().in_flight == 1
    await stream.aclose()
    await settled(eng)
    stream = two.engine.generate("Another long one.", seed=2, min_length=400, max_length=500, request_id="c")
    await anext(stream)
    reports: list[tuple[str, float]] = []
    real = eng.update_buffered
    eng.update_buffered = lambda rid, ms: (reports.append((rid, ms)), real(rid, ms))  # the host's call, recorded
    try:
        two.engine.update_buffered("c", 1500.0)  # the listener's playout reaches the pool's scheduler hint
        two.engine.update_buffered("not-mine", 10.0)  # not in flight: dropped, as by the engine
        while not reports:
            await asyncio.sleep(0.01)
    finally:
        del eng.update_buffered
    assert len(reports) == 1 and reports[0][0].endswith("/c") and reports[0][1] == 1500.0
    await two.engine.cancel("c")
    rest = [c async for c in stream]  # what had arrived before the cancel, then the end (as with the engine)
    assert not any(c.is_last for c in rest)
    await settled(eng)


async def test_a_dropped_front_frees_everything_it_held(served):
    eng, host, _, _ = served
    third = await connect(host.path, 3)
    streams = [third.engine.generate("Held by a front that goes.", seed=i, min_length=400, max_length=500,
                                     tenant="t") for i in range(2)]
    for s in streams:
        await anext(s)
    assert eng.stats().in_flight == 2
    await third.close()
    await settled(eng)
    assert host.fronts() == 2
    with pytest.raises(HostLost):
        await anext(streams[0])


async def test_overload_and_tenant_limits_come_back_typed(served):
    eng, _, one, two = served
    # the tenant's limit of prompts waiting for audio, and one more: one front's frame, so they reach the host in
    # this order before any of them can have audio
    held = [one.engine.generate("Queued prompt.", seed=i, min_length=400, max_length=500, tenant="key")
            for i in range(2)]
    over = one.engine.generate("One too many.", tenant="key")
    with pytest.raises(TenantOverloaded):
        await anext(over)
    for s in held:
        await s.aclose()
    await settled(eng)
    held = [one.engine.generate("Filling the engine.", seed=i, min_length=400, max_length=500) for i in range(6)]
    while eng.stats().in_flight < 6:  # admitted at the host (they speak for a while)
        await asyncio.sleep(0.01)
    over = two.engine.generate("No room.")
    with pytest.raises(EngineOverloaded):
        await anext(over)
    for s in held:
        await s.aclose()
    await settled(eng)


async def test_voices_across_fronts_and_idempotent_adds(served):
    eng, _, one, two = served
    latents = np.random.default_rng(3).standard_normal((3, eng.config.patch_size, eng.config.feat_dim))
    latents = latents.astype(np.float32)
    revision = eng.revision
    # both fronts load the same stored voice at once: no failure, stored once
    ids = await asyncio.gather(one.engine.add_voice(voice_id="v1", latents=latents),
                               two.engine.add_voice(voice_id="v1", latents=latents))
    assert ids == ["v1", "v1"] and eng.revision == revision + 1
    assert [v.voice_id for v in two.engine.list_voices()] == [v.voice_id for v in eng.list_voices()]
    np.testing.assert_array_equal(two.engine.voice_latents("v1"), eng.voice_latents("v1"))
    direct = await audio_of(eng.generate("Spoken in a stored voice.", voice="v1", seed=5, max_length=5))
    remote = await audio_of(two.engine.generate("Spoken in a stored voice.", voice="v1", seed=5, max_length=5))
    same_audio(remote, direct)
    await one.engine.remove_voice("v1")
    with pytest.raises(UnknownVoice):
        two.engine.generate("Gone.", voice="v1")  # the removal reached front 2 before front 1's call returned
    await settled(eng)


def adapter(config) -> dict[str, torch.Tensor]:
    from engine.lora import lora_layout

    path = "base_lm.layers.0.self_attn.q_proj"
    fan_in, fan_out = lora_layout(config)[path]
    g = torch.Generator().manual_seed(0)
    return {f"{path}.lora_A": torch.randn(4, fan_in, generator=g),
            f"{path}.lora_B": torch.randn(fan_out, 4, generator=g)}


async def test_adapters_across_fronts_idempotent_and_freed_with_a_front(served):
    eng, host, one, two = served
    tensors, config = adapter(eng.config), {"r": 4, "alpha": 8}
    infos = await asyncio.gather(one.engine.register_lora("ad", tensors, config),
                                 two.engine.register_lora("ad", tensors, config))
    assert infos[0] == infos[1] and [i.name for i in eng.list_loras()] == ["ad"]
    assert [i.name for i in two.engine.list_loras()] == ["ad"]
    third = await connect(host.path, 3)
    stream = third.engine.generate("With an adapter.", lora="ad", seed=3, min_length=400, max_length=500)
    await anext(stream)
    assert eng.list_loras()[0].in_flight == 1
    await third.close()
    await settled(eng)
    assert eng.list_loras()[0].in_flight == 0
    await eng.unregister_lora("ad")  # at the host: a front may still think it is there
    with pytest.raises(UnknownLoRA):
        await anext(two.engine.generate("Too late.", lora="ad"))
    two.engine._lora_names.add("ad")  # the race for certain: the front's check passes, the host's refuses
    raced = two.engine.generate("Raced.", lora="ad")
    with pytest.raises(UnknownLoRA):
        await anext(raced)
    await settled(eng)


async def test_store_ops_are_one_store_across_fronts(served):
    _, _, one, two = served
    await one.store.put(Item("voice", "x1", "alice", meta={"mode": "reference"}), {"latents": b"\x01\x02"})
    assert (await two.store.get("voice", "x1")).owner == "alice"
    assert await two.store.blobs("voice", "x1") == {"latents": b"\x01\x02"}
    await one.store.add_token("tok", "key-1", 30.0)
    assert await asyncio.gather(one.store.take_token("tok"), two.store.take_token("tok")) in (
        ["key-1", None], [None, "key-1"])
    won = await asyncio.gather(*(s.reserve_lease("bob", f"lease-{i}", 1, 30.0)
                                 for i, s in enumerate([one.store, two.store] * 3)))
    assert sorted(won) == [False] * 5 + [True]
    assert await two.store.delete("voice", "x1") and await one.store.get("voice", "x1") is None
    with pytest.raises(InvalidParameter, match="cannot send put"):  # fails alone; the link carries on
        await one.store.put(Item("voice", "x2", "", meta={"bad": lambda: 0}), {})
    assert await one.store.get("voice", "x2") is None


async def test_a_front_that_reads_nothing_is_cut(served, monkeypatch):
    from gateway.link import host as host_module
    from gateway.link import wire

    _, host, one, _ = served
    monkeypatch.setattr(host_module, "STALL_S", 0.3)
    await one.store.put(Item("voice", "big", ""), {"blob": bytes(8 << 20)})
    reader, writer = await asyncio.open_unix_connection(host.path)  # a "front" that never reads what it asked for
    writer.write(wire.frame([wire.Hello(7, 0), wire.Call(1, "store", "blobs", ("voice", "big"), {})],
                            time.monotonic()))
    await writer.drain()

    async def fronts_become(n: int) -> None:
        deadline = time.monotonic() + 10
        while host.fronts() != n:
            assert time.monotonic() < deadline, host.fronts()
            await asyncio.sleep(0.05)

    await fronts_become(3)
    await fronts_become(2)  # cut; the healthy fronts carry on
    writer.close()
    assert await one.store.delete("voice", "big")


async def test_link_latency_per_request_and_first_chunk(served):
    """The link's share of the time to first audio (front -> host request, host -> front first chunk), on requests
    one at a time and in bursts over both fronts; printed for the report, bounded loosely (a 2-core shared machine)."""
    eng, _, one, two = served
    alone, burst = [], []
    for i in range(10):
        stream = one.engine.generate("Timing the link.", seed=i, max_length=2)
        await chunks_of(stream)
        alone.append(stream.link_parts_ms)
    for i in range(5):
        streams = [f.engine.generate("Timing a burst.", seed=i * 4 + j, max_length=2)
                   for j, f in enumerate([one, two, one, two])]
        await asyncio.gather(*map(chunks_of, streams))
        burst += [s.link_parts_ms for s in streams]
    for name, parts in (("alone", alone), ("burst of 4", burst)):
        request, chunk = (statistics.median(p[k] for p in parts) for k in (0, 1))
        print(f"\nlink, {name}: request front->host median {request:.3f} ms, first chunk host->front median "
              f"{chunk:.3f} ms")
        assert 0 <= request < 50 and 0 <= chunk < 50
    await settled(eng)


async def test_host_closing_fails_open_streams_typed_and_calls_on_lost(tiny_v2_dir, tmp_path, served):
    eng = served[0]
    host = EngineHost(eng, LocalStore(), tmp_path / "other.sock")
    await host.start()
    lost = asyncio.Event()
    front = await connect(Path(host.path), 9, on_lost=lost.set)
    stream = front.engine.generate("Cut off by the host.", seed=1, min_length=400, max_length=500)
    await anext(stream)
    await host.close()
    with pytest.raises(HostLost):
        while True:
            await anext(stream)
    await asyncio.wait_for(lost.wait(), 5.0)
    assert front.engine.health()["status"] == "stopped"
    with pytest.raises(HostLost):
        front.engine.generate("After.")
    await settled(eng)


async def test_a_steps_first_chunks_wake_their_turns_before_the_others(served):
    """A step that brings some requests their first chunk and others a later one hands the first chunks over first
    (their turns' first frames are the urgent work), each request's own chunks in order."""
    _, _, one, _ = served
    remote = one.engine
    woke: list[tuple[str, int]] = []
    streams = {rid: RemoteStream(rid) for rid in ("old1", "new1", "old2", "new2")}

    async def reader(rid: str) -> None:
        while (chunk := await streams[rid].queue.get()) is not None:
            woke.append((rid, chunk.index))
            if chunk.is_last:
                return

    remote._streams.update(streams)
    try:
        tasks = [asyncio.create_task(reader(rid)) for rid in streams]
        await asyncio.sleep(0)  # every reader waits on its queue
        audio = np.zeros(8, np.float32)
        rows = [("old1", audio, 3, None, False, None, 9, None), ("new1", audio, 0, None, False, None, 9, None),
                ("old2", audio, 5, None, True, "stop", 9, None), ("new2", audio, 0, None, False, None, 9, None),
                ("new2", audio, 1, None, True, "stop", 9, None), ("new1", audio, 1, None, True, "stop", 9, None),
                ("old1", audio, 4, None, True, "stop", 9, None)]
        remote.on_chunks(wire.pack_chunks(rows))
        await asyncio.wait_for(asyncio.gather(*tasks), 2.0)
        assert list(dict.fromkeys(rid for rid, _ in woke)) == ["new1", "new2", "old1", "old2"]  # the order they woke
        for rid in streams:  # each request's chunks in their order
            mine = [i for r, i in woke if r == rid]
            assert mine == sorted(mine) and len(mine) == (1 if rid == "old2" else 2)
    finally:
        for rid in streams:
            remote._streams.pop(rid, None)


async def test_a_streams_queue_hands_chunks_over_in_order_and_survives_a_cancelled_reader():
    """`ChunkQueue`, what a front's request reads its chunks from: items that came first are read at once and in order,
    one that comes while the reader waits wakes it, and a reader cancelled while waiting loses nothing after it."""
    queue = ChunkQueue()
    queue.put_nowait(1)
    queue.put_nowait(2)
    assert [await queue.get(), await queue.get()] == [1, 2]
    waiting = asyncio.ensure_future(queue.get())
    await asyncio.sleep(0)
    assert not waiting.done()
    waiting.cancel()
    queue.put_nowait(3)  # after the reader's cancel: kept for the next read
    reader = asyncio.create_task(_read(queue))
    await asyncio.sleep(0)
    queue.put_nowait(None)
    assert await asyncio.wait_for(reader, 2.0) == 3
    assert await asyncio.wait_for(queue.get(), 2.0) is None
    assert queue.empty()


async def _read(queue: ChunkQueue) -> object:
    return await queue.get()
