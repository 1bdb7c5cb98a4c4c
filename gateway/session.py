"""One client session of the native protocol: turns (contexts), their segments in flight, pacing against the
client's playout, cancellation with a heard report, limits. Talks to the engine through its async API and to the
client through an `EventSink` (`gateway.protocol.sink`), to which it emits typed messages and audio packets;
knows nothing about aiohttp, JSON or the binary frame header. A turn's synthesis pipeline is in `gateway.turn`, its
paced sender in `gateway.playout`, its report in `gateway.turn_report`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from gateway import protocol as p
from gateway.audio import OutputFormat
from gateway.encode_site import encode_site
from gateway.engine_contract import SessionEngine
from gateway.loop_lanes import lane
from gateway.metrics import GatewayMetrics
from gateway.playout import TurnSender
from gateway.protocol import AudioPackets, ErrorCode, EventSink, ProtocolError
from gateway.session_settings import SessionSettings
from gateway.text.segmenter import ChunkingConfig, Segment, Segmenter
from gateway.turn import SessionClosed, Turn, TurnPipeline, _aclose, _Started
from gateway.turn_report import split_heard
from gateway.turn_text import TextOp, TurnText

log = logging.getLogger("voxgate.session")

TELEPHONY_FORMATS = ("mulaw", "alaw")
# the loop time of a turn's synthesis task's first step (context.started, its encoder opened, segment.started, the
# first engine read: most of bench/loop_cost.py's after_burst per turn), charged to the lane that starts it
TASK_START_S = 100e-6


# a session's view of the stored voices: the engine voice id its key may speak with, or None (unknown to it)
VoiceResolver = Callable[[str], Awaitable[str | None]]
# pronunciation dictionary ids -> the rewrite they make (None for none); ProtocolError for an id the key may not use
PronunciationResolver = Callable[[list[str]], Awaitable[Callable[[str], str] | None]]


@dataclass(frozen=True)
class SessionConfig:
    limits: p.Limits = p.Limits()
    max_lead_ms: float = 1500.0  # audio sent ahead of the client's playout
    max_lead_ms_telephony: float = 500.0  # mulaw / alaw: phone gateways buffer little and clear on barge-in
    pipeline_chunks: int = 16  # engine chunks encoded ahead of sending, per turn (the synthesis pipeline bound)
    finished_turns_kept: int = 8  # for late playback.position / context.cancel after context.done



class Session(SessionSettings, TurnPipeline, TurnSender, TurnText):
    """Drive with `receive()` per client frame; `close()` when the connection ends."""

    def __init__(self, engine: SessionEngine, sink: EventSink, config: SessionConfig = SessionConfig(), *,
                 metrics: GatewayMetrics | None = None, clock: Callable[[], float] = time.monotonic,
                 session_id: str | None = None, voices: VoiceResolver | None = None,
                 pronunciations: PronunciationResolver | None = None):
        self.engine = engine
        # the stored voices this session's key may use (the gateway's catalog); None: every voice of the engine
        self.voices = voices
        # the sampling settings the engine takes (one definition: `engine.guards.SamplingRanges`); a stand-in engine
        # without one leaves them to its own `generate`
        self.sampling_ranges = getattr(engine, "sampling_ranges", None)
        self.pronunciations = pronunciations
        self.rewrite: Callable[[str], str] | None = None  # the selected pronunciation dictionaries' rules
        self.sink = sink
        self.config = config
        self.limits = config.limits
        self.metrics = metrics or GatewayMetrics()
        self.clock = clock
        self.id = session_id or uuid.uuid4().hex[:16]
        self.tenant: str | None = None  # the tenant (API key digest) its engine requests carry (`Gateway.session`)
        info = engine.model_info()
        self.model_info = info
        self.model_rate: int = info.sample_rate
        self.started = False
        self.closed = False
        self.draining = False
        self.voice: str | None = None
        self.voice_is_prompt = False  # the voice is a prompt voice: segments do not continue from each other
        self.fmt = OutputFormat.from_dict({})
        self.chunking = ChunkingConfig()
        self.generation = p.GenerationSettings()
        self.turns: dict[str, Turn] = {}
        self.finished: OrderedDict[str, Turn] = OrderedDict()
        self.next_index = 0
        self.last_activity = clock()
        self._watchdog: asyncio.Task | None = None
        self._send_ready: Callable[[], bool] | None = getattr(sink, "send_ready", None)
        self._audio_now: Callable[[AudioPackets], bool] | None = getattr(sink, "audio_now", None)
        self._tasks: set[asyncio.Task] = set()
        self._dropped = False  # drop_slow_consumer ran
        # when the message being handled reached the gateway (`receive`): a turn's TTFB counts from there, so the
        # time a message waits behind other sessions' handlers (a burst of turns) is the server's, not "outside" it
        self._message_at = self.last_activity
        # new turns whose context.started waits in the loop's lane (`_append`): sent before anything else the
        # session sends, so a client still hears of a context before any error, audio or end of it
        self._unannounced: deque[Turn] = deque()

    # ------------------------------------------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Start the idle watchdog."""
        self.metrics.sessions.inc()
        self._watchdog = asyncio.create_task(self._watch_idle())

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Stop every turn (cancelling engine requests) and close the connection; idempotent."""
        if self.closed:
            return
        self.closed = True
        self.metrics.sessions.dec()
        self._unannounced.clear()
        if self._watchdog is not None and self._watchdog is not asyncio.current_task():
            self._watchdog.cancel()
        for turn in list(self.turns.values()):
            await self._stop_turn(turn)
            self.metrics.turns_done.labels(outcome="disconnected").inc()  # the session ended under it
        try:
            async with asyncio.timeout(1.0):
                await self.sink.close(code, reason)
        except TimeoutError:  # a client that does not read would hold the connection open with our unsent bytes
            self.sink.abort()
        except Exception:  # the connection is gone already
            pass

    async def fail(self, error: ProtocolError) -> None:
        """Report an error; a fatal one closes the session."""
        self.metrics.errors.labels(code=str(error.code)).inc()
        log.info("session %s error %s: %s", self.id, error.code, error.message)
        if error.fatal:
            # the client may not be reading: do not let the error report stall the close
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await self._announce()
                    await self.sink.message(error.to_message())
            await self.close(1008 if error.code != ErrorCode.SERVER_SHUTDOWN else 1001, str(error.code))
            return
        await self._send(error.to_message())

    async def shutdown(self, deadline_s: float) -> None:
        """Server shutdown: refuse new turns, let current ones finish until the deadline, then close."""
        self.draining = True
        end = self.clock() + deadline_s
        while self.turns and self.clock() < end and not self.closed:
            await asyncio.sleep(0.05)
        await self.fail(ProtocolError(ErrorCode.SERVER_SHUTDOWN, "the server is shutting down; reconnect",
                                      fatal=True))

    # ------------------------------------------------------------------------------------------------ input

    async def receive(self, raw: str | bytes, arrived_at: float | None = None) -> None:
        """Handle one frame from the client; `arrived_at`: when its bytes came in (the session's clock; None: now)."""
        if self.closed:
            return
        self.last_activity = self.clock()
        self._message_at = self.last_activity if arrived_at is None else min(arrived_at, self.last_activity)
        try:
            message = p.parse_client_message(raw, self.limits)
            await self._dispatch(message)
        except ProtocolError as e:
            with contextlib.suppress(SessionClosed):
                await self.fail(e)
        except SessionClosed:
            pass
        except Exception:  # a bug here must not take the server down, nor leave the client guessing
            log.exception("session %s: internal error", self.id)
            with contextlib.suppress(SessionClosed):
                await self.fail(ProtocolError(ErrorCode.INTERNAL_ERROR, "internal error", fatal=True))

    async def _dispatch(self, m: p.ClientMessage) -> None:
        if type(m) is p.TextAppend and self.started:  # the most frequent message first
            await self._append(m)
            return
        if isinstance(m, p.Unknown):
            return
        if isinstance(m, p.Ping):
            await self._send(p.Pong(m.id))
            return
        if isinstance(m, p.SessionEnd):
            await self.close(1000, "session.end")
            return
        if isinstance(m, p.SessionStart):
            if self.started:
                raise ProtocolError(ErrorCode.ALREADY_STARTED, "session.start was already received; "
                                    "use session.update to change settings")
            await self._apply_settings(m.voice, m.output, m.chunking, m.generation, set_voice=True)
            self.started = True
            await self._send(p.SessionStarted(
                session_id=self.id, output=asdict(self.fmt), chunking=_to_dict(self.chunking),
                generation=asdict(self.generation), voice=self.voice,
                model={"name": self.model_info.name, "sample_rate": self.model_rate,
                       "patch_ms": getattr(self.model_info, "patch_ms", None), "demo": self.model_info.is_demo},
                limits=self.limits.to_dict()))
            return
        if not self.started:
            raise ProtocolError(ErrorCode.NOT_STARTED, f"send session.start before {type(m).TYPE}",
                                context_id=getattr(m, "context_id", None))
        if isinstance(m, p.SessionUpdate):
            await self._apply_settings(m.voice, m.output, m.chunking, m.generation, set_voice=m.has_voice)
            await self._send(p.SessionUpdated(output=asdict(self.fmt), chunking=_to_dict(self.chunking),
                                              generation=asdict(self.generation), voice=self.voice))
        elif isinstance(m, p.TextAppend):
            await self._append(m)
        elif isinstance(m, p.TextFlush):
            turn = self._turn(m.context_id)
            if turn.ended:
                raise ProtocolError(ErrorCode.CONTEXT_CLOSED, f"context {m.context_id!r} was ended: everything "
                                    "is being spoken already", context_id=m.context_id)
            self._in_order(turn, TextOp("flush", m.flush_id))
        elif isinstance(m, p.ContextEnd):
            turn = self._turn(m.context_id)
            if not turn.ended:
                turn.ended = True
                self._in_order(turn, TextOp("end"))  # the segment timer stops: nothing is left for it to do
        elif isinstance(m, p.ContextCancel):
            await self._cancel(m.context_id)
        elif isinstance(m, p.PlaybackPosition):
            turn = self.turns.get(m.context_id) or self.finished.get(m.context_id)
            if turn is None:
                raise ProtocolError(ErrorCode.UNKNOWN_CONTEXT, f"no context {m.context_id!r}",
                                    context_id=m.context_id)
            turn.playout.position(m.played_ms, self.clock())
            self._report_buffered(turn, force=True)

    def is_live(self, context_id: str) -> bool:
        """Whether the context is a turn still running: after an error naming it, False when the error ended it."""
        return context_id in self.turns

    def _turn(self, context_id: str) -> Turn:
        turn = self.turns.get(context_id)
        if turn is None:
            raise ProtocolError(ErrorCode.UNKNOWN_CONTEXT, f"no active context {context_id!r}", context_id=context_id)
        return turn

    async def _append(self, m: p.TextAppend) -> None:
        turn = self.turns.get(m.context_id)
        opened = turn is None
        if turn is None:
            turn = self._open_turn(m.context_id)
        try:
            if turn.ended:
                raise ProtocolError(ErrorCode.CONTEXT_CLOSED, f"context {m.context_id!r} was ended; open a new one",
                                    context_id=m.context_id)
            if len(turn.text) - turn.sent_chars() + len(m.text) > self.limits.max_buffered_chars:
                raise ProtocolError(ErrorCode.BUFFER_FULL, f"more than {self.limits.max_buffered_chars} characters "
                                    "waiting to be spoken in this context; send more once audio has gone out",
                                    context_id=m.context_id)
            if turn.t_first_text is None and m.text and not m.text.isspace():  # (no stripped copy)
                turn.t_first_text = self._message_at
                turn.text_queued_ms = (self.last_activity - self._message_at) * 1000.0
            turn.text += m.text
            self._in_order(turn, TextOp("push", m.text))
        finally:
            if opened:  # context.started and the turn's task after the engine request is out, in the loop's lane
                self.metrics.turns.inc()  # counted once the request is out (a Prometheus inc takes a lock)
                self._unannounced.append(turn)
                turn.begin = lane().defer(self._begin_turn, turn, queues_s=TASK_START_S)

    def _open_turn(self, context_id: str) -> Turn:
        if self.draining:
            raise ProtocolError(ErrorCode.SERVER_SHUTDOWN, "the server is shutting down; no new turns",
                                context_id=context_id)
        if len(self.turns) >= self.limits.max_contexts:
            raise ProtocolError(ErrorCode.TOO_MANY_CONTEXTS, f"at most {self.limits.max_contexts} concurrent "
                                "contexts per session; end or cancel one first", context_id=context_id)
        index, self.next_index = self.next_index, (self.next_index + 1) & 0xFFFF
        lead = self.config.max_lead_ms_telephony if self.fmt.format in TELEPHONY_FORMATS else self.config.max_lead_ms
        turn = Turn(id=context_id, index=index, fmt=self.fmt, voice=self.voice, generation=self.generation,
                    continues=self.generation.continuation and not self.voice_is_prompt,
                    segmenter=Segmenter(self.chunking, self.clock, self.generation.normalize, self.rewrite),
                    max_lead_ms=lead,
                    pipeline_chunks=self.config.pipeline_chunks,
                    encode_site=encode_site(self.fmt))
        self.finished.pop(context_id, None)
        self.turns[context_id] = turn  # from here on, closing the session cancels what the turn started
        return turn

    def _begin_turn(self, turn: Turn) -> None:
        """The turn's synthesis task, which sends its context.started first (`_announce`; nothing of the turn can be
        sent before it); its sender task starts when audio first has to wait for pacing (`_hand_over`). Deferred to
        the loop's lane: in a burst of new turns, every turn's engine request goes out first."""
        turn.begin = None
        if self.closed or self.turns.get(turn.id) is not turn:  # stopped meanwhile (`_stop_turn`)
            return
        turn.tasks.append(asyncio.create_task(self._synthesise(turn)))

    async def _announce(self) -> None:
        """The context.started messages still deferred, in the order their turns opened."""
        while self._unannounced:
            turn = self._unannounced.popleft()
            await self._guard(self.sink.message(p.ContextStarted(turn.id, turn.index, _output_dict(turn.fmt))))

    def _release(self, turn: Turn, segments: list[Segment]) -> None:
        """Hand released segments to the synthesis task. When it is idle (the previous segment done, nothing
        queued), the first one's engine request goes out right here, in the handler of the message that released
        it: through the synthesis task it would wait behind every other ready callback, and in a burst of new turns
        that is every other session's message handling (measured: ~6 ms p50 of the gateway's TTFB share at 64)."""
        for seg in segments:
            if turn.idle and turn.segments.empty() and not self.closed:
                turn.idle = False
                turn.segments.put_nowait(self._start(turn, seg))
            else:
                turn.segments.put_nowait(seg)

    def _start(self, turn: Turn, seg: Segment) -> _Started:
        """Send one segment's request to the engine (`generate` sends it), with the turn's continuation prompt."""
        gen = turn.generation
        now = self.clock()
        turn.request_id = f"{self.id}:{turn.id}:{seg.index}"
        kwargs: dict[str, Any] = dict(voice=turn.voice, cfg_value=gen.cfg_value, temperature=gen.temperature,
                                      seed=gen.seed, max_length=gen.max_length, timesteps=gen.timesteps,
                                      request_id=turn.request_id)
        if self.tenant is not None:
            kwargs["tenant"] = self.tenant
        if turn.prompt is not None:
            kwargs.update(prompt_latents=turn.prompt[0], prompt_text=turn.prompt[1])
        elif gen.instruction and gen.instruction.strip():
            # only segments without a continuation prompt (the official rule): a turn's first, or every one with
            # continuation off; later ones continue from the designed voice's audio
            kwargs["instruction"] = gen.instruction
        lead_ms = turn.playout.buffered_ms(now)
        try:
            stream = self.engine.generate(seg.speak(), **kwargs)
        except Exception as e:  # reported by the synthesis task, after the segments before it (`_generate`)
            return _Started(seg, None, now, lead_ms, error=e)
        started = _Started(seg, stream, now, lead_ms)
        self.arm_first_chunk(turn, started)
        return started

    def _retire(self, turn: Turn) -> None:
        self.turns.pop(turn.id, None)
        self.finished[turn.id] = turn
        while len(self.finished) > self.config.finished_turns_kept:
            self.finished.popitem(last=False)

    # ------------------------------------------------------------------------------------------------ stopping

    async def _stop_turn(self, turn: Turn) -> None:
        """Cancel the turn's tasks; the synthesis task closes its engine stream, which cancels the request."""
        self._settle(turn)
        self._stop_timer(turn)
        if turn.head is not None and turn.head.future is not None:  # no frame of it is written from here on
            turn.head.future.cancel()  # (`_head_answered`); its task's `_drop_head` sees to the rest
        if turn.begin is not None:  # its synthesis task was never started: nothing of it is left to run
            turn.begin.cancel()
            turn.begin = None
        me = asyncio.current_task()
        tasks = [t for t in turn.tasks if t is not me]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        while not turn.segments.empty():  # a request its handler started that the synthesis task never read
            item = turn.segments.get_nowait()
            if isinstance(item, _Started):
                await _aclose(item.stream)
        if turn.request_id is not None:
            with contextlib.suppress(Exception):
                await self.engine.cancel(turn.request_id)
        self._retire(turn)

    async def _cancel(self, context_id: str) -> None:
        turn = self.turns.get(context_id)
        if turn is None:
            turn = self.finished.get(context_id)
            if turn is None:
                raise ProtocolError(ErrorCode.UNKNOWN_CONTEXT, f"no context {context_id!r}", context_id=context_id)
        else:
            await self._stop_turn(turn)
            self.metrics.turns_done.labels(outcome="cancelled").inc()
        played = turn.playout.played_ms(self.clock())
        texts = [s.text for s in turn.segmenter.segments] + [turn.segmenter.pending_text]
        spoken, remaining = split_heard(texts, turn.audio, played)
        await self._send(p.ContextCancelled(
            context_id, audio_sent_ms=round(turn.playout.sent_ms, 1), audio_played_ms=round(played, 1),
            played_source="client" if turn.playout.client_reported else "estimate", text_spoken=spoken,
            text_remaining=remaining))

    def _turn_failed(self, turn: Turn, part: str) -> None:
        """A bug in one of the turn's parts (called from its `except`): logged, and the turn ends with internal_error;
        the session and its other turns go on, and its client is not left waiting for audio that never comes."""
        log.exception("session %s context %s: %s failed", self.id, turn.id, part)
        self._background(self._abort_turn(turn, ProtocolError(ErrorCode.INTERNAL_ERROR, "internal error",
                                                              context_id=turn.id)))

    async def _abort_turn(self, turn: Turn, error: ProtocolError) -> None:
        await self._stop_turn(turn)
        self.metrics.turns_done.labels(outcome="error").inc()
        await self.fail(error)

    async def _watch_idle(self) -> None:
        timeout = self.limits.idle_timeout_s
        while not self.closed:
            if self.turns:  # a turn that is speaking is activity
                self.last_activity = self.clock()
            idle = self.clock() - self.last_activity
            if idle >= timeout:
                await self.fail(ProtocolError(ErrorCode.IDLE_TIMEOUT, f"no message for {timeout:g} s; "
                                              "send ping to keep an idle session open", fatal=True))
                return
            await asyncio.sleep(min(1.0, timeout - idle + 0.01))

    # ------------------------------------------------------------------------------------------------ output

    async def _send(self, message: p.ServerMessage) -> None:
        await self._guarded(self.sink.message(message))

    async def _send_audio_packets(self, packets: AudioPackets) -> None:
        """A batch of frames under one stall timeout (one write where the sink can batch)."""
        await self._guarded(self.sink.audio(packets))

    async def _guarded(self, send: Any) -> None:
        """A send after the context.started messages still deferred (`_announce`)."""
        if self._unannounced and not self.closed:
            try:
                await self._announce()
            except BaseException:
                send.close()
                raise
        await self._guard(send)

    async def _guard(self, send: Any) -> None:
        """A send that cannot complete within the stall timeout means the client stopped reading."""
        if self.closed:
            send.close()
            raise SessionClosed
        if self._send_ready is not None and self._send_ready():
            # the socket takes it at once: no stall timer to arm and cancel (a timer per send is ~10 us of loop time)
            try:
                await send
            except (ConnectionError, RuntimeError):
                self._background(self.close(1006, "connection lost"))
                raise SessionClosed from None
            return
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that races a finished send
            async with asyncio.timeout(self.limits.slow_consumer_timeout_s):
                await send
        except TimeoutError:
            self.drop_slow_consumer()
            raise SessionClosed from None
        except (ConnectionError, RuntimeError):  # the connection is gone: wind the session down
            self._background(self.close(1006, "connection lost"))
            raise SessionClosed from None

    def drop_slow_consumer(self) -> None:
        """The client stopped reading (a send, or the socket's read-lag probe, waited slow_consumer_timeout_s): drop
        the connection (its buffers are full: an error message could not get through either) and wind down."""
        if self.closed or self._dropped:
            return
        self._dropped = True
        self.metrics.errors.labels(code=str(ErrorCode.SLOW_CONSUMER)).inc()
        log.info("session %s: slow consumer, closing", self.id)
        self.sink.abort()
        self._background(self.close(1008, str(ErrorCode.SLOW_CONSUMER)))

    def _background(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # keep a reference until done
        task.add_done_callback(self._tasks.discard)



@functools.lru_cache(maxsize=64)
def _output_dict(fmt: OutputFormat) -> dict[str, Any]:
    """`context.started` "output": one dict per format (read only), not a deep copy per turn."""
    return asdict(fmt)


def _to_dict(cfg: Any) -> dict[str, Any]:
    to_dict = getattr(cfg, "to_dict", None)
    return to_dict() if to_dict is not None else asdict(cfg)
