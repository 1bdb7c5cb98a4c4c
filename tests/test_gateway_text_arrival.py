"""A turn's TTFB counts from when its first text reached the gateway, not from when its handler got to run: under a
burst, a message read off the socket waits for other handlers on the event loop, and that wait is the server's.
A real aiohttp server, the real websockets client, the real tiny engine."""

import json
import time
from typing import Any

import pytest
import pytest_asyncio

from gateway.client import VoxgateClient
from gateway.server import ServerConfig, create_app, start_server

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

BLOCK_S = 0.5  # how long the slow turn's engine request holds the event loop
SLOW_TEXT = "Slow one."


class LoopHoggingEngine:
    """The real engine, except that submitting SLOW_TEXT holds the event loop for BLOCK_S (as a burst of other
    sessions' handlers would)."""

    def __init__(self, engine: Any):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, text: str, **kwargs: Any) -> Any:
        if text.strip() == SLOW_TEXT:
            time.sleep(BLOCK_S)
        return self._engine.generate(text, **kwargs)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def url(engine):
    runner, port = await start_server(create_app(LoopHoggingEngine(engine), ServerConfig(web_client_dir=None)))
    yield f"ws://127.0.0.1:{port}/v1/stream"
    await runner.cleanup()


async def test_text_that_waited_behind_another_handler_counts_in_the_server_ttfb(url):
    async with await VoxgateClient.connect(url) as c:
        await c.start(output={"format": "pcm_s16le", "sample_rate": 16000}, generation={"seed": 1, "max_length": 4})
        messages = [{"type": "text.append", "context_id": "slow", "text": SLOW_TEXT},
                    {"type": "context.end", "context_id": "slow"},
                    {"type": "text.append", "context_id": "fast", "text": "Hello there."},
                    {"type": "context.end", "context_id": "fast"}]
        for m in messages:
            c.ws.protocol.send_text(json.dumps(m).encode())
        sent_at = time.perf_counter()
        # one socket write: the server reads all four at once, then handles them in order, "fast" after the block
        c.ws.transport.write(b"".join(c.ws.protocol.data_to_send()))
        done: dict[str, dict] = {}
        client_ttfb_ms: dict[str, float] = {}
        while len(done) < 2:
            event = await c.recv(30)
            if isinstance(event, dict):
                assert event["type"] != "error", event
                if event["type"] == "context.done":
                    done[event["context_id"]] = event["metrics"]
            elif c.indexes.get(event.index) not in client_ttfb_ms:
                client_ttfb_ms[c.indexes[event.index]] = (time.perf_counter() - sent_at) * 1000.0
    outside_ms = {cid: client_ttfb_ms[cid] - done[cid]["ttfb_ms"] for cid in done}
    # "fast"'s text waited BLOCK_S inside the gateway before its handler ran: the server's TTFB includes that wait,
    # so what the client saw beyond it is the loopback transit, far below the block
    assert outside_ms["fast"] < BLOCK_S * 1000.0 / 2, (outside_ms, done["fast"]["ttfb_ms"])
    assert done["fast"]["text_queued_ms"] >= BLOCK_S * 1000.0 * 0.9, done["fast"]  # and says where it went
    assert done["slow"]["text_queued_ms"] < BLOCK_S * 1000.0 / 2, done["slow"]
    # and neither turn's origin is earlier than its bytes' arrival: the server never claims more than the client saw
    # (context.done rounds to 0.1 ms)
    assert all(ms >= -0.1 for ms in outside_ms.values()), outside_ms
