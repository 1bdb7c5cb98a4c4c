"""Where each segment of a turn sat: `context.done` metrics carry a `segment_log` (when each segment went to the
engine, how much audio its listener had queued then, its engine TTFB, its longest wait for a later chunk), what
the load benchmark reads to place an underrun. Real server, real client, the real tiny engine."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gateway.client import VoxgateClient
from gateway.server import ServerConfig, create_app, start_server

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]


async def _serve(engine: Any, **config: Any) -> tuple[Any, str]:
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None, **config)))
    return runner, f"ws://127.0.0.1:{port}/v1/stream"


async def test_segment_log_shows_each_continuation_submitted_after_the_previous_segment_ended(engine):
    runner, url = await _serve(engine)
    try:
        async with await VoxgateClient.connect(url) as c:
            await c.start(output={"format": "pcm_s16le"}, generation={"seed": 2})
            utt = await c.speak("One clause comes first, and another follows it. Then a sentence ends the turn.",
                                "t")
    finally:
        await runner.cleanup()
    metrics = utt.done["metrics"]
    log = metrics["segment_log"]
    assert [s["segment"] for s in log] == list(range(metrics["segments"])) and len(log) >= 2
    assert log[0]["lead_ms"] == 0.0  # nothing was queued for the listener before the turn's first segment
    for prev, seg in zip(log, log[1:], strict=False):
        # a continuation needs its predecessor's last patches: it cannot go to the engine before they came out
        assert seg["submit_ms"] >= prev["done_ms"] >= prev["submit_ms"]
        assert seg["lead_ms"] > 0  # the previous segment's audio was queued for the listener by then
    assert all(s["patches"] > 0 and s["engine_ttfb_ms"] is not None for s in log)


async def test_next_segment_goes_to_the_engine_before_the_last_chunk_is_encoded(engine, monkeypatch):
    """A continuation needs only its predecessor's latents: its request must not wait for that segment's last chunk
    to be encoded (under load the encode pool's queue). Every encode is slowed to 250 ms; the next segment still
    goes out right when the previous one is done at the engine."""
    from gateway.audio.encoder import Encoder

    slow_ms = 250.0
    encode = Encoder.encode

    def slow_encode(self: Encoder, pcm: Any) -> list[bytes]:
        time.sleep(slow_ms / 1000.0)  # in the encode pool's thread (Opus), the loop keeps running
        return encode(self, pcm)

    monkeypatch.setattr(Encoder, "encode", slow_encode)
    runner, url = await _serve(engine)
    try:
        async with await VoxgateClient.connect(url) as c:
            await c.start(output={"format": "opus"}, generation={"seed": 3, "max_length": 3})
            utt = await c.speak("One clause comes first, and another follows it. Then a sentence ends the turn.",
                                "t")
    finally:
        await runner.cleanup()
    log = utt.done["metrics"]["segment_log"]
    assert len(log) >= 2
    for prev, seg in zip(log, log[1:], strict=False):
        assert prev["done_ms"] <= seg["submit_ms"] < prev["done_ms"] + slow_ms / 2
