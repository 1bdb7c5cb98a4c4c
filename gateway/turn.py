"""A turn (one context) and its synthesis pipeline: segments in order through the engine, each engine chunk encoded
(off the loop for Opus) and queued for the sender in `gateway.playout`. `TurnPipeline` is a part of `Session`."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from engine import errors as engine_errors
from engine.api import AudioChunk
from gateway import protocol as p
from gateway.audio import OutputFormat
from gateway.encode_site import ON_LOOP, EncodeSite, TurnEncoder
from gateway.loop_lanes import Deferred
from gateway.loop_local import LoopLocal
from gateway.metrics import GatewayMetrics
from gateway.playout_model import Playout
from gateway.protocol import ErrorCode, ProtocolError
from gateway.text.segmenter import Segment, Segmenter
from gateway.turn_report import SegmentAudio, SegmentTiming

if TYPE_CHECKING:
    from gateway.turn_text import TextOp

log = logging.getLogger("voxgate.session")

# A chunk that starts a listener's audio (a turn's first, or a segment's first while the listener has nothing left to
# play) is encoded in two offloaded calls: its first HEAD_FRAMES frames, sent as soon as they are encoded, then the
# rest (`Session._encode_chunk`), which the pool (or encoder process) ranks ahead of every listener with audio queued.
# A burst of N new turns then costs N frame encodes before every turn has audio out, not N whole chunks. Other chunks
# stay one call: splitting every short listener's chunk doubles the event loop's hops and writes, which at hundreds of
# Opus sessions adds loop lag and underruns instead of removing them.
HEAD_FRAMES = 1


class SessionClosed(Exception):
    """The connection is gone (or being closed): stop what you are doing."""



# queue items from a turn's synthesis task to its sender task, in audio order
@dataclass(slots=True)
class _Packets:
    """Consecutive encoded frames (about one engine chunk), sent together when pacing allows."""

    payloads: list[bytes]
    last: bool = False  # ends with the turn's last frame


@dataclass(slots=True)
class _SegmentMark:
    segment: Segment
    pts_ms: float
    released_at: float


@dataclass(slots=True)
class _Started:
    """A segment whose engine request is out (`Session._start`): its stream, when it went out and what the listener
    had queued then."""

    segment: Segment
    stream: Any
    t0: float
    lead_ms: float
    error: Exception | None = None  # what engine.generate() raised: reported by the synthesis task, in order
    chunk_at: float | None = None  # when the engine delivered its first chunk to this process (`_first_chunk`)


class _Delivery:
    """When the engine's current delivery to this process began: every first chunk it hands over is stamped with
    that time (`TurnPipeline._first_chunk`), so the work done for the chunks handed over before a turn's (their
    first-frame calls) counts as the gateway's share, not the engine's. The stamp holds until the loop's next turn."""

    __slots__ = ("at", "clock")

    def __init__(self) -> None:
        self.at: float | None = None
        self.clock: Callable[[], float] | None = None

    def began(self, clock: Callable[[], float]) -> float:
        at = self.at
        if at is None or clock is not self.clock:  # the session's clock (time.monotonic, unless a test's)
            if at is None:
                asyncio.get_running_loop().call_soon(self._end)
            at = self.at = clock()
            self.clock = clock
        return at

    def _end(self) -> None:
        self.at = None


_delivery: LoopLocal[_Delivery] = LoopLocal(lambda loop: _Delivery())


@dataclass(slots=True)
class _HeadCall:
    """A turn's first frame's encode call, made as the engine delivered its first chunk (`TurnPipeline._head_now`)."""

    pcm: np.ndarray  # the chunk's audio
    urgency: float  # what the listener had (ms) when it was made
    asked_at: float  # when it was made (session clock)
    future: asyncio.Future | None = None  # gives what `TurnEncoder.encode_head` returns
    written: bool = False  # its frames went out where its answer was read (`TurnPipeline._head_answered`)


# segments: items from the message handlers to a turn's synthesis task, in text order
@dataclass(slots=True)
class _FlushMark:
    flush_id: str | None


@dataclass(slots=True)
class _EndMark:
    pass


class SegmentQueue(asyncio.Queue):
    """The synthesis task's queue, whose head may be started ahead of its turn (`TurnPipeline._start_next`)."""

    _queue: Any  # asyncio.Queue's deque, the storage its subclass hooks (`_get`, `_put`) work on

    def start_head(self, start: Callable[[Segment], _Started]) -> None:
        """Replace a plain `Segment` at the head by `start(segment)`, in place; marks and started ones stay."""
        if self._queue and isinstance(self._queue[0], Segment):
            self._queue[0] = start(self._queue[0])


@dataclass(slots=True)
class Turn:
    """One context: text in, audio out, in order."""

    id: str
    index: int
    fmt: OutputFormat
    voice: str | None
    generation: p.GenerationSettings
    segmenter: Segmenter
    max_lead_ms: InitVar[float]  # audio sent ahead of the listener's playout (`playout`'s limit)
    # made by the synthesis task, off the path from a turn's first text to its engine request (a soxr stream costs
    # ~50 us: in a burst of new turns, every one of them waits for the others' set-up)
    encoder: TurnEncoder | None = None
    encode_site: EncodeSite = ON_LOOP  # where the encoder runs: on the loop, a thread pool, an encoder process
    segments: SegmentQueue = field(default_factory=SegmentQueue)  # Segment | _Started | _FlushMark | _EndMark
    # the synthesis task waits for a segment with the previous one done (its continuation prompt known): the next
    # released segment goes to the engine from the handler that released it (`Session._release`)
    idle: bool = True
    # text work queued behind the cuts a new turn's first text.append held back (`gateway.turn_text`); None: none
    # held back, text work is done at once
    deferred: list[TextOp] | None = None
    prompt: tuple[np.ndarray, str] | None = None  # the next segment's continuation prompt: (latents, text)
    continues: bool = True  # later segments continue from the one before (off: setting, or a prompt voice)
    # _Packets | marks waiting for the sender task, made with it (`_hand_over`); bounded by `pipeline_chunks`
    frames: asyncio.Queue | None = None
    pipeline_chunks: int = 16
    tasks: list[asyncio.Task] = field(default_factory=list)  # the synthesis task; the sender task once started
    begin: Deferred | None = None  # the synthesis task's start, waiting in the loop's lane (`Session._begin_turn`)
    timer: asyncio.TimerHandle | None = None  # the segmenter's next deadline (`TurnText._arm_timer`)
    timer_at: float | None = None  # that deadline (session clock)
    text: str = ""  # everything appended
    ended: bool = False
    seq: int = 0
    request_id: str | None = None
    held: bytes | None = None  # the newest encoded frame, held back until the next (or the end) is known
    head: _HeadCall | None = None  # its first frame's encode call, out since its chunk came, until the task takes it
    sending: bool = False  # an item of `frames` (or a batch the synthesis task sends itself) is being sent
    fed_ms: float = 0.0  # audio produced by the engine so far
    audio: list[SegmentAudio] = field(default_factory=list)
    playout: Playout = field(init=False)  # what was queued and sent, and the listener's playout
    # metrics
    t_first_text: float | None = None  # when the turn's first text reached the gateway (`Session.receive`)
    text_queued_ms: float | None = None  # how long that text waited between the socket's read and its handler
    chunk_queued_ms: float | None = None  # how long the engine's first chunk waited, delivered, for the turn's task
    engine_ttfb_ms: float | None = None
    link_ms: float | None = None  # of engine_ttfb_ms, the link to an engine in another process (`gateway.link`)
    link_request_ms: float | None = None  # of link_ms, the request's way there (the rest: its first chunk's way back)
    # its first frame's encode call, asked -> answered (off the loop: the hop too); asked: by the synthesis task, with
    # the chunk in hand (a call that went out as the chunk was delivered, `_head_now`, counts from there, not from
    # when it went out: it stays a part of the time from the engine's first audio to the first frame out); a frame
    # written where its answer was read (`_head_answered`): from the call, made at the delivery, to that write
    first_encode_ms: float | None = None
    later_ttfb_ms: list[float] = field(default_factory=list)  # engine TTFB of segments after the first
    segment_log: list[SegmentTiming] = field(default_factory=list)
    engine_s: float = 0.0

    def __post_init__(self, max_lead_ms: float) -> None:
        self.playout = Playout(max_lead_ms, self.fmt.frame_ms)

    def sent_chars(self) -> int:
        """Characters of segments whose audio has all been sent."""
        return sum(len(a.text) for a in self.audio if a.end_ms is not None and a.end_ms <= self.playout.sent_ms)



class TurnPipeline:
    """The synthesis task of a `Session`'s turns (it mixes this in)."""

    # the Session's attributes these methods use
    engine: Any
    clock: Callable[[], float]
    metrics: GatewayMetrics
    model_rate: int
    id: str
    closed: bool
    _announce: Callable[[], Coroutine[Any, Any, None]]
    _turn_failed: Callable[[Turn, str], None]
    write_now: Callable[[Turn, list[bytes], float], bool]

    async def _synthesise(self, turn: Turn) -> None:
        """The turn's context.started (if not sent yet), then segments in order through the engine; encoded audio
        into the bounded frame queue."""
        try:
            await self._announce()
            turn.encoder = turn.encode_site.open(turn.fmt, self.model_rate)
            while True:
                if turn.segments.empty():
                    turn.idle = True  # the next released segment is started by its handler (`_release`)
                item = await turn.segments.get()
                turn.idle = False
                if isinstance(item, _FlushMark):
                    await self._drain(turn)
                    await self._release_held(turn)
                    await self._hand_over(turn, item)
                    continue
                if isinstance(item, _EndMark):
                    assert turn.encoder is not None  # made above, before anything is encoded
                    await self._queue_packets(turn, await turn.encoder.finish(self._urgency(turn)), last=True)
                    await self._hand_over(turn, item)
                    return
                if isinstance(item, _Started):  # its request went out when it was released
                    started = item
                    try:
                        await self._hand_over(turn, _SegmentMark(item.segment, turn.fed_ms, item.t0))
                    except BaseException:  # stopped while the frame queue was full: nothing else will close it
                        await _aclose(item.stream)
                        raise
                else:  # the mark first: a full frame queue (plenty queued for the listener) holds the request back
                    await self._hand_over(turn, _SegmentMark(item, turn.fed_ms, self.clock()))
                    started = self._start(turn, item)
                seg = started.segment
                seg_audio = SegmentAudio(seg.text, turn.fed_ms)
                turn.audio.append(seg_audio)
                await self._generate(turn, started)
                seg_audio.end_ms = turn.fed_ms
        except ProtocolError as e:
            e.context_id = turn.id
            self._background(self._abort_turn(turn, e))
        except SessionClosed:
            pass
        except Exception:
            self._turn_failed(turn, "synthesis")
        finally:
            if turn.encoder is not None:  # ended, cancelled or failed: an encoder process frees its state
                turn.encoder.close()

    async def _generate(self, turn: Turn, started: _Started) -> None:
        """Read one segment's stream to its end, encoding and queueing its audio. Its last chunk makes the next
        segment's continuation prompt, and that segment's request goes out before the chunk is encoded
        (`_start_next`)."""
        seg = started.segment
        timing = SegmentTiming(seg.index, self._turn_ms(turn, started.t0), started.lead_ms)
        turn.segment_log.append(timing)
        latents: list[np.ndarray] = []
        stream = started.stream
        try:
            if started.error is not None:
                raise started.error
            # armed again (it was at `_start`, to stamp the delivery) now that the segment's mark is out and the
            # encoder open: a first frame written at its answer (`_head_answered`) must not precede the mark
            if self._head_due(turn):
                self.arm_first_chunk(turn, started, head=True)
            clock, ms_per_sample = self.clock, 1000.0 / self.model_rate
            # only the time spent waiting for the engine counts towards RTF, not waits for the listener; the first
            # chunk is waited for since the request went out
            t0 = started.t0
            while True:
                try:
                    chunk = await anext(stream)
                except StopAsyncIteration:
                    break
                finally:
                    t1 = clock()
                    turn.engine_s += t1 - t0
                wait_ms = (t1 - t0) * 1000.0
                timing.patches += 1
                if chunk.is_last:
                    timing.done_ms = self._turn_ms(turn, t1)
                if timing.patches == 1:
                    queued_ms = None
                    if started.chunk_at is not None:  # the engine's share ends where it delivered the chunk
                        wait_ms = (started.chunk_at - started.t0) * 1000.0
                        queued_ms = (t1 - started.chunk_at) * 1000.0
                    timing.engine_ttfb_ms = wait_ms
                    if turn.engine_ttfb_ms is None:
                        turn.engine_ttfb_ms, turn.chunk_queued_ms = wait_ms, queued_ms
                        turn.link_ms = getattr(stream, "link_ms", None)
                        turn.link_request_ms = getattr(stream, "link_parts_ms", (None, None))[0]
                        self.metrics.engine_ttfb.observe(wait_ms / 1000.0)
                    else:  # continuation prompts make these longer: measured to keep that cost visible
                        turn.later_ttfb_ms.append(wait_ms)
                elif wait_ms > timing.max_wait_ms:
                    timing.max_wait_ms, timing.max_wait_end_ms = wait_ms, self._turn_ms(turn, t1)
                if chunk.latents is not None:
                    latents.append(np.asarray(chunk.latents))
                if chunk.is_last:
                    self._start_next(turn, seg, latents)
                turn.fed_ms += len(chunk.audio) * ms_per_sample
                await self._encode_chunk(turn, chunk.audio, segment_start=timing.patches == 1)
                t0 = clock()
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
            self._drop_head(turn, stream)
            await _aclose(stream)  # cancels the engine request when we stop early

    def arm_first_chunk(self, turn: Turn, started: _Started, head: bool = False) -> None:
        """Have the engine's delivery of the segment's first chunk stamped (`_Started.chunk_at`: the engine's TTFB
        ends there, and the time until this turn's task takes the chunk is the gateway's) and, with `head`, its first
        frame's encode call made there too (`_head_now`)."""
        on_next_chunk = getattr(started.stream, "on_next_chunk", None)  # an engine's `ChunkIterator`
        if on_next_chunk is not None:
            on_next_chunk(functools.partial(self._first_chunk, turn, started, head))

    def _head_due(self, turn: Turn) -> bool:
        """The turn's first chunk is still to come, and its first frame's encode call can go out as the engine
        delivers it, not when this task gets round to it. A burst's engine step brings a front tens of first chunks
        at once, and their tasks then run one after another, each with its bookkeeping before its call: the calls
        made at delivery are all in the encoder processes before the first task runs."""
        encoder = turn.encoder
        return not (encoder is None or not encoder.offloaded or turn.engine_ttfb_ms is not None
                    or turn.playout.queued_ms or turn.held is not None)

    def _first_chunk(self, turn: Turn, started: _Started, head: bool, chunk: AudioChunk) -> None:
        started.chunk_at = _delivery.get().began(self.clock)
        if head:
            self._head_now(turn, chunk)

    def _head_now(self, turn: Turn, chunk: AudioChunk) -> None:
        """The engine delivers the turn's first chunk (its task waits for it, so the encoder has no call out and the
        chunk's is the next it gets): its head's call is made now (`_encode_chunk` awaits it), if the chunk is split
        at all. It runs in the engine's delivery callback: it never raises (the task then makes the call itself)."""
        encoder = turn.encoder
        step = self._frame_step(turn)
        if self.closed or encoder is None or len(chunk.audio) <= HEAD_FRAMES * step:
            return
        call = _HeadCall(chunk.audio, self._urgency(turn), self.clock())
        try:
            call.future = encoder.head_now(chunk.audio, HEAD_FRAMES, step, call.urgency,
                                           functools.partial(self._head_answered, turn, call))
        except Exception:
            log.exception("session %s: the first frame's encode call could not be made early", self.id)
            return
        if call.future is not None:
            turn.head = call

    def _head_answered(self, turn: Turn, call: _HeadCall, answer: tuple[list[bytes], int]) -> None:
        """The head's answer, where the encoder's socket is read: its frames go out now if nothing of the turn waits
        before them (`write_now`), not when the turn's task gets round to them. A burst's answers come back together,
        and its tasks then run one after another, each with its bookkeeping before its send: this way every answered
        turn's first frame is out before the first of those tasks runs. (Not for a cancelled call: no answer comes.)"""
        head, used = answer
        if not head or used >= len(call.pcm):  # the rest of the chunk follows: none of the head is held back
            return
        now = self.clock()
        if self.write_now(turn, head, now):
            call.written = True
            turn.first_encode_ms = (now - call.asked_at) * 1000.0

    @staticmethod
    def _drop_head(turn: Turn, stream: Any) -> None:
        """The segment's stream is done with: no hook left on it, and a head call its task did not take (stopped or
        failed before it did) is given up (the encoder's close still follows: `_synthesise`)."""
        on_next_chunk = getattr(stream, "on_next_chunk", None)
        if on_next_chunk is not None:
            on_next_chunk(None)
        head, turn.head = turn.head, None
        if head is not None and head.future is not None and not head.future.cancel() and not head.future.cancelled():
            head.future.exception()  # answered already: an error in it is seen, and dropped

    def _start_next(self, turn: Turn, seg: Segment, latents: list[np.ndarray]) -> None:
        """The segment after `seg` is done at the engine: its continuation prompt is known, so the next released
        segment's request goes out now, not after `seg`'s last chunk has waited for its turn in the encode pool."""
        if turn.continues and latents:
            turn.prompt = (np.stack(latents)[-turn.generation.continuation_patches:], seg.speak())  # [T, P, D]
        if not self.closed:
            turn.segments.start_head(lambda head: self._start(turn, head))

    def _turn_ms(self, turn: Turn, now: float) -> float:
        """Milliseconds since the turn's first text (the origin of its TTFB)."""
        return (now - turn.t_first_text) * 1000.0 if turn.t_first_text is not None else 0.0

    def _urgency(self, turn: Turn) -> float:
        """An encoder call's urgency: the audio (ms) its listener has before running dry."""
        return turn.playout.buffered_ms(self.clock())

    async def _drain(self, turn: Turn) -> None:
        """A flush: the audio still inside the encoder (resampler tail, partial frame) queued before the flush's
        answer, so text.flushed follows the flush's last audio; the silence padding the last frame counts as fed."""
        encoder = turn.encoder
        assert encoder is not None  # made when the synthesis task starts, before anything is encoded
        frames, padding = await encoder.drain(self._urgency(turn))
        turn.fed_ms += padding * 1000.0 / turn.fmt.sample_rate
        await self._queue_packets(turn, frames)

    async def _encode_chunk(self, turn: Turn, pcm: np.ndarray, segment_start: bool = False) -> None:
        """One engine chunk -> its frames, wherever the turn's encoder runs (`encode_site`: Opus off the loop, the
        cheap formats right here), queued. Off the loop, a chunk that starts the listener's audio is two calls, one
        after the other (the encoder is a stream): its first frame, sent as soon as it is encoded, then the rest.
        A burst of new turns arrives in one engine step and the pool (or encoder process) runs the most urgent call
        queued first, so every new turn's first frame is encoded before anyone's rest, and every rest before the
        chunks of listeners with audio queued."""
        encoder = turn.encoder
        assert encoder is not None  # made when the synthesis task starts, before anything is encoded
        early, turn.head = turn.head, None
        assert early is None or early.pcm is pcm  # made for the turn's first chunk, which this task took first
        step = self._frame_step(turn)
        if early is None and (not encoder.offloaded or len(pcm) <= HEAD_FRAMES * step
                              or not self._starts_audio(turn, segment_start)):
            await self._queue_packets(turn, await encoder.encode(pcm, self._urgency(turn)))
            return
        t0 = self.clock()
        if early is None:
            buffered = self._urgency(turn)
            head, used = await encoder.encode_head(pcm, HEAD_FRAMES, step, buffered)
        else:
            buffered = early.urgency
            assert early.future is not None  # `_head_now` keeps only a call it made
            if not early.future.done():  # answered since, but not read yet: the tasks of a step's chunks run back
                encoder.collect()  # to back, and the loop reads the encoder's socket only after the last of them
            head, used = await early.future
            if early.written:  # the head is out already (`_head_answered`): the rest of the chunk follows
                await self._queue_packets(turn, await encoder.encode(pcm[used:], self._urgency(turn)))
                return
        if turn.first_encode_ms is None:
            turn.first_encode_ms = (self.clock() - t0) * 1000.0
        # what the listener has once the head is out; counted before `_queue_packets` takes the list over
        urgency = buffered + len(head) * turn.fmt.frame_ms
        # the rest of the chunk follows, so none of the head is the turn's last frame: nothing is held back
        await self._queue_packets(turn, head, more=used < len(pcm))
        if used < len(pcm):
            await self._queue_packets(turn, await encoder.encode(pcm[used:], urgency))

    def _frame_step(self, turn: Turn) -> int:
        """One frame's time in model-rate samples."""
        return max(1, self.model_rate * turn.fmt.frame_ms // 1000)

    def _starts_audio(self, turn: Turn, segment_start: bool) -> bool:
        """The chunk starts the listener's audio: nothing encoded or held yet (a turn's first chunk, or the first
        after a flush), or a segment's first while the listener has no more than the held-back frame left."""
        if not turn.playout.queued_ms:
            return True
        return segment_start and turn.playout.buffered_ms(self.clock()) <= turn.fmt.frame_ms

    async def _queue_packets(self, turn: Turn, payloads: list[bytes], last: bool = False, more: bool = False) -> None:
        """Queue the chunk's frames as one batch, holding the newest frame back (until the next chunk or the end is
        known) so the turn's last frame can carry FLAG_LAST; `more`: more audio follows for certain, nothing is held.
        Frames are whole: the encoder pads the end."""
        turn.playout.queued(len(payloads))
        batch = payloads if turn.held is None else [turn.held, *payloads]
        turn.held = None if last or more or not batch else batch.pop()
        if batch:
            await self._hand_over(turn, _Packets(batch, last))

    async def _release_held(self, turn: Turn) -> None:
        if turn.held is not None:
            payload, turn.held = turn.held, None
            await self._hand_over(turn, _Packets([payload]))


async def _aclose(stream: Any) -> None:
    """Close an engine stream (None: `generate` raised) whatever it is: a `Generation` cancels its request."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()
