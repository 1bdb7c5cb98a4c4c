"""Twilio Media Streams bridge: a phone call's audio bound to a native session that a voice agent drives.

Two sockets meet in one `CallBridge`, which is the session's EventSink:
- the agent opens `GET /v1/twilio/control` (native auth) and speaks the native protocol: `session.start` (output is
  mu-law 8 kHz in 20 ms frames, the only thing a phone line plays), text.append, context.end, context.cancel, ...
  It receives every native message, and the caller's side as events: `call.started`, `call.mark`, `call.dtmf`,
  `call.stopped`, and the caller's audio as binary frames with the native header (kind 3 mu-law, flags 0x02).
- `session.started` carries `session_id`, an unguessable id: the agent answers Twilio's webhook with
  `<Connect><Stream url="wss://.../v1/twilio/media"><Parameter name="session" value="{session_id}"/></Stream>`,
  and Twilio's socket joins that session on its `start` event (no id, or an unknown one: closed with 1008).
Towards Twilio: each audio frame -> a `media` message (160 bytes = 20 ms, base64); a `mark` before every segment and
at the end of every turn, whose echo (Twilio plays audio in order) becomes the turn's `playback.position`, so pacing
and the barge-in report follow what the caller really heard; `context.cancelled` -> `clear`. Twilio's `stop` ends
the session. One turn speaks at a time (a phone line has one voice): end or cancel it before starting the next."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import itertools
import json
import logging
import secrets
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from gateway import protocol as p
from gateway.compat import AuthError, gateway_of, json_object, native
from gateway.native_sink import NativeSink
from gateway.protocol import Error, ErrorCode, ProtocolError
from gateway.session import Session
from gateway.sockets import FirstMessageTimeout, Messages, abort, open_socket

log = logging.getLogger("voxgate.compat.twilio")

TWILIO_OUTPUT = {"format": "mulaw", "sample_rate": 8000, "frame_ms": 20}
MULAW_KIND = 3
FLAG_CALLER = 0x02  # binary frame flag on the control socket: the caller's audio, not a turn's
SESSION_PARAMS = ("session", "voxgate_session")  # <Parameter> names that carry the session id
POLICY_VIOLATION = 1008
MEDIA_MAX_MESSAGE = 1 << 20  # Twilio's messages are small: 20 ms of audio, or a start event


# Twilio's messages (https://www.twilio.com/docs/voice/media-streams/websocket-messages), validated before use: fields
# voxgate does not read are ignored, a message that does not fit is dropped (`parse_twilio`)
class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class MediaFormat(_Message):
    encoding: str
    sampleRate: int  # noqa: N815 (Twilio's names)


class StartInfo(_Message):
    callSid: str | None = None  # noqa: N815
    accountSid: str | None = None  # noqa: N815
    customParameters: dict[str, str] = {}  # noqa: N815
    mediaFormat: MediaFormat | None = None  # noqa: N815


class Start(_Message):
    event: Literal["start"]
    streamSid: str | None = None  # noqa: N815
    start: StartInfo = StartInfo()


class MediaInfo(_Message):
    payload: str
    timestamp: int = 0  # ms since the stream started (Twilio sends it as a string of digits)


class Media(_Message):
    event: Literal["media"]
    media: MediaInfo


class MarkInfo(_Message):
    name: str


class Mark(_Message):
    event: Literal["mark"]
    mark: MarkInfo


class DtmfInfo(_Message):
    digit: str


class Dtmf(_Message):
    event: Literal["dtmf"]
    dtmf: DtmfInfo


class Stop(_Message):
    event: Literal["stop"]


class Connected(_Message):
    event: Literal["connected"]


TwilioMessage = Annotated[Start | Media | Mark | Dtmf | Stop | Connected, Field(discriminator="event")]
_TWILIO = TypeAdapter(TwilioMessage)


class MalformedTwilio(ValueError):
    """A message that does not fit Twilio's schema; `event` is its `event` field, if it had a string one."""

    def __init__(self, message: str, event: str | None):
        super().__init__(message)
        self.event = event


def parse_twilio(raw: str | bytes) -> Start | Media | Mark | Dtmf | Stop | Connected:
    """One message from Twilio, validated; MalformedTwilio saying what is wrong."""
    try:
        data = json_object(raw)
    except ValueError as e:
        raise MalformedTwilio(str(e), None) from None
    try:
        return _TWILIO.validate_python(data)
    except ValueError as e:  # pydantic's ValidationError
        event = data.get("event")
        raise MalformedTwilio(str(e).splitlines()[0], event if isinstance(event, str) else None) from None


class CallBridge:
    """The session's EventSink: native messages to the agent, audio and marks to Twilio; Twilio's events back in."""

    def __init__(self, request: web.Request, control: web.WebSocketResponse):
        self.request, self.control = request, control
        self.agent = NativeSink(control, request)  # the control socket speaks the native protocol
        self.session: Session | None = None
        self.twilio: web.WebSocketResponse | None = None
        self.stream_sid: str | None = None
        self.attached = asyncio.Event()
        self.marks: dict[str, tuple[str, float]] = {}  # mark name -> (context_id, audio played once it echoes)
        self.sent_ms = 0.0  # audio of the current turn sent to Twilio: what the caller has heard when a mark echoes
        self._mark_ids = itertools.count()
        self._caller_seq = 0

    # ------------------------------------------------------------------------------------------------ EventSink

    async def message(self, msg: p.ServerMessage) -> None:
        await self.agent.message(msg)
        if isinstance(msg, p.ContextStarted):
            self.sent_ms = 0.0
        elif isinstance(msg, p.SegmentStarted | p.ContextDone):
            await self._mark(msg.context_id, self.sent_ms)
        elif isinstance(msg, p.ContextCancelled) and self.twilio is not None:
            cid = msg.context_id
            self.marks = {k: v for k, v in self.marks.items() if v[0] != cid}  # Twilio echoes them on clear
            await self._to_twilio({"event": "clear"})

    async def audio(self, packets: p.AudioPackets) -> None:
        for payload in packets.payloads:
            await self.attached.wait()  # audio before the call joined waits (the session's stall timeout bounds it)
            await self._to_twilio({"event": "media", "media": {"payload": base64.b64encode(payload).decode()}})
            self.sent_ms += TWILIO_OUTPUT["frame_ms"]

    async def close(self, code: int, reason: str) -> None:
        for ws in (self.twilio, self.control):
            if ws is not None and not ws.closed:
                with contextlib.suppress(Exception):
                    await ws.close(code=code, message=reason.encode()[:120])

    def abort(self) -> None:
        if self.request.transport is not None:
            self.request.transport.abort()

    async def _to_twilio(self, message: dict[str, Any]) -> None:
        if self.twilio is None or self.twilio.closed:
            raise ConnectionError("the call's media stream is gone")
        await self.twilio.send_str(json.dumps({**message, "streamSid": self.stream_sid}))

    async def _mark(self, context_id: str, played_ms: float) -> None:
        if self.twilio is not None:
            name = f"voxgate-{next(self._mark_ids)}"
            self.marks[name] = (context_id, played_ms)
            await self._to_twilio({"event": "mark", "mark": {"name": name}})

    # ------------------------------------------------------------------------------------------------ agent -> us

    async def from_agent(self, raw: str | bytes) -> None:
        assert self.session is not None
        if isinstance(raw, str):
            try:
                m = json.loads(raw)
            except ValueError:
                m = None  # the session reports bad JSON in its own words
            if isinstance(m, dict) and m.get("type") in ("session.start", "session.update"):
                output = m.get("output")
                telephony = isinstance(output, dict) and {**TWILIO_OUTPUT, **output} == TWILIO_OUTPUT
                if output is not None and not telephony:
                    error = Error(str(ErrorCode.INVALID_VALUE), f"the Twilio bridge sends {TWILIO_OUTPUT}; leave "
                                  "output out or ask for exactly that")
                    await self.agent.message(error)
                    return
                if m["type"] == "session.start":
                    raw = json.dumps({**m, "output": TWILIO_OUTPUT})
        await self.session.receive(raw)

    # ------------------------------------------------------------------------------------------------ Twilio -> us

    async def join(self, twilio: web.WebSocketResponse, start: Start) -> None:
        self.twilio, self.stream_sid = twilio, start.streamSid
        info = start.start
        await self._event("call.started", stream_sid=self.stream_sid, call_sid=info.callSid,
                          account_sid=info.accountSid, custom_parameters=info.customParameters,
                          media_format=info.mediaFormat.model_dump() if info.mediaFormat is not None else None)
        self.attached.set()

    async def from_twilio(self, m: Start | Media | Mark | Dtmf | Stop | Connected) -> None:
        if isinstance(m, Media):
            try:
                payload = base64.b64decode(m.media.payload, validate=True)
            except ValueError:
                return  # a damaged frame is dropped, like a lost packet
            frame = p.AudioFrame(MULAW_KIND, FLAG_CALLER, 0, self._caller_seq, m.media.timestamp, payload)
            self._caller_seq += 1
            with contextlib.suppress(ConnectionError):
                await self.agent.frame(frame)
        elif isinstance(m, Mark):
            name = m.mark.name
            played = self.marks.pop(name, None)
            if played is not None and self.session is not None:
                cid, played_ms = played
                await self._event("call.mark", name=name, context_id=cid, played_ms=played_ms)
                if cid in self.session.turns or cid in self.session.finished:
                    await self.session.receive(native("playback.position", context_id=cid, played_ms=played_ms))
        elif isinstance(m, Dtmf):
            await self._event("call.dtmf", digit=m.dtmf.digit)
        elif isinstance(m, Stop):
            await self.hang_up()

    async def hang_up(self) -> None:
        """The call ended: tell the agent, then end the session (which closes both sockets)."""
        if self.session is not None and not self.session.closed:
            with contextlib.suppress(Exception):
                await self._event("call.stopped", stream_sid=self.stream_sid)
            await self.session.close(1000, "call ended")

    async def _event(self, kind: str, **fields: Any) -> None:
        await self.control.send_str(json.dumps({"type": kind, **fields}))


CALLS = web.AppKey("twilio_calls", dict)  # session id -> CallBridge, while its control socket is open


async def control(request: web.Request) -> web.StreamResponse:
    """GET /v1/twilio/control: the agent's side of a call (native protocol + call events)."""
    gw = gateway_of(request)
    try:
        key = await gw.auth.authenticate(request.headers.get("Authorization"), request.query.get("token"))
    except AuthError as e:
        gw.metrics.errors.labels(code=str(ErrorCode.UNAUTHORIZED)).inc()
        return web.json_response({"error": {"code": str(ErrorCode.UNAUTHORIZED), "message": str(e)}}, status=401)
    refused = await gw.refusal(key)
    if refused is not None:
        return web.json_response({"error": {"code": str(refused.code), "message": refused.message}}, status=503)
    ws = await open_socket(request, gw.config.limits.ws_max_msg_size, gw.config.socket_send_buffer)
    bridge = CallBridge(request, ws)
    limits = dataclasses.replace(gw.config.limits, max_contexts=1)
    session = gw.session(bridge, key, dataclasses.replace(gw.config.session, limits=limits),
                         session_id=secrets.token_urlsafe(18))
    bridge.session = session
    calls = request.app[CALLS]
    calls[session.id] = bridge
    session.open()
    with gw.tracked(session, key):
        try:
            async with Messages(ws, stall_s=limits.slow_consumer_timeout_s,
                                on_stall=session.drop_slow_consumer) as messages:
                async for msg in messages:
                    await bridge.from_agent(msg.data)
                    if session.closed:
                        break
        except ConnectionError:  # the agent went away while we answered it
            pass
        except Exception:  # a bug: logged once, the agent hears of it, the server serves on
            log.exception("twilio control %s: internal error", session.id)
            await session.fail(ProtocolError(ErrorCode.INTERNAL_ERROR, "internal error", fatal=True))
        finally:
            calls.pop(session.id, None)
            await session.close(1000, "")
    return ws


async def media(request: web.Request) -> web.StreamResponse:
    """GET /v1/twilio/media: Twilio's bidirectional Media Stream (<Connect><Stream>). Until its `start` event binds
    it to a call (within handshake_timeout_s, else closed with 1008) the socket counts against max_sessions; a
    message that does not fit Twilio's schema is dropped (a `start` that does not: closed with 1008)."""
    gw = gateway_of(request)
    refused = gw.full()
    if refused is not None:  # a full server takes no more sockets, identified or not
        return web.json_response({"error": {"code": str(refused.code), "message": refused.message}}, status=503)
    ws = await open_socket(request, MEDIA_MAX_MESSAGE, gw.config.socket_send_buffer)
    bridge: CallBridge | None = None
    pending = contextlib.ExitStack()
    pending.enter_context(gw.pending_socket())

    def stalled() -> None:  # Twilio stopped reading: the stream is dropped, and the call's session ends with it
        gw.metrics.errors.labels(code=str(ErrorCode.SLOW_CONSUMER)).inc()
        log.info("twilio stream: no pong for %g s, dropping it", gw.config.limits.slow_consumer_timeout_s)
        abort(request)

    try:
        async with Messages(ws, stall_s=gw.config.limits.slow_consumer_timeout_s, on_stall=stalled,
                            first_within_s=gw.config.handshake_timeout_s) as messages:
            async for msg in messages:
                try:
                    m = parse_twilio(msg.data)
                except MalformedTwilio as e:
                    if bridge is None and e.event == "start":
                        await ws.close(code=POLICY_VIOLATION, message=b"malformed start event")
                        break
                    log.info("twilio stream: a message that does not fit Twilio's schema, dropped: %s", e)
                    continue
                if bridge is not None:
                    await bridge.from_twilio(m)
                    if bridge.session is None or bridge.session.closed:
                        break
                elif isinstance(m, Start):
                    bridge, reason = _bridge_for(request, m)
                    if bridge is None:
                        await ws.close(code=POLICY_VIOLATION, message=reason.encode()[:120])
                        break
                    pending.close()  # the call's session counts from here
                    await bridge.join(ws, m)
    except FirstMessageTimeout:
        await ws.close(code=POLICY_VIOLATION, message=b"no start event in time")
    except ConnectionError:  # Twilio or the agent went away mid-message: the call ends below
        pass
    except Exception:  # a bug: logged once; the stream closes with 1011 and the call's session ends
        log.exception("twilio stream: internal error")
        await ws.close(code=1011, message=b"internal error")
    finally:
        pending.close()
        if bridge is not None and bridge.twilio is ws:
            await bridge.hang_up()  # the stream is gone with or without a `stop`
    return ws


def _bridge_for(request: web.Request, start: Start) -> tuple[CallBridge | None, str]:
    fmt = start.start.mediaFormat
    if fmt is not None and (fmt.encoding, fmt.sampleRate) != ("audio/x-mulaw", 8000):
        return None, "voxgate bridges audio/x-mulaw at 8000 Hz"
    params = start.start.customParameters
    session_id = next((params[p] for p in SESSION_PARAMS if p in params), None)
    if session_id is None:
        return None, "missing <Parameter name=\"session\"> with the voxgate session id"
    bridge = request.app[CALLS].get(session_id)
    if bridge is None:
        return None, "unknown voxgate session"
    if bridge.twilio is not None:
        return None, "that voxgate session already has a call"
    return bridge, ""


def register(app: web.Application) -> None:
    app[CALLS] = {}
    app.router.add_get("/v1/twilio/control", control)
    app.router.add_get("/v1/twilio/media", media)
