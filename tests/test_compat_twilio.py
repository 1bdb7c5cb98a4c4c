"""Twilio Media Streams bridge against a real aiohttp server and the real tiny engine. The Twilio side is a simulated
peer written from Twilio's documented message schema (connected, start, media, dtmf, mark, stop; it plays what it
gets in real time and echoes each mark once the audio before it has played, and echoes pending marks on clear).
The agent side is the native Python client on the control socket."""

import asyncio
import base64
import contextlib
import json
import time

import pytest
import pytest_asyncio
from compat_support import compat_server
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.client import VoxgateClient
from gateway.protocol import AudioFrame

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

KEY = "twilio-test-key"
STREAM_SID = "MZ18ad3ab5a668481ce02b83e7395059f0"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def base(engine):
    async with compat_server(engine, KEY) as port:
        yield f"ws://127.0.0.1:{port}/v1/twilio"


class TwilioPeer:
    """Twilio's side of a bidirectional stream: sends the documented events, plays received audio in real time."""

    def __init__(self, ws):
        self.ws = ws
        self.media: list[tuple[float, bytes]] = []  # (arrival time, mu-law payload)
        self.marks: list[tuple[str, float]] = []  # (name, audio ms before it)
        self.echoed: list[str] = []
        self.clears: list[float] = []
        self.sequence = 0
        self._pending: dict[str, asyncio.TimerHandle] = {}
        self._play_start: float | None = None
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def dial(cls, url: str, session_id: str | None, media_format: dict | None = None) -> "TwilioPeer":
        peer = cls(await connect(url))
        await peer.send("connected", protocol="Call", version="1.0.0")
        params = {"session": session_id} if session_id is not None else {"caller": "+15550100"}
        await peer.send("start", start={
            "accountSid": "AC0000", "callSid": "CA0000", "streamSid": STREAM_SID, "tracks": ["inbound"],
            "customParameters": params,
            "mediaFormat": media_format or {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}})
        return peer

    async def send(self, event: str, **fields) -> None:
        self.sequence += 1
        message = {"event": event, "sequenceNumber": str(self.sequence), **fields}
        if event != "connected":
            message["streamSid"] = STREAM_SID
        await self.ws.send(json.dumps(message))

    def played_ms(self) -> float:
        return 0.0 if self._play_start is None else (time.monotonic() - self._play_start) * 1000.0

    def queued_ms(self) -> float:
        return 20.0 * len(self.media)

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):  # a 1008 close ends the iteration with an error
            await self._read_all()

    async def _read_all(self) -> None:
        async for raw in self.ws:
            m = json.loads(raw)
            assert m["streamSid"] == STREAM_SID, m
            now = time.monotonic()
            if m["event"] == "media":
                if self._play_start is None or self.played_ms() > self.queued_ms():  # ran dry: resume now
                    self._play_start = now - self.queued_ms() / 1000.0
                self.media.append((now, base64.b64decode(m["media"]["payload"])))
            elif m["event"] == "mark":
                name = m["mark"]["name"]
                self.marks.append((name, self.queued_ms()))
                delay = max(0.0, (self.queued_ms() - self.played_ms()) / 1000.0)
                self._pending[name] = asyncio.get_running_loop().call_later(delay, self._echo, name)
            elif m["event"] == "clear":
                self.clears.append(now)
                for name, handle in list(self._pending.items()):  # Twilio echoes every pending mark on clear
                    handle.cancel()
                    self._echo(name)

    def _echo(self, name: str) -> None:
        self._pending.pop(name, None)
        self.echoed.append(name)
        asyncio.ensure_future(self.send("mark", mark={"name": name}))


async def _agent(base: str, **generation) -> VoxgateClient:
    agent = await VoxgateClient.connect(f"{base}/control", api_key=KEY)
    await agent.start(generation={"seed": 7, **generation})
    return agent


async def _until(agent: VoxgateClient, kind: str, seen: list | None = None, timeout: float = 20.0) -> dict:
    while True:
        event = await agent.recv(timeout)
        if seen is not None:
            seen.append(event)
        if isinstance(event, dict):
            assert event["type"] != "error", event
            if event["type"] == kind:
                return event


async def test_call_audio_marks_caller_events_and_stop(base):
    agent = await _agent(base, max_length=10)
    peer = await TwilioPeer.dial(f"{base}/media", agent.session["session_id"])
    started = await _until(agent, "call.started")
    assert started["stream_sid"] == STREAM_SID and started["call_sid"] == "CA0000"
    assert started["custom_parameters"]["session"] == agent.session["session_id"]

    caller = bytes(range(160))  # 20 ms of caller audio
    for chunk in (1, 2):
        await peer.send("media", media={"track": "inbound", "chunk": str(chunk), "timestamp": str(20 * chunk),
                                        "payload": base64.b64encode(caller).decode()})
    await peer.send("dtmf", dtmf={"track": "inbound_track", "digit": "5"})
    seen: list = []
    dtmf = await _until(agent, "call.dtmf", seen)
    assert dtmf["digit"] == "5"
    inbound = [e for e in seen if isinstance(e, AudioFrame)]
    assert [(f.kind, f.flags, f.payload, f.pts_ms) for f in inbound] == [(3, 2, caller, 20), (3, 2, caller, 40)]

    await agent.append("Hello there, this is your phone agent.", "t1")
    await agent.end("t1")
    seen = []
    done = await _until(agent, "context.done", seen)
    marks = [e for e in seen if isinstance(e, dict) and e["type"] == "call.mark"]
    while not marks or marks[-1]["played_ms"] < done["audio_ms"]:  # the end mark echoes once all has played
        marks.append(await _until(agent, "call.mark", timeout=10))
    assert all(len(payload) == 160 for _, payload in peer.media)  # 20 ms of 8 kHz mu-law per message
    assert 20 * len(peer.media) == done["audio_ms"]
    assert [name for name, _ in peer.marks] == peer.echoed  # every mark came back, in order
    # each echoed mark reports the audio Twilio had received before it, i.e. what the caller has heard
    assert [m["played_ms"] for m in marks] == [ms for _, ms in peer.marks]
    # paced to the phone's playout: never far more than the telephony lead (500 ms) ahead of it
    start = peer.media[0][0]
    ahead = max(20 * (i + 1) - (t - start) * 1000.0 for i, (t, _) in enumerate(peer.media))
    assert ahead < 500 + 250, f"{ahead:.0f} ms of audio ahead of the phone's playout"

    await peer.send("stop", stop={"accountSid": "AC0000", "callSid": "CA0000"})
    await _until(agent, "call.stopped")
    with pytest.raises(ConnectionClosed):
        await _until(agent, "never", timeout=5)
    await asyncio.wait_for(peer.reader, 5)  # voxgate closed Twilio's socket too
    assert agent.ws.close_code == 1000 and peer.ws.close_code == 1000


async def test_cancel_sends_clear_and_stops_the_audio(base):
    agent = await _agent(base)
    peer = await TwilioPeer.dial(f"{base}/media", agent.session["session_id"])
    await _until(agent, "call.started")
    await agent.append(" ".join(f"This is part {i} of a very long story." for i in range(12)), "t1")
    await agent.end("t1")
    while not peer.media:
        await asyncio.sleep(0.02)
    await agent.cancel("t1")
    cancelled = await _until(agent, "context.cancelled")
    assert cancelled["text_remaining"]  # there was more to say: the cancel cut the turn short
    await asyncio.sleep(0.3)
    assert len(peer.clears) == 1
    assert not [t for t, _ in peer.media if t > peer.clears[0]], "audio was sent after clear"

    # marks Twilio echoes because of the clear are not reported as heard; the line is free for the next turn
    n_media = len(peer.media)
    await agent.append("Sorry, go ahead.", "t2")
    await agent.end("t2")
    done = await _until(agent, "context.done")
    assert 20 * (len(peer.media) - n_media) == done["audio_ms"]
    await peer.ws.close()  # the call drops without a stop
    await _until(agent, "call.stopped")
    await agent.close()


@pytest.mark.parametrize("session, media_format, reason", [
    ("no-such-session", None, "unknown voxgate session"),
    (None, None, "missing"),
    ("known", {"encoding": "audio/x-l16", "sampleRate": 16000, "channels": 1}, "audio/x-mulaw"),
])
async def test_twilio_stream_without_a_valid_session_is_closed_1008(base, session, media_format, reason):
    agent = await _agent(base) if session == "known" else None
    session_id = agent.session["session_id"] if agent else session
    peer = await TwilioPeer.dial(f"{base}/media", session_id, media_format)
    await asyncio.wait_for(peer.reader, 5)
    assert peer.ws.close_code == 1008 and reason in peer.ws.close_reason
    if agent:
        await agent.close()


async def test_control_socket_errors_use_the_native_form(base):
    with pytest.raises(InvalidStatus) as e:
        await VoxgateClient.connect(f"{base}/control", api_key="wrong")
    assert e.value.response.status_code == 401
    async with await VoxgateClient.connect(f"{base}/control", api_key=KEY) as agent:
        await agent.send({"type": "session.start", "output": {"format": "opus"}})
        error = await agent.expect("error")
        assert error["code"] == "invalid_value" and "mulaw" in error["message"]
        await agent.start()
        await agent.append("One turn at a time.", "t1")
        await agent.append("A second one is refused.", "t2")
        error = await agent.expect("error")
        assert error["code"] == "too_many_contexts" and error["context_id"] == "t2"
