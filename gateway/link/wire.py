"""What the engine host and its gateway fronts say to each other (`gateway.link`), and how it is framed. No I/O.

A frame is a 4-byte little-endian length and a pickle (protocol 5) of `(sent_at, [message, ...])`: everything one
side queued in one pass of its event loop goes as one frame, stamped with `time.monotonic()` when it left (the same
clock in every process on Linux, so the other side can tell how long the link took). Every message is a
`NamedTuple`, as in `engine.ipc`: read by field name, still a plain tuple to pickle.

Both ends are processes of one deployment started by one `voxgate serve` (the socket lives in a private 0700
directory), so unpickling what arrives is as trusted as the engine's own worker pipes.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from engine.api import EngineStats, LoRAInfo, ModelInfo, VoiceInfo
from engine.errors import EngineError, EngineStopped
from engine.guards import SamplingRanges
from engine.ipc import AudioRing, Buffered, Cancel  # noqa: F401  (Buffered, Cancel: link messages too)
from engine.specs import RequestSpec

HEADER = struct.Struct("<I")
MAX_FRAME = (1 << 32) - 1  # a LoRA upload of up to 1 GiB (`ServerConfig.max_lora_bytes`) fits


class HostLost(EngineStopped):
    """The engine host closed the link or died: the front's open requests end with this, and the front exits."""


class FrameTooLarge(EngineError):
    """A message larger than a frame holds (`MAX_FRAME` bytes pickled)."""


def frame(messages: list[Any], sent_at: float) -> bytes:
    """One frame carrying `messages` (`FrameTooLarge` beyond `MAX_FRAME`)."""
    payload = pickle.dumps((sent_at, messages), protocol=5)
    if len(payload) > MAX_FRAME:
        raise FrameTooLarge(f"a link message of {len(payload)} bytes is more than a frame holds ({MAX_FRAME})")
    return HEADER.pack(len(payload)) + payload


def sendable(messages: list[Any]) -> tuple[list[Any], list[tuple[Any, Exception]]]:
    """`messages` split into those that pickle and those that do not (with why), for a frame that failed."""
    ok, bad = [], []
    for msg in messages:
        try:
            pickle.dumps(msg, protocol=5)
        except Exception as e:
            bad.append((msg, e))
        else:
            ok.append(msg)
    return ok, bad


class Reader:
    """Bytes in as they arrive, whole frames out."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[float, list[Any]]]:
        """The frames completed by `data`, each as (sent_at, messages), in order."""
        buf = self._buf
        buf += data
        out = []
        pos = 0
        while len(buf) - pos >= HEADER.size:
            (n,) = HEADER.unpack_from(buf, pos)
            end = pos + HEADER.size + n
            if len(buf) < end:
                break
            with memoryview(buf) as view, view[pos + HEADER.size:end] as payload:  # released before the buffer shrinks
                out.append(pickle.loads(payload))
            pos = end
        if pos:
            del buf[:pos]
        return out

    @property
    def pending(self) -> int:
        """Bytes of a frame not yet whole."""
        return len(self._buf)


def portable(error: BaseException) -> BaseException:
    """`error` if it survives a pickle round trip as itself (the engine's and the store's typed errors do), else an
    `EngineError` that says what it was."""
    try:
        back = pickle.loads(pickle.dumps(error, protocol=5))
    except Exception:
        back = None
    if type(back) is type(error):
        return error
    return EngineError(f"{type(error).__name__}: {error}")


# ---- shared state (host -> fronts) ----------------------------------------------------------------------------
class MirrorVoice(NamedTuple):
    """A stored voice as a front needs it to build requests (`engine.request_check.StoredVoice`)."""

    info: VoiceInfo
    latents: Any  # float32 [T, P, D], or None for an adapter-only voice
    text: str | None
    shared_prefix: bool


class Status(NamedTuple):
    """What a front answers its synchronous calls from: sent at connect, on every change and every STATUS_S."""

    model_info: ModelInfo
    stats: EngineStats
    health: dict[str, Any]
    loras: list[LoRAInfo]
    kv_positions: int


class Welcome(NamedTuple):
    """The host's first message to a front: what it needs to check and build requests like the engine."""

    link: int  # this connection's number at the host
    model_path: str
    model_name: str
    default_timesteps: int
    sampling_ranges: SamplingRanges
    store_description: str
    status: Status
    voices: list[MirrorVoice]


class Voices(NamedTuple):
    """Stored voices that changed (`put`: added or replaced) or went (`gone`)."""

    put: list[MirrorVoice]
    gone: list[str]


# ---- requests (front -> host) ---------------------------------------------------------------------------------
class Hello(NamedTuple):
    """A front's first message."""

    front: int
    pid: int


class Submit(NamedTuple):
    """Queue a request built in the front (its id is the front's own)."""

    spec: RequestSpec


# Cancel and Buffered are the pool's own messages to a worker (`engine.ipc`), re-exported: a front sends them as is


class Call(NamedTuple):
    """Run the host's engine or store method `op` (`ENGINE_CALLS`, `STORE_CALLS`); answered by one `Reply`."""

    call: int
    target: str  # "engine" or "store"
    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


ENGINE_CALLS = frozenset({"encode_audio", "add_voice", "remove_voice", "register_lora", "unregister_lora",
                          "wait_for_ready"})
STORE_CALLS = frozenset({"put", "get", "blobs", "items", "update", "delete", "add_token", "take_token",
                         "reserve_lease", "refresh_leases", "release_lease", "api_keys"})


# ---- answers (host -> front) ----------------------------------------------------------------------------------
class Chunks(NamedTuple):
    """The chunks of one worker step for this front, packed: `meta` has one (request id, samples, index, is_last,
    stop_reason, step, first) per chunk, where `first` is None but for a request's first chunk: (host got the
    request, host got the chunk), both `time.monotonic()`; their audio is `audio`, one after another (a span of the
    link's `AudioRing`, or inline when the link has none or it was full), and their latents the rows of `latents`.
    One array of each pickles in a fraction of the time of one per chunk (the host's event loop pickles every
    step)."""

    meta: list[tuple[str, int, int, bool, str | None, int, tuple[float, float] | None]]
    audio: np.ndarray | tuple[int, int]
    latents: np.ndarray | list[Any]


# what a host's chunk sink collects per chunk: (request id, audio, index, latents, is_last, stop_reason, step, first)
ChunkRow = tuple[str, np.ndarray, int, Any, bool, "str | None", int, "tuple[float, float] | None"]


def pack_chunks(rows: list[ChunkRow], ring: AudioRing | None = None) -> Chunks:
    """One `Chunks` message of the rows a step gave one front; its audio goes into `ring` when one is given and
    has room, else inline."""
    audio: np.ndarray | tuple[int, int] = (np.concatenate([r[1] for r in rows]) if rows
                                           else np.zeros(0, np.float32))
    if ring is not None and rows:
        span = ring.write(audio)
        if span is not None:
            audio = span
    latents: np.ndarray | list[Any] = [r[3] for r in rows]
    if rows and all(isinstance(x, np.ndarray) for x in latents):
        latents = np.stack(latents)
    meta = [(rid, len(a), index, is_last, reason, step, first) for rid, a, index, _, is_last, reason, step, first
            in rows]
    return Chunks(meta, audio, latents)


def unpack_chunks(msg: Chunks, ring: AudioRing | None = None) -> Iterator[ChunkRow]:
    """The rows of a `Chunks` message, each chunk's audio and latents a view of the message's arrays (audio in the
    ring is copied out of `ring` first, which hands its space back to the host)."""
    audio = with_audio(msg, ring).audio
    assert isinstance(audio, np.ndarray)
    pos = 0
    latents = msg.latents
    for i, (rid, n, index, is_last, reason, step, first) in enumerate(msg.meta):
        yield rid, audio[pos:pos + n], index, latents[i], is_last, reason, step, first
        pos += n


def with_audio(msg: Chunks, ring: AudioRing | None) -> Chunks:
    """`msg` with its audio inline: copied out of `ring` (which hands that space back to the host) if it is there.
    `EngineError` if the audio is in a ring this side does not have."""
    if type(msg.audio) is not tuple:
        return msg
    if ring is None:
        raise EngineError("a link message refers to an audio ring this front does not have")
    return msg._replace(audio=ring.read(*msg.audio))


class Failed(NamedTuple):
    """A request ended with `error` (a typed `EngineError`: refused at the host, or failed in the worker)."""

    request_id: str
    error: BaseException


class Reply(NamedTuple):
    """The answer to `Call` number `call`: its value, or (not `ok`) the error it raised."""

    call: int
    ok: bool
    value: Any
