"""One client session of the native protocol: turns (contexts), their segments in flight, pacing against the
client's playout, cancellation with a heard report, limits. Talks to the engine through its async API and to the
client through a `Transport`; knows nothing about aiohttp."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from engine import errors as engine_errors
from gateway import protocol as p
from gateway.audio import Encoder, OutputFormat, opus_available
from gateway.metrics import GatewayMetrics
from gateway.offload import OffloadPool, shared_pool
from gateway.protocol import ErrorCode, ProtocolError
from gateway.segmenter import ChunkingConfig, Segment, Segmenter

log = logging.getLogger("voxgate.session")

TELEPHONY_FORMATS = ("mulaw", "alaw")
REPORT_INTERVAL_S = 0.1  # how often a turn tells the engine's scheduler how much audio its listener has queued
# Once the client holds max_lead_ms, sending resumes only when this much fits again, then goes out as one write:
# one wakeup per ~engine chunk (160 ms) per stream instead of one per 20 ms frame.
PACE_QUANTUM_MS = 160.0
# Formats whose encoding is worth a thread hop (libopus: ~0.9 ms per 160 ms chunk at 48 kHz, without the GIL). PCM and
# G.711 cost ~0.05 ms per chunk: cheaper on the loop than any hop.
OFFLOADED_FORMATS = ("opus",)
# A turn's first chunk is encoded in two pool calls: HEAD_FRAMES frames (sent as soon as they are encoded), then the
# rest (`Session._encode_chunk`). A burst of new turns then gets every turn's first audio out before anyone's rest.
# Later chunks stay one call: splitting every short listener's chunk doubles the event loop's hops and writes,
# which at hundreds of Opus sessions adds loop lag and underruns instead of removing them.
# Two frames, not one: 20 ms would be spent before the rest of a burst is encoded.
HEAD_FRAMES = 2


class SessionClosed(Exception):
    """The connection is gone (or being closed): stop what you are doing."""


# a session's view of the stored voices: the engine voice id its key may speak with, or None (unknown to it)
VoiceResolver = Callable[[str], Awaitable[str | None]]
# pronunciation dictionary ids -> the rewrite they make (None for none); ProtocolError for an id the key may not use
PronunciationResolver = Callable[[list[str]], Awaitable[Callable[[str], str] | None]]


class Transport(Protocol):
    """How a session reaches its client; sends may block while the client is not reading."""

    async def send_text(self, data: str) -> None: ...

    async def send_bytes(self, data: bytes) -> None: ...

    # optional: `async def send_frames(self, frames: list[bytes]) -> None`, several binary messages in one write;
    # without it the session calls send_bytes per frame.
    # optional: `def send_ready(self) -> bool`, True when a send now completes without waiting for the client

    async def close(self, code: int, reason: str) -> None: ...

    def abort(self) -> None: ...


@dataclass(frozen=True)
class SessionConfig:
    limits: p.Limits = p.Limits()
    max_lead_ms: float = 1500.0  # audio sent ahead of the client's playout
    max_lead_ms_telephony: float = 500.0  # mulaw / alaw: phone gateways buffer little and clear on barge-in
    pipeline_chunks: int = 16  # engine chunks encoded ahead of sending, per turn (the synthesis pipeline bound)
    finished_turns_kept: int = 8  # for late playback.position / context.cancel after context.done


# queue items from a turn's synthesis task to its sender task, in audio order
@dataclass
class _Packets:
    """Consecutive encoded frames (about one engine chunk), sent together when pacing allows."""

    payloads: list[bytes]
    last: bool = False  # ends with the turn's last frame


@dataclass
class _SegmentMark:
    segment: Segment
    pts_ms: float
    released_at: float


@dataclass
class _Started:
    """A segment whose engine request is out (`Session._start`): its stream, when it went out and what the listener
    had queued then."""

    segment: Segment
    stream: Any
    t0: float
    lead_ms: float
    error: Exception | None = None  # what engine.generate() raised: reported by the synthesis task, in order


# segments: items from the message handlers to a turn's synthesis task, in text order
@dataclass
class _FlushMark:
    flush_id: str | None


@dataclass
class _EndMark:
    pass


@dataclass
class SegmentAudio:
    text: str
    start_ms: float
    end_ms: float | None = None  # known once all its audio is queued


@dataclass
class SegmentTiming:
    """Where one segment's synthesis sat in its turn, reported in `context.done` metrics as `segment_log`: tells a
    segment that was started too late (little `lead_ms`) from an engine that fell behind (`max_wait_ms`)."""

    segment: int
    submit_ms: float  # the turn's first text -> the segment submitted to the engine
    lead_ms: float  # audio the listener had queued then (at the client and here): the time the engine has
    engine_ttfb_ms: float | None = None  # submitted -> its first chunk
    done_ms: float | None = None  # the turn's first text -> its last chunk received from the engine
    max_wait_ms: float = 0.0  # the longest wait for one of its later chunks (the engine, not the listener, was late)
    max_wait_end_ms: float | None = None  # the turn's first text -> when that wait ended
    patches: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {k: round(v, 1) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass
class Turn:
    """One context: text in, audio out, in order."""

    id: str
    index: int
    fmt: OutputFormat
    voice: str | None
    generation: p.GenerationSettings
    segmenter: Segmenter
    max_lead_ms: float
    # made by the synthesis task, off the path from a turn's first text to its engine request (a soxr stream costs
    # ~50 us: in a burst of new turns, every one of them waits for the others' set-up)
    encoder: Encoder | None = None
    offload: OffloadPool | None = None  # where encoding runs: a thread pool, or None for on the loop
    segments: asyncio.Queue = field(default_factory=asyncio.Queue)  # Segment | _Started | _FlushMark | _EndMark
    # the synthesis task waits for a segment with the previous one done (its continuation prompt known): the next
    # released segment goes to the engine from the handler that released it (`Session._release`)
    idle: bool = True
    prompt: tuple[np.ndarray, str] | None = None  # the next segment's continuation prompt: (latents, text)
    continues: bool = True  # later segments continue from the one before (off: setting, or a prompt voice)
    frames: asyncio.Queue = field(default_factory=asyncio.Queue)  # _Packets | marks; bounded by the session
    tasks: list[asyncio.Task] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # new text: re-read the segmenter's deadline
    text: str = ""  # everything appended
    ended: bool = False
    seq: int = 0
    request_id: str | None = None
    queued_ms: float = 0.0  # encoded, not yet sent
    held: bytes | None = None  # the newest encoded frame, held back until the next (or the end) is known
    sending: bool = False  # an item of `frames` (or a batch the synthesis task sends itself) is being sent
    reported_at: float = 0.0  # last update_buffered to the engine
    fed_ms: float = 0.0  # audio produced by the engine so far
    audio: list[SegmentAudio] = field(default_factory=list)
    # pacing: the client's playout is modelled as real time from (t_play, play_base_ms), capped at what was sent
    sent_ms: float = 0.0
    t_play: float | None = None
    play_base_ms: float = 0.0
    client_reported: bool = False
    # metrics
    t_first_text: float | None = None
    t_first_audio: float | None = None
    engine_ttfb_ms: float | None = None
    later_ttfb_ms: list[float] = field(default_factory=list)  # engine TTFB of segments after the first
    segment_log: list[SegmentTiming] = field(default_factory=list)
    engine_s: float = 0.0
    max_gap_ms: float = 0.0
    segment_released_at: float = 0.0  # when the segment being sent left the segmenter

    def sent_chars(self) -> int:
        """Characters of segments whose audio has all been sent."""
        return sum(len(a.text) for a in self.audio if a.end_ms is not None and a.end_ms <= self.sent_ms)

    def played_ms(self, now: float) -> float:
        if self.t_play is None:
            return 0.0
        return min(self.sent_ms, self.play_base_ms + (now - self.t_play) * 1000.0)

    def buffered_ms(self, now: float) -> float:
        """Audio the listener has or will have before it runs dry: queued at the client plus queued here."""
        return self.sent_ms - self.played_ms(now) + self.queued_ms


class Session:
    """Drive with `receive()` per client frame; `close()` when the connection ends."""

    def __init__(self, engine: Any, transport: Transport, config: SessionConfig = SessionConfig(), *,
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
        self.transport = transport
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
        self._send_ready: Callable[[], bool] | None = getattr(transport, "send_ready", None)
        self._tasks: set[asyncio.Task] = set()
        self._dropped = False  # drop_slow_consumer ran

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
        if self._watchdog is not None and self._watchdog is not asyncio.current_task():
            self._watchdog.cancel()
        for turn in list(self.turns.values()):
            await self._stop_turn(turn)
            self.metrics.turns_done.labels(outcome="disconnected").inc()  # the session ended under it
        try:
            async with asyncio.timeout(1.0):
                await self.transport.close(code, reason)
        except TimeoutError:  # a client that does not read would hold the connection open with our unsent bytes
            self.transport.abort()
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
                    await self.transport.send_text(error.to_message().encode())
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

    async def receive(self, raw: str | bytes) -> None:
        """Handle one frame from the client."""
        if self.closed:
            return
        self.last_activity = self.clock()
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
            self._release(turn, turn.segmenter.flush())
            turn.segments.put_nowait(_FlushMark(m.flush_id))
        elif isinstance(m, p.ContextEnd):
            turn = self._turn(m.context_id)
            if not turn.ended:
                turn.ended = True
                self._release(turn, turn.segmenter.end())
                turn.segments.put_nowait(_EndMark())
                turn.wake.set()  # the segment timer has nothing left to do
        elif isinstance(m, p.ContextCancel):
            await self._cancel(m.context_id)
        elif isinstance(m, p.PlaybackPosition):
            turn = self.turns.get(m.context_id) or self.finished.get(m.context_id)
            if turn is None:
                raise ProtocolError(ErrorCode.UNKNOWN_CONTEXT, f"no context {m.context_id!r}",
                                    context_id=m.context_id)
            turn.play_base_ms = min(m.played_ms, turn.sent_ms)
            turn.t_play = self.clock()
            turn.client_reported = True
            self._report_buffered(turn, force=True)

    async def _apply_settings(self, voice: str | None, output: dict | None, chunking: dict | None,
                              generation: dict | None, set_voice: bool) -> None:
        try:
            fmt = self.fmt if output is None else OutputFormat.from_dict(output, self.model_rate)
            chunk_cfg = self.chunking if chunking is None else _chunking_from_dict(chunking)
        except (ValueError, TypeError) as e:
            raise ProtocolError(ErrorCode.INVALID_VALUE, str(e)) from None
        if fmt.kind == 0:
            raise ProtocolError(ErrorCode.INVALID_VALUE, f"output.format {fmt.format!r} is for HTTP streaming; "
                                "the WebSocket sends opus, pcm_s16le, mulaw or alaw frames")
        if fmt.format == "opus":
            try:
                opus_available()
            except RuntimeError as e:  # libopus missing: the message says how to fix it, or to ask for PCM
                raise ProtocolError(ErrorCode.INVALID_VALUE, str(e)) from None
        if generation is not None:
            p.check_generation(generation, ranges=self.sampling_ranges)
        gen = self.generation if generation is None else self.generation.merged(generation)
        resolved = await self._resolve_voice(voice) if set_voice and voice is not None else None
        if set_voice and voice is not None and resolved is None:
            raise ProtocolError(ErrorCode.UNKNOWN_VOICE, f"no stored voice {voice!r}; create one with POST /v1/voices")
        is_prompt = (resolved is not None and resolved[1]) if set_voice else self.voice_is_prompt
        if is_prompt and gen.instruction and gen.instruction.strip():
            raise ProtocolError(ErrorCode.INVALID_VALUE, "generation.instruction cannot be used with a prompt voice "
                                "(VoxCPM 0.5B/1.5): the voice is a prompt, and an instruction never comes with one")
        rewrite = self.rewrite
        if generation is not None and "pronunciations" in generation:
            rewrite = await self._resolve_pronunciations(list(gen.pronunciations))
        self.fmt, self.chunking, self.generation, self.rewrite = fmt, chunk_cfg, gen, rewrite
        if set_voice:
            self.voice = voice
            self.voice_is_prompt = is_prompt

    async def _resolve_pronunciations(self, ids: list[str]) -> Callable[[str], str] | None:
        if not ids:
            return None
        if self.pronunciations is None:
            raise ProtocolError(ErrorCode.UNKNOWN_PRONUNCIATION, "this server keeps no pronunciation dictionaries")
        return await self.pronunciations(ids)

    async def _resolve_voice(self, voice: str) -> tuple[str, bool] | None:
        """The engine voice this session may speak with under `voice`, and whether it is a prompt voice (VoxCPM
        0.5B/1.5: every segment's prompt itself, so its turns take no continuation prompt); None if unknown."""
        found = await self.voices(voice) if self.voices is not None else voice
        if found is None:
            return None
        modes = await stored_voices(self.engine)
        if self.voices is None and found not in modes:
            return None
        return found, modes.get(found) == "prompt"

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
            if turn.t_first_text is None and m.text.strip():
                turn.t_first_text = self.clock()
            turn.text += m.text
            turn.segmenter.set_queued_audio_ms(turn.buffered_ms(self.clock()))
            self._release(turn, turn.segmenter.push(m.text))  # a first segment's engine request leaves here
            turn.wake.set()
        finally:
            if opened:  # context.started (and the turn's tasks) only after the engine request is out
                await self._begin_turn(turn)

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
                    frames=asyncio.Queue(self.config.pipeline_chunks),
                    offload=shared_pool() if self.fmt.format in OFFLOADED_FORMATS else None)
        self.finished.pop(context_id, None)
        self.turns[context_id] = turn  # from here on, closing the session cancels what the turn started
        self.metrics.turns.inc()
        return turn

    async def _begin_turn(self, turn: Turn) -> None:
        """context.started, then the turn's tasks (so nothing of the turn can be sent before it)."""
        await self._send(p.ContextStarted(turn.id, turn.index, _output_dict(turn.fmt)))
        turn.tasks = [asyncio.create_task(self._synthesise(turn)), asyncio.create_task(self._send_audio(turn)),
                      asyncio.create_task(self._segment_timer(turn))]

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
        lead_ms = turn.buffered_ms(now)
        try:
            stream = self.engine.generate(seg.speak(), **kwargs)
        except Exception as e:  # reported by the synthesis task, after the segments before it (`_generate`)
            return _Started(seg, None, now, lead_ms, error=e)
        return _Started(seg, stream, now, lead_ms)

    # ------------------------------------------------------------------------------------------------ turn tasks

    async def _segment_timer(self, turn: Turn) -> None:
        """Let time-based segment boundaries fire (the first segment leaves after max_delay_ms without a clause)."""
        while not turn.ended:
            deadline = turn.segmenter.next_deadline()
            turn.wake.clear()
            timeout = None if deadline is None else max(0.0, deadline - self.clock())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await turn.wake.wait()
            if deadline is not None and not turn.ended and self.clock() >= deadline:
                turn.segmenter.set_queued_audio_ms(turn.buffered_ms(self.clock()))
                self._release(turn, turn.segmenter.poll())

    async def _synthesise(self, turn: Turn) -> None:
        """Segments in order through the engine; encoded audio into the bounded frame queue."""
        gen = turn.generation
        try:
            turn.encoder = Encoder(turn.fmt, self.model_rate)
            while True:
                if turn.segments.empty():
                    turn.idle = True  # the next released segment is started by its handler (`_release`)
                item = await turn.segments.get()
                turn.idle = False
                if isinstance(item, _FlushMark):
                    await self._drain(turn)
                    await self._release_held(turn)
                    await turn.frames.put(item)
                    continue
                if isinstance(item, _EndMark):
                    await self._queue_packets(turn, await self._encode(turn, None), last=True)
                    await turn.frames.put(item)
                    return
                if isinstance(item, _Started):  # its request went out when it was released
                    started = item
                    try:
                        await turn.frames.put(_SegmentMark(item.segment, turn.fed_ms, item.t0))
                    except BaseException:  # stopped while the frame queue was full: nothing else will close it
                        await _aclose(item.stream)
                        raise
                else:  # the mark first: a full frame queue (plenty queued for the listener) holds the request back
                    await turn.frames.put(_SegmentMark(item, turn.fed_ms, self.clock()))
                    started = self._start(turn, item)
                seg = started.segment
                seg_audio = SegmentAudio(seg.text, turn.fed_ms)
                turn.audio.append(seg_audio)
                latents = await self._generate(turn, started)
                seg_audio.end_ms = turn.fed_ms
                if turn.continues and latents:
                    turn.prompt = (np.stack(latents)[-gen.continuation_patches:], seg.speak())  # [T, P, D]
        except ProtocolError as e:
            e.context_id = turn.id
            self._background(self._abort_turn(turn, e))
        except SessionClosed:
            pass
        except Exception:
            log.exception("session %s context %s: synthesis failed", self.id, turn.id)
            self._background(self._abort_turn(turn, ProtocolError(ErrorCode.INTERNAL_ERROR, "internal error",
                                                                  context_id=turn.id)))

    async def _generate(self, turn: Turn, started: _Started) -> list[np.ndarray]:
        """Read one segment's stream to its end, encoding and queueing its audio; its latents (the next prompt)."""
        seg = started.segment
        timing = SegmentTiming(seg.index, self._turn_ms(turn, started.t0), started.lead_ms)
        turn.segment_log.append(timing)
        latents: list[np.ndarray] = []
        stream = started.stream
        try:
            if started.error is not None:
                raise started.error
            first = True
            while True:
                # only the time spent waiting for the engine counts towards RTF, not waits for the listener; the
                # first chunk is waited for since the request went out
                t0 = started.t0 if first else self.clock()
                try:
                    chunk = await anext(stream)
                except StopAsyncIteration:
                    break
                finally:
                    t1 = self.clock()
                    turn.engine_s += t1 - t0
                wait_ms = (t1 - t0) * 1000.0
                timing.patches += 1
                if chunk.is_last:
                    timing.done_ms = self._turn_ms(turn, t1)
                if first:
                    first = False
                    timing.engine_ttfb_ms = wait_ms
                    if turn.engine_ttfb_ms is None:
                        turn.engine_ttfb_ms = wait_ms
                        self.metrics.engine_ttfb.observe(wait_ms / 1000.0)
                    else:  # continuation prompts make these longer: measured to keep that cost visible
                        turn.later_ttfb_ms.append(wait_ms)
                elif wait_ms > timing.max_wait_ms:
                    timing.max_wait_ms, timing.max_wait_end_ms = wait_ms, self._turn_ms(turn, t1)
                if chunk.latents is not None:
                    latents.append(np.asarray(chunk.latents))
                turn.fed_ms += len(chunk.audio) * 1000.0 / self.model_rate
                await self._encode_chunk(turn, chunk.audio)
        except engine_errors.InvalidRequest as e:
            code = ErrorCode.UNKNOWN_VOICE if isinstance(e, engine_errors.UnknownVoice) else ErrorCode.INVALID_VALUE
            raise ProtocolError(code, f"segment {seg.index} ({seg.text[:40]!r}): {e}") from None
        except engine_errors.TenantOverloaded as e:
            raise ProtocolError(ErrorCode.RATE_LIMITED, f"too many prompts of this API key queued: {e}") from None
        except engine_errors.EngineOverloaded as e:
            raise ProtocolError(ErrorCode.OVERLOADED, f"the engine is at capacity, retry shortly: {e}") from None
        except engine_errors.EngineError as e:
            raise ProtocolError(ErrorCode.ENGINE_ERROR, f"{type(e).__name__}: {e}") from None
        finally:
            await _aclose(stream)  # cancels the engine request when we stop early
        return latents

    def _turn_ms(self, turn: Turn, now: float) -> float:
        """Milliseconds since the turn's first text (the origin of its TTFB)."""
        return (now - turn.t_first_text) * 1000.0 if turn.t_first_text is not None else 0.0

    async def _encode(self, turn: Turn, pcm: np.ndarray | None) -> list[bytes]:
        """One engine chunk (None: the turn's end) -> frames. Opus goes to the shared thread pool, one hop per chunk
        (libopus runs without the GIL, so one gateway process spreads hundreds of streams over all cores; a turn's
        first chunk takes two: `_encode_chunk`); the cheap formats are encoded right here."""
        encoder = turn.encoder
        assert encoder is not None  # made when the synthesis task starts, before anything is encoded
        work = encoder.finish if pcm is None else encoder.encode
        args = () if pcm is None else (pcm,)
        if turn.offload is not None:
            return await turn.offload.run(work, *args, urgency=turn.buffered_ms(self.clock()))
        return work(*args)

    async def _drain(self, turn: Turn) -> None:
        """A flush: the audio still inside the encoder (resampler tail, partial frame) queued before the flush's
        answer, so text.flushed follows the flush's last audio; the silence padding the last frame counts as fed."""
        encoder = turn.encoder
        assert encoder is not None  # made when the synthesis task starts, before anything is encoded
        if turn.offload is not None:
            frames, padding = await turn.offload.run(encoder.drain, urgency=turn.buffered_ms(self.clock()))
        else:
            frames, padding = encoder.drain()
        turn.fed_ms += padding * 1000.0 / turn.fmt.sample_rate
        await self._queue_packets(turn, frames)

    async def _encode_chunk(self, turn: Turn, pcm: np.ndarray) -> None:
        """One engine chunk -> its frames queued. A turn's first offloaded chunk is two calls, one after the other
        (the encoder is not thread-safe): its first frames, queued as soon as they are encoded, then the rest. A
        burst of new turns arrives in one engine step and the pool runs each loop iteration's calls most urgent
        first on FIFO threads, so every new turn's first frames are encoded before anyone's rest."""
        encoder = turn.encoder
        assert encoder is not None  # made when the synthesis task starts, before anything is encoded
        step = max(1, self.model_rate * turn.fmt.frame_ms // 1000)  # one frame's time in model-rate samples
        # `_queue_packets` holds the newest frame back (it may be the turn's last): HEAD_FRAMES leave only when the
        # head brings one more than that (a first chunk has no earlier frame held back to go with them)
        frames = HEAD_FRAMES + 1
        if turn.offload is None or turn.queued_ms or len(pcm) <= frames * step:  # not a first chunk to split
            await self._queue_packets(turn, await self._encode(turn, pcm))
            return
        buffered = turn.buffered_ms(self.clock())
        head, used = await turn.offload.run(_encode_head, encoder, pcm, frames, step, urgency=buffered)
        # what the listener has once the head is out; counted before `_queue_packets` takes the list over (and pops)
        urgency = buffered + len(head) * turn.fmt.frame_ms
        await self._queue_packets(turn, head)
        if used < len(pcm):
            await self._queue_packets(turn, await turn.offload.run(encoder.encode, pcm[used:], urgency=urgency))

    async def _queue_packets(self, turn: Turn, payloads: list[bytes], last: bool = False) -> None:
        """Queue the chunk's frames as one batch, holding the newest frame back (until the next chunk or the end is
        known) so the turn's last frame can carry FLAG_LAST. Frames are whole: the encoder pads the end."""
        turn.queued_ms += len(payloads) * turn.fmt.frame_ms
        batch = payloads if turn.held is None else [turn.held, *payloads]
        turn.held = None if last or not batch else batch.pop()
        if not batch:
            return
        packets = _Packets(batch, last)
        if not turn.sending and turn.frames.empty() and self._fits_now(turn, len(batch)):
            # nothing is waiting ahead of these frames and the client has room: send them from here, which saves
            # the sender task's wakeup (per chunk per stream) and, under a burst, lets each turn's audio leave
            # right after its own encoding instead of after every turn's. Only this task queues items, so nothing
            # can slip in between.
            turn.sending = True
            try:
                await self._send_packets(turn, packets)
            finally:
                turn.sending = False
        else:
            await turn.frames.put(packets)

    async def _release_held(self, turn: Turn) -> None:
        if turn.held is not None:
            payload, turn.held = turn.held, None
            await turn.frames.put(_Packets([payload]))

    async def _send_audio(self, turn: Turn) -> None:
        """Paced sending: never more than max_lead_ms ahead of the client's playout."""
        try:
            await self._send_audio_loop(turn)
        except SessionClosed:
            pass
        except Exception:  # a bug here must not leave the client waiting for audio that never comes
            log.exception("session %s context %s: sending failed", self.id, turn.id)
            self._background(self._abort_turn(turn, ProtocolError(ErrorCode.INTERNAL_ERROR, "internal error",
                                                                  context_id=turn.id)))

    async def _send_audio_loop(self, turn: Turn) -> None:
        while True:
            turn.sending = False
            item = await turn.frames.get()
            turn.sending = True
            if isinstance(item, _Packets):
                await self._send_packets(turn, item)
            elif isinstance(item, _SegmentMark):
                turn.segment_released_at = item.released_at
                await self._send(p.SegmentStarted(turn.id, item.segment.index, item.segment.shown(),
                                                  round(item.pts_ms, 1)))
            elif isinstance(item, _FlushMark):
                await self._send(p.TextFlushed(turn.id, item.flush_id, round(turn.sent_ms, 1)))
            elif isinstance(item, _EndMark):
                await self._finish_turn(turn)
                return

    async def _send_packets(self, turn: Turn, item: _Packets) -> None:
        """A batch of frames, in as few writes as pacing allows (usually one)."""
        payloads, frame_ms = item.payloads, turn.fmt.frame_ms
        done = 0
        while done < len(payloads):
            n = await self._pace(turn, len(payloads) - done)
            self._track_playout(turn, self.clock())
            part = payloads[done:done + n]
            done += n
            await self._send_frames(p.pack_frames(turn.fmt.kind, turn.index, turn.seq, turn.sent_ms, frame_ms, part,
                                                  last=item.last and done == len(payloads)))
            turn.seq += n
            turn.sent_ms += n * frame_ms
            turn.queued_ms -= n * frame_ms
            self._report_buffered(turn)

    def _room_ms(self, turn: Turn) -> float:
        """How far sending may still run ahead of the client's playout; frame k (from 0) of what is waiting may go
        now if k * frame_ms <= this. inf before the turn's first audio (playout starts with it) or without a lead
        limit."""
        if turn.t_play is None:
            return math.inf
        return turn.max_lead_ms - (turn.sent_ms - turn.played_ms(self.clock()))

    def _fits_now(self, turn: Turn, frames: int) -> bool:
        return self._room_ms(turn) >= (frames - 1) * turn.fmt.frame_ms

    async def _pace(self, turn: Turn, available: int) -> int:
        """How many of the next `available` frames may go now, waiting while the client is max_lead_ms ahead;
        once it is, sending resumes when PACE_QUANTUM_MS (or all that is available) fits again."""
        frame_ms = turn.fmt.frame_ms
        need = min(available, max(1, int(PACE_QUANTUM_MS // frame_ms)))
        while True:
            room = self._room_ms(turn)
            if room >= (available - 1) * frame_ms:
                return available
            if room >= (need - 1) * frame_ms:
                return int(room // frame_ms) + 1
            await asyncio.sleep(((need - 1) * frame_ms - room) / 1000.0)

    def _track_playout(self, turn: Turn, now: float) -> None:
        if turn.t_play is None:  # first audio of the turn: playout starts now
            turn.t_first_audio = now
            turn.t_play, turn.play_base_ms = now, 0.0
            if turn.t_first_text is not None:
                self.metrics.ttfb.observe(now - turn.t_first_text)
            return
        dry_since = turn.t_play + (turn.sent_ms - turn.play_base_ms) / 1000.0
        if now > dry_since:  # the listener ran out of audio: playout resumes when this packet arrives
            # only count silence the gateway caused, not time spent waiting for the client's text
            waited_from = max(dry_since, turn.segment_released_at)
            gap_ms = max(0.0, (now - waited_from) * 1000.0)
            turn.max_gap_ms = max(turn.max_gap_ms, gap_ms)
            if gap_ms > 0:
                self.metrics.gap.observe(gap_ms / 1000.0)
            turn.t_play, turn.play_base_ms = now, turn.sent_ms

    def _report_buffered(self, turn: Turn, force: bool = False) -> None:
        now = self.clock()
        if turn.request_id is None or (not force and now - turn.reported_at < REPORT_INTERVAL_S):
            return
        turn.reported_at = now
        buffered = turn.buffered_ms(now)
        turn.segmenter.set_queued_audio_ms(buffered)
        with contextlib.suppress(Exception):  # advisory: the scheduler's hint must never break a turn
            self.engine.update_buffered(turn.request_id, buffered)

    async def _finish_turn(self, turn: Turn) -> None:
        for task in turn.tasks:
            if task is not asyncio.current_task():
                task.cancel()  # the segment timer; the synthesis task has already returned
        audio_s = turn.sent_ms / 1000.0
        rtf = turn.engine_s / audio_s if audio_s > 0 else None
        if rtf is not None:
            self.metrics.rtf.observe(rtf)
        ttfb = None
        if turn.t_first_audio is not None and turn.t_first_text is not None:
            ttfb = round((turn.t_first_audio - turn.t_first_text) * 1000.0, 1)
        later = turn.later_ttfb_ms
        metrics = {"ttfb_ms": ttfb, "engine_ttfb_ms": _round(turn.engine_ttfb_ms), "rtf": _round(rtf, 4),
                   "max_gap_ms": round(turn.max_gap_ms, 1), "segments": len(turn.audio),
                   "later_segment_engine_ttfb_ms": _round(sum(later) / len(later)) if later else None,
                   "segment_log": [t.to_dict() for t in turn.segment_log]}
        self._retire(turn)
        self.metrics.turns_done.labels(outcome="done").inc()
        await self._send(p.ContextDone(turn.id, round(turn.sent_ms, 1), metrics))

    def _retire(self, turn: Turn) -> None:
        self.turns.pop(turn.id, None)
        self.finished[turn.id] = turn
        while len(self.finished) > self.config.finished_turns_kept:
            self.finished.popitem(last=False)

    # ------------------------------------------------------------------------------------------------ stopping

    async def _stop_turn(self, turn: Turn) -> None:
        """Cancel the turn's tasks; the synthesis task closes its engine stream, which cancels the request."""
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
        played = turn.played_ms(self.clock())
        texts = [s.text for s in turn.segmenter.segments] + [turn.segmenter.pending_text]
        spoken, remaining = split_heard(texts, turn.audio, played)
        await self._send(p.ContextCancelled(
            context_id, audio_sent_ms=round(turn.sent_ms, 1), audio_played_ms=round(played, 1),
            played_source="client" if turn.client_reported else "estimate", text_spoken=spoken,
            text_remaining=remaining))

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
        await self._guarded(self.transport.send_text(message.encode()))

    async def _send_bytes(self, data: bytes) -> None:
        await self._guarded(self.transport.send_bytes(data))

    async def _send_frames(self, frames: list[bytes]) -> None:
        """Several binary messages under one stall timeout (one write where the transport can batch)."""
        send_frames = getattr(self.transport, "send_frames", None)
        await self._guarded(send_frames(frames) if send_frames is not None else self._send_each(frames))

    async def _send_each(self, frames: list[bytes]) -> None:
        for frame in frames:
            await self.transport.send_bytes(frame)

    async def _guarded(self, send: Any) -> None:
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
        self.transport.abort()
        self._background(self.close(1008, str(ErrorCode.SLOW_CONSUMER)))

    def _background(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # keep a reference until done
        task.add_done_callback(self._tasks.discard)


def split_heard(texts: list[str], audio: list[SegmentAudio], played_ms: float) -> tuple[str, str]:
    """(heard, not heard) text of a turn: whole segments played, and of the segment playing, its played share cut
    back to a word end. `texts` are the turn's segments in order (then any unreleased text); `audio[i]` is where
    segment i's audio lies. A segment still being synthesised counts as unheard: better to repeat than to skip."""
    heard: list[str] = []
    rest: list[str] = []
    for i, text in enumerate(texts):
        seg = audio[i] if i < len(audio) else None
        if rest or seg is None or seg.start_ms >= played_ms or seg.end_ms is None:
            rest.append(text)
        elif played_ms >= seg.end_ms:
            heard.append(text)
        else:
            cut = int(len(text) * (played_ms - seg.start_ms) / max(seg.end_ms - seg.start_ms, 1e-9))
            if cut < len(text) and not text[cut].isspace():
                cut = text.rfind(" ", 0, cut) + 1  # back to the start of the word being spoken
            heard.append(text[:cut].strip())
            rest.append(text[cut:].strip())
    return " ".join(t for t in heard if t), " ".join(t for t in rest if t)


async def stored_voices(engine: Any) -> dict[str, str | None]:
    """The engine's stored voices: id -> mode ("reference", "prompt", "lora"; None when unknown). `list_voices` may
    be sync or async, of VoiceInfo objects or plain ids."""
    voices = engine.list_voices()
    if asyncio.iscoroutine(voices):
        voices = await voices
    return {getattr(v, "voice_id", v): getattr(v, "mode", None) for v in voices}


@functools.lru_cache(maxsize=64)
def _output_dict(fmt: OutputFormat) -> dict[str, Any]:
    """`context.started` "output": one dict per format (read only), not a deep copy per turn."""
    return asdict(fmt)


def _chunking_from_dict(d: dict[str, Any]) -> ChunkingConfig:
    from_dict = getattr(ChunkingConfig, "from_dict", None)
    return from_dict(d) if from_dict is not None else ChunkingConfig(**d)


def _to_dict(cfg: Any) -> dict[str, Any]:
    to_dict = getattr(cfg, "to_dict", None)
    return to_dict() if to_dict is not None else asdict(cfg)


def _round(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)


def _encode_head(encoder: Encoder, pcm: np.ndarray, frames: int, step: int) -> tuple[list[bytes], int]:
    """The start of a chunk until `frames` frames came out (or the chunk ended): (those frames, samples used). A
    resampler's output comes in blocks, so how much input that takes is only known by trying; the encoder is
    streaming (resampler state, frame remainder), so the frames are the same as from one call for the whole chunk."""
    out = encoder.encode(pcm[:frames * step])
    used = frames * step
    while len(out) < frames and used < len(pcm):
        out += encoder.encode(pcm[used:used + step])
        used += step
    return out, min(used, len(pcm))


async def _aclose(stream: Any) -> None:
    """Close an engine stream (None: `generate` raised) whatever it is: a `Generation` cancels its request."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()
