"""Twilio Media Streams bridge: a phone call's audio bound to a native session that a voice agent drives.

Two sockets meet in one `CallBridge`, which is the session's Transport:
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
from typing import Any

from aiohttp import WSMsgType, web

from gateway.audio import HEADER_SIZE, pack_frame_header
from gateway.compat import AuthError, gateway_of, native
from gateway.protocol import Error, ErrorCode
from gateway.session import Session

log = logging.getLogger("voxgate.compat.twilio")

TWILIO_OUTPUT = {"format": "mulaw", "sample_rate": 8000, "frame_ms": 20}
MULAW_KIND = 3
FLAG_CALLER = 0x02  # binary frame flag on the control socket: the caller's audio, not a turn's
SESSION_PARAMS = ("session", "voxgate_session")  # <Parameter> names that carry the session id
POLICY_VIOLATION = 1008


class CallBridge:
    """The session's Transport: native JSON to the agent, audio and marks to Twilio; Twilio's events back in."""

    def __init__(self, request: web.Request, control: web.WebSocketResponse):
        self.request, self.control = request, control
        self.session: Session | None = None
        self.twilio: web.WebSocketResponse | None = None
        self.stream_sid: str | None = None
        self.attached = asyncio.Event()
        self.marks: dict[str, tuple[str, float]] = {}  # mark name -> (context_id, audio played once it echoes)
        self.sent_ms = 0.0  # audio of the current turn sent to Twilio: what the caller has heard when a mark echoes
        self._mark_ids = itertools.count()
        self._caller_seq = 0

    # ------------------------------------------------------------------------------------------------ Transport

    async def send_text(self, data: str) -> None:
        await self.control.send_str(data)
        m = json.loads(data)
        kind, cid = m.get("type"), m.get("context_id")
        if kind == "context.started":
            self.sent_ms = 0.0
        elif kind in ("segment.started", "context.done"):
            await self._mark(cid, self.sent_ms)
        elif kind == "context.cancelled" and self.twilio is not None:
            self.marks = {k: v for k, v in self.marks.items() if v[0] != cid}  # Twilio echoes them on clear
            await self._to_twilio({"event": "clear"})

    async def send_bytes(self, data: bytes) -> None:
        await self.attached.wait()  # audio before the call joined waits (the session's stall timeout bounds it)
        payload = base64.b64encode(bytes(data[HEADER_SIZE:])).decode()
        await self._to_twilio({"event": "media", "media": {"payload": payload}})
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
                    await self.control.send_str(error.encode())
                    return
                if m["type"] == "session.start":
                    raw = json.dumps({**m, "output": TWILIO_OUTPUT})
        await self.session.receive(raw)

    # ------------------------------------------------------------------------------------------------ Twilio -> us

    async def join(self, twilio: web.WebSocketResponse, start: dict[str, Any]) -> None:
        self.twilio, self.stream_sid = twilio, start.get("streamSid")
        info = start.get("start") or {}
        await self._event("call.started", stream_sid=self.stream_sid, call_sid=info.get("callSid"),
                          account_sid=info.get("accountSid"), custom_parameters=info.get("customParameters"),
                          media_format=info.get("mediaFormat"))
        self.attached.set()

    async def from_twilio(self, m: dict[str, Any]) -> None:
        event = m.get("event")
        if event == "media":
            media = m.get("media") or {}
            try:
                payload = base64.b64decode(media.get("payload", ""), validate=True)
                pts = int(media.get("timestamp", 0))
            except ValueError:
                return  # a damaged frame is dropped, like a lost packet
            header = pack_frame_header(MULAW_KIND, FLAG_CALLER, 0, self._caller_seq & 0xFFFFFFFF, pts & 0xFFFFFFFF)
            self._caller_seq += 1
            with contextlib.suppress(ConnectionError):
                await self.control.send_bytes(header + payload)
        elif event == "mark":
            name = (m.get("mark") or {}).get("name")
            played = self.marks.pop(name, None) if isinstance(name, str) else None
            if played is not None and self.session is not None:
                cid, played_ms = played
                await self._event("call.mark", name=name, context_id=cid, played_ms=played_ms)
                if cid in self.session.turns or cid in self.session.finished:
                    await self.session.receive(native("playback.position", context_id=cid, played_ms=played_ms))
        elif event == "dtmf":
            await self._event("call.dtmf", digit=(m.get("dtmf") or {}).get("digit"))
        elif event == "stop":
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
    ws = web.WebSocketResponse(max_msg_size=gw.config.limits.ws_max_msg_size, compress=False)
    await ws.prepare(request)
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
            async for msg in ws:
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    await bridge.from_agent(msg.data)
                elif msg.type == WSMsgType.ERROR:
                    break
                if session.closed:
                    break
        finally:
            calls.pop(session.id, None)
            await session.close(1000, "")
    return ws


async def media(request: web.Request) -> web.StreamResponse:
    """GET /v1/twilio/media: Twilio's bidirectional Media Stream (<Connect><Stream>)."""
    ws = web.WebSocketResponse(max_msg_size=1 << 20, compress=False)
    await ws.prepare(request)
    bridge: CallBridge | None = None
    try:
        async for msg in ws:
            if msg.type == WSMsgType.ERROR:
                break
            if msg.type != WSMsgType.TEXT:
                continue
            try:
                m = json.loads(msg.data)
            except ValueError:
                log.info("twilio stream: a frame that is not JSON, ignored")
                continue
            if not isinstance(m, dict):
                continue
            if bridge is not None:
                await bridge.from_twilio(m)
                if bridge.session is None or bridge.session.closed:
                    break
            elif m.get("event") == "start":
                bridge, reason = _bridge_for(request, m)
                if bridge is None:
                    await ws.close(code=POLICY_VIOLATION, message=reason.encode()[:120])
                    break
                await bridge.join(ws, m)
    finally:
        if bridge is not None and bridge.twilio is ws:
            await bridge.hang_up()  # the stream is gone with or without a `stop`
    return ws


def _bridge_for(request: web.Request, start: dict[str, Any]) -> tuple[CallBridge | None, str]:
    info = start.get("start") if isinstance(start.get("start"), dict) else {}
    fmt = info.get("mediaFormat") or {}
    if fmt and (fmt.get("encoding"), fmt.get("sampleRate")) != ("audio/x-mulaw", 8000):
        return None, "voxgate bridges audio/x-mulaw at 8000 Hz"
    params = info.get("customParameters") or {}
    session_id = next((params[p] for p in SESSION_PARAMS if isinstance(params.get(p), str)), None)
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
