"""The loop's low-priority lane (`gateway.loop_lanes`): in a burst, work that can wait (context.started, the rest of a
paragraph's cuts, a turn's task start) runs after the handlers of the messages waiting, and nothing about a session's
order changes. Through the real server, a real WebSocket client and the real tiny engine; the lane is held (a socket
counted as waiting, the bound lifted) so the deferred work is certainly still pending when the next message comes."""

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from gateway import loop_lanes
from gateway.app_keys import GATEWAY
from gateway.client import VoxgateClient
from gateway.protocol import AudioFrame, Limits
from gateway.server import ServerConfig, create_app, start_server
from gateway.session import SessionConfig

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

LIMITS = Limits(max_buffered_chars=300)
TEXT = "Hello there. How are you today?"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(engine):
    app = create_app(engine, ServerConfig(session=SessionConfig(limits=LIMITS), web_client_dir=None))
    runner, port = await start_server(app)
    yield f"ws://127.0.0.1:{port}/v1/stream", app[GATEWAY]
    await runner.cleanup()


@pytest_asyncio.fixture(loop_scope="module")
async def held(monkeypatch) -> AsyncIterator[loop_lanes.Lane]:
    """The loop's lane with one more socket counted as waiting and no bound: deferred work waits until released."""
    monkeypatch.setattr(loop_lanes, "BOUND_S", 3600.0)
    lane = loop_lanes.lane()
    assert lane.enabled
    source = Waiting()
    lane.read(source)

    def release() -> None:
        source.message = False
        lane.handled(source)

    lane.release = release  # type: ignore[attr-defined]
    try:
        yield lane
    finally:
        release()


class Waiting:
    """A socket with a message waiting for its handler until told otherwise."""

    def __init__(self) -> None:
        self.message = True

    def has_message(self) -> bool:
        return self.message


async def _idle(engine, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while engine.stats().in_flight and time.monotonic() < end:
        await asyncio.sleep(0.02)
    assert engine.stats().in_flight == 0


async def _wait_for(predicate, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


async def _messages_until(c: VoxgateClient, kind: str) -> list[dict]:
    """Every JSON message up to and including the first of `kind` (audio frames are collected as "audio")."""
    seen: list[dict] = []
    while True:
        event = await c.recv(10)
        seen.append({"type": "audio"} if isinstance(event, AudioFrame) else event)
        if seen[-1]["type"] == kind:
            return seen


def _request_sent(gw) -> bool:
    """The turn "t" of the server's session has its engine request out."""
    return any((turn := s.turns.get("t")) is not None and turn.request_id is not None for s in gw.sessions)


async def test_the_engine_request_goes_out_before_the_deferred_work(server, engine, held):
    url, gw = server
    async with await VoxgateClient.connect(url) as c:
        await c.start(generation={"max_length": 4})
        await c.append(TEXT, "t")
        await c.end("t")
        # the request is out while context.started and the task's start wait in the lane
        await _wait_for(lambda: _request_sent(gw))
        assert any(item.pending for item in held._items)
        with pytest.raises(TimeoutError):
            await c.recv(0.2)  # nothing is sent before the lane runs
        held.release()
        seen = await _messages_until(c, "context.done")
    types = [m["type"] for m in seen]
    assert types[0] == "context.started" and "audio" in types and types.count("context.started") == 1
    # every segment the deferred cuts and the end's cut made was spoken
    segments = seen[-1]["metrics"]["segments"]
    assert [m["segment"] for m in seen if m["type"] == "segment.started"] == list(range(segments))


async def test_an_error_in_the_same_read_comes_after_context_started(server, engine, held):
    url, _ = server
    async with await VoxgateClient.connect(url) as c:
        await c.start(generation={"max_length": 4})
        await c.append(TEXT, "t")
        await c.append("x" * (LIMITS.max_buffered_chars + 1), "t")  # over the buffer: its error answers it
        first = await c.recv(5)
        error = await c.recv(5)
        assert first["type"] == "context.started" and first["context_id"] == "t"
        assert error["type"] == "error" and error["code"] == "buffer_full" and error["context_id"] == "t"
        held.release()
        await c.end("t")
        seen = await _messages_until(c, "context.done")
    assert "context.started" not in [m["type"] for m in seen]  # sent once


async def test_cancel_before_the_deferred_work_ran(server, engine, held):
    url, gw = server
    async with await VoxgateClient.connect(url) as c:
        await c.start(generation={"max_length": 4})
        await c.append(TEXT, "t")
        await c.cancel("t")
        started = await c.recv(5)
        cancelled = await c.recv(5)
        assert started["type"] == "context.started"
        assert cancelled["type"] == "context.cancelled" and cancelled["audio_sent_ms"] == 0
        assert cancelled["text_remaining"].strip() == TEXT
        await _idle(engine)  # the request its handler sent is cancelled
        (session,) = gw.sessions
        turn = session.finished["t"]
        assert turn.begin is None and not turn.tasks  # its task's start was dropped from the lane
        held.release()
        with pytest.raises(TimeoutError):  # the stopped turn never starts: no audio, no context.done
            await c.recv(0.3)
        await c.ping("p")
        assert (await c.recv(5))["type"] == "pong"


async def test_a_session_closed_with_work_deferred_frees_it(server, engine, held):
    url, gw = server
    c = await VoxgateClient.connect(url)
    await c.start(generation={"max_length": 4})
    await c.append(TEXT, "t")
    await _wait_for(lambda: _request_sent(gw))
    (session,) = gw.sessions
    (turn,) = session.turns.values()
    assert turn.begin is not None and turn.begin.pending and not turn.tasks
    await c.close()
    await _wait_for(lambda: session.closed and not gw.sessions)
    await _idle(engine)
    assert turn.begin is None and not turn.tasks and not session._unannounced
    held.release()
    await asyncio.sleep(0.05)
    assert not turn.tasks  # the lane ran what was left of the session's work: nothing started


async def test_the_lane_runs_after_waiting_messages_or_at_its_bound():
    lane = loop_lanes.Lane(asyncio.get_running_loop())
    ran: list[str] = []
    partial = Waiting()
    partial.message = False
    lane.read(partial)  # bytes of a frame not yet whole hold nothing back
    lane.defer(ran.append, "x")
    await asyncio.sleep(0.001)
    assert ran == ["x"]
    source = Waiting()
    lane.read(source)
    lane.defer(ran.append, "a")
    dropped = lane.defer(ran.append, "dropped")
    dropped.cancel()
    await asyncio.sleep(0.001)
    assert ran == ["x"]  # a message waits for its handler, and the bound is not reached
    await asyncio.sleep(loop_lanes.BOUND_S * 2)
    assert ran == ["x", "a"]  # the bound: it never starves
    lane.defer(ran.append, "b")
    source.message = False
    lane.handled(source)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert ran == ["x", "a", "b"] and not lane.waiting
    off = loop_lanes.Lane(asyncio.get_running_loop(), enabled=False)
    off.read(source)
    off.defer(ran.append, "c")
    await asyncio.sleep(0)
    assert ran[-1] == "c"  # off: first in, first out, whatever waits
