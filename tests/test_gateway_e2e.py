"""End to end: a real aiohttp server on a random port, the real websockets client, the real tiny engine."""

import asyncio
import time

import numpy as np
import opuslib
import pytest
import pytest_asyncio

from gateway.audio import alaw_decode, mulaw_decode
from gateway.client import VoxgateClient
from gateway.protocol import AudioFrame
from gateway.server import ServerConfig, create_app, start_server
from gateway.session import SessionConfig

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

SEED = 1234
TEXT = "Hello there."


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def url(engine):
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None)))
    yield f"ws://127.0.0.1:{port}/v1/stream"
    await runner.cleanup()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def reference(engine) -> np.ndarray:
    """The engine's own audio for TEXT and SEED: what the gateway must deliver."""
    return await _engine_audio(engine, TEXT, SEED)


async def _engine_audio(engine, text: str, seed: int) -> np.ndarray:
    return np.concatenate([c.audio async for c in engine.generate(text, seed=seed)])


async def _wait_idle(engine, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = engine.stats()
        if s.in_flight == 0 and s.running == 0 and s.waiting == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"engine still busy: {engine.stats()}")


async def _session(url: str, **start) -> VoxgateClient:
    client = await VoxgateClient.connect(url)
    start.setdefault("generation", {"seed": SEED})
    await client.start(**start)
    return client


async def _first_audio(c: VoxgateClient) -> AudioFrame:
    while not isinstance(event := await c.recv(10), AudioFrame):
        assert event["type"] != "error", event
    return event


def _pcm(payloads: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(payloads), dtype="<i2").astype(np.float32) / 32767.0


async def test_incremental_text_to_opus_decodes_to_the_engines_audio(url, reference):
    async with await _session(url, output={"format": "opus", "bitrate": 128000}) as c:
        for piece in ("Hel", "lo th", "ere."):  # streamed in pieces, as an LLM would
            await c.append(piece, "t")
        await c.end("t")
        utt = await c.collect("t")
    decoder = opuslib.Decoder(48000, 1)
    decoded = np.concatenate([np.frombuffer(decoder.decode(f.payload, 960), dtype="<i2") for f in utt.frames])
    decoded = decoded.astype(np.float32) / 32767.0
    lookahead = 312  # Opus encoder delay at 48 kHz
    got = decoded[lookahead:lookahead + len(reference)]
    assert len(got) == len(reference)
    corr = float(np.dot(got, reference) / (np.linalg.norm(got) * np.linalg.norm(reference) + 1e-12))
    assert corr > 0.9, f"decoded Opus does not match the engine's audio (correlation {corr:.3f})"
    assert [f.seq for f in utt.frames] == list(range(len(utt.frames)))
    assert [f.pts_ms for f in utt.frames] == [20 * i for i in range(len(utt.frames))]
    assert utt.frames[-1].flags & 1 and not any(f.flags & 1 for f in utt.frames[:-1])
    assert utt.done["audio_ms"] == 20 * len(utt.frames)
    metrics = utt.done["metrics"]
    assert metrics["ttfb_ms"] > 0 and metrics["engine_ttfb_ms"] > 0 and metrics["rtf"] > 0


async def test_pcm_is_the_engines_audio_to_the_sample(url, reference):
    async with await _session(url, output={"format": "pcm_s16le", "sample_rate": 48000}) as c:
        utt = await c.speak(TEXT, "t")
    got = _pcm(utt.payloads)
    assert len(got) >= len(reference) and len(got) - len(reference) < 960  # the last frame is padded
    assert np.max(np.abs(got[:len(reference)] - np.clip(reference, -1, 1))) < 2 / 32767
    assert np.all(got[len(reference):] == 0)


@pytest.mark.parametrize("output, rate, decode", [
    ({"format": "pcm_s16le"}, 24000, lambda b: len(b) // 2),
    ({"format": "pcm_s16le", "sample_rate": 16000}, 16000, lambda b: len(b) // 2),
    ({"format": "mulaw"}, 8000, lambda b: len(mulaw_decode(b))),
    ({"format": "alaw"}, 8000, lambda b: len(alaw_decode(b))),
    ({"format": "opus", "sample_rate": 24000, "frame_ms": 40}, 24000,
     lambda b: len(opuslib.Decoder(24000, 1).decode(b, 960)) // 2),
    # 96 kB frames: the WebSocket header's 64-bit length form
    ({"format": "pcm_s16le", "sample_rate": 48000, "frame_ms": 1000}, 48000, lambda b: len(b) // 2),
])
async def test_every_output_format_decodes_to_the_right_rate_and_length(url, reference, output, rate, decode):
    async with await _session(url, output=output) as c:
        assert c.session["output"]["sample_rate"] == rate
        utt = await c.speak(TEXT, "t")
    samples = sum(decode(p) for p in utt.payloads)
    expected = len(reference) * rate / 48000
    frame = rate * c.session["output"]["frame_ms"] // 1000
    assert expected <= samples <= expected + frame + 312 * rate // 48000 + 1
    assert utt.done["audio_ms"] == pytest.approx(samples * 1000 / rate)


async def test_flush_speaks_buffered_text_and_is_acknowledged(url):
    async with await _session(url, output={"format": "pcm_s16le"}) as c:
        await c.append("no boundary here yet", "t")
        await c.flush("t", "f1")
        flushed = await c.expect("text.flushed")
        assert flushed["flush_id"] == "f1" and flushed["audio_ms"] > 0
        await c.append("And more.", "t")
        await c.end("t")
        utt = await c.collect("t")
    segments = [e["text"] for e in utt.events if e["type"] == "segment.started"]
    assert segments == ["And more."]  # the flushed segment was announced before text.flushed
    assert utt.done["audio_ms"] > flushed["audio_ms"]


async def test_multi_segment_turn_is_one_continuous_stream(url):
    text = "The first clause is here, and then a second sentence follows. A third one ends it."
    async with await _session(url, output={"format": "pcm_s16le"}) as c:
        utt = await c.speak(text, "t")
    segments = [e for e in utt.events if e["type"] == "segment.started"]
    assert len(segments) >= 2
    assert " ".join(s["text"] for s in segments) == text
    assert [s["segment"] for s in segments] == list(range(len(segments)))
    assert all(a["pts_ms"] < b["pts_ms"] for a, b in zip(segments, segments[1:], strict=False))
    assert [f.seq for f in utt.frames] == list(range(len(utt.frames)))  # one stream, no restarts


async def test_turns_one_after_another_in_one_session(url):
    async with await _session(url, output={"format": "pcm_s16le"}) as c:
        first = await c.speak("One turn.", "a")
        second = await c.speak("Another turn.", "b")
        third = await c.speak("And the first id again.", "a")  # a finished context id may be reused
    indexes = {u.frames[0].index for u in (first, second, third)}
    assert len(indexes) == 3  # every turn gets its own frame index
    assert all(u.done["audio_ms"] > 0 for u in (first, second, third))


async def test_concurrent_contexts_interleave_and_all_finish(url):
    async with await _session(url, output={"format": "pcm_s16le"}) as c:
        for cid in ("x", "y", "z"):
            await c.append(f"Context {cid} speaks now.", cid)
        for cid in ("x", "y", "z"):
            await c.end(cid)
        frames: dict[str, int] = {}
        done: set[str] = set()
        while len(done) < 3:
            event = await c.recv(30)
            if isinstance(event, dict):
                if event["type"] == "context.done":
                    done.add(event["context_id"])
                assert event["type"] != "error", event
            else:
                cid = c.indexes[event.index]
                frames[cid] = frames.get(cid, 0) + 1
    assert set(frames) == {"x", "y", "z"} and all(n > 0 for n in frames.values())


async def test_cancel_stops_audio_and_reports_what_was_heard(url, engine):
    async with await _session(url, output={"format": "pcm_s16le"}) as c:
        await c.append("This turn will be interrupted before it ends, because the listener barges in. "
                       "It goes on and on with more words than anyone wants to hear.", "t")
        await _first_audio(c)
        await c.position("t", 100)
        await c.cancel("t")
        report = await c.expect("context.cancelled")
        # nothing for the cancelled turn after the report
        await c.ping("after")
        while (event := await c.recv(5)) != {"type": "pong", "id": "after"}:
            assert not isinstance(event, AudioFrame) or c.indexes[event.index] != "t"
    assert report["context_id"] == "t" and report["played_source"] == "client"
    assert report["audio_played_ms"] >= 100 and report["audio_sent_ms"] >= report["audio_played_ms"]
    assert report["text_remaining"]  # the listener did not hear the end
    assert (report["text_spoken"] + " " + report["text_remaining"]).strip().startswith("This turn")
    await _wait_idle(engine)


async def test_disconnect_mid_turn_cancels_the_engine_request(url, engine):
    c = await _session(url, output={"format": "pcm_s16le"})
    await c.append("A long turn that the client abandons halfway, by dropping the connection without a word. "
                   "More text follows so that the engine is still busy when the socket goes away.", "t")
    await _first_audio(c)
    assert engine.stats().in_flight >= 1
    await c.ws.close()
    await _wait_idle(engine)


async def test_ping_pong_and_unknown_types_are_ignored(url):
    async with await _session(url) as c:
        await c.send({"type": "some.future.message", "x": 1})
        await c.ping(7)
        assert await c.expect("pong") == {"type": "pong", "id": 7}


async def test_pacing_keeps_at_most_max_lead_ahead_of_real_time(engine):
    lead_ms = 300.0
    config = ServerConfig(session=SessionConfig(max_lead_ms=lead_ms), web_client_dir=None)
    runner, port = await start_server(create_app(engine, config))
    try:
        async with await _session(f"ws://127.0.0.1:{port}/v1/stream", output={"format": "pcm_s16le"}) as c:
            await c.append("A turn long enough to outrun real time on this tiny model, several seconds of it. "
                           "The gateway must hold the audio back instead of flooding the listener.", "p")
            await c.end("p")
            arrivals: list[tuple[float, int]] = []
            while True:
                event = await c.recv(30)
                if isinstance(event, AudioFrame):
                    arrivals.append((time.monotonic(), event.pts_ms))
                elif event["type"] == "context.done":
                    break
    finally:
        await runner.cleanup()
    t0 = arrivals[0][0]
    ahead = [pts + 20 - (t - t0) * 1000 for t, pts in arrivals]  # audio delivered beyond real-time playout
    assert arrivals[-1][1] > 1500  # long enough for pacing to matter
    assert max(ahead) <= lead_ms + 150, f"sent {max(ahead):.0f} ms ahead of playout"
    assert max(ahead) >= lead_ms / 2  # and it did run ahead (no needless throttling)
