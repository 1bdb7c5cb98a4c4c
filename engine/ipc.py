"""What the pool and a worker process say to each other (and a tensor-parallel worker to its follower ranks), and
the shared-memory ring the step audio goes through.

Every message is a `NamedTuple`: built and read by field name on both sides, yet still a plain tuple to pickle (no
cost on the hot path). Commands (pool -> worker) travel in batches, one list per pipe message
(`engine.worker_handle`); those that take a reply carry a `call` id, answered by one `Reply`. Results go back one per
pipe message.

Audio is the bulk of the traffic (a VoxCPM2 step at 256 streams is ~7.8 MB of float32), so it does not travel
through the pipe: each step's audio is written once, contiguously, into the shared `AudioRing` and the `Step`
message carries only its span. The pool's reader thread copies each chunk out as the message arrives and advances
the ring's shared read cursor, so the worker never overwrites audio that has not been read; if the ring is ever
full (a stalled reader), that step's audio travels inline in the message instead: slower, never wrong, never
blocking the GPU.
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from engine.api import AudioChunk
    from engine.request import RequestSpec
    from engine.worker import WorkerConfig


# ---- pool -> worker ----------------------------------------------------------------------------------------
class Add(NamedTuple):
    """Queue a request."""

    spec: RequestSpec


class Cancel(NamedTuple):
    """Stop a request."""

    request_id: str


class Buffered(NamedTuple):
    """The listener of a request has `audio_ms` of audio queued (drives deadline-first scheduling)."""

    request_id: str
    audio_ms: float


class StoreVoice(NamedTuple):
    """Compute and keep a reference voice's prefix KV; the reply comes once it is computed."""

    call: int
    spec: RequestSpec


class RemoveVoice(NamedTuple):
    """Free a stored voice's prefix KV."""

    voice_id: str


class Encode(NamedTuple):
    """Encode prompt audio (mono samples at the VAE's rate) into patches; the reply carries them."""

    call: int
    samples: np.ndarray
    pad: str  # "left" (a continuation prompt) or "right" (a reference)


class AddLoRA(NamedTuple):
    """Load an adapter (an `engine.lora.LoRAAdapter` or its `SharedAdapter`) into a free slot."""

    call: int
    adapter: Any


class RemoveLoRA(NamedTuple):
    """Free the slot of the adapter `name`."""

    call: int
    name: str


class Stop(NamedTuple):
    """Publish the last step, then end the worker."""


Command = Add | Cancel | Buffered | StoreVoice | RemoveVoice | Encode | AddLoRA | RemoveLoRA | Stop


# ---- worker -> pool ----------------------------------------------------------------------------------------
class Ready(NamedTuple):
    """The model is loaded: its KV blocks, device, dtype, pid and memory budget."""

    info: dict[str, Any]


class ChunkSpan(NamedTuple):
    """One request's patch of a step; its audio is `[start, end)` of the step's audio."""

    request_id: str
    index: int  # the patch's index in the request
    latents: np.ndarray
    start: int
    end: int
    is_last: bool
    stop_reason: str | None
    step: int


class Step(NamedTuple):
    """A collected step: its chunks, its audio (a span of the ring, or inline when the ring was full), the stats."""

    chunks: list[ChunkSpan]
    audio: tuple[int, int] | np.ndarray
    stats: dict[str, Any]


class Reply(NamedTuple):
    """The answer to the command with id `call`: its result, or (not `ok`) the error's message."""

    call: int
    ok: bool
    value: Any


class Failed(NamedTuple):
    """A request failed in the worker."""

    request_id: str
    message: str


class Stats(NamedTuple):
    """The worker's latest stats, sent when no step carries them."""

    stats: dict[str, Any]


class Fatal(NamedTuple):
    """The worker could not start (then it exits)."""

    message: str


Result = Ready | Step | Reply | Failed | Stats | Fatal


class StepAudio(NamedTuple):
    """A `Step` as the pool hands it on: its chunks with their audio copied out of the ring."""

    chunks: list[AudioChunk]
    stats: dict[str, Any]


# ---- tensor parallelism: rank 0 -> its follower ranks (`engine.distributed`; `Stop` ends a follower) ---------
class RankSetup(NamedTuple):
    """A follower's rank and the group's rendezvous port; `cfg` is rank 0's worker config."""

    cfg: WorkerConfig
    rank: int
    port: int


class RankRow(NamedTuple):
    """One row of the step rank 0 is about to run."""

    request_id: str
    spec: RequestSpec | None  # the first time the followers see the request, else None
    start: int
    num_tokens: int
    emit: bool
    block_table: list[int]
    vae_slot: int | None


class RankStep(NamedTuple):
    """The step rank 0 is about to run, and the requests that ended since the last one."""

    rows: list[RankRow]
    gone: list[str]


# ---- the audio ring ----------------------------------------------------------------------------------------
class AudioRing:
    """A float32 ring in a shared map, after an int64 read cursor; positions are monotonic float counts
    (`pos % capacity` is the offset). The reader advances the cursor, the writer never passes it."""

    def __init__(self, shared: mmap.mmap):
        self.shared: mmap.mmap | None = shared
        self._read_pos = np.ndarray((1,), dtype=np.int64, buffer=shared)
        self.buf = np.ndarray(((len(shared) - 8) // 4,), dtype=np.float32, buffer=shared, offset=8)
        self.capacity = self.buf.shape[0]
        self.write_pos = 0

    @staticmethod
    def size_for(floats: int) -> int:
        """Bytes of a ring that holds `floats` samples."""
        return 8 + 4 * floats

    @property
    def read_pos(self) -> int:
        return int(self._read_pos[0])

    def write(self, audio: np.ndarray) -> tuple[int, int] | None:
        """Store `audio` contiguously; (start, end) positions, or None when the unread audio leaves no room."""
        n = audio.shape[0]
        start = self.write_pos
        if start % self.capacity + n > self.capacity:  # skip the tail so every step stays contiguous
            start += self.capacity - start % self.capacity
        end = start + n
        if n > self.capacity or end - self.read_pos > self.capacity:
            return None
        self.buf[start % self.capacity:start % self.capacity + n] = audio
        self.write_pos = end
        return start, end

    def read(self, start: int, end: int) -> np.ndarray:
        """Copy out [start, end) and release everything before `end` to the writer."""
        offset = start % self.capacity
        out = self.buf[offset:offset + end - start].copy()
        self._read_pos[0] = end
        return out

    def close(self) -> None:
        """Unmap the ring (the memory goes once both sides have closed it). Idempotent."""
        if self.shared is None:
            return
        shared, self.shared = self.shared, None
        del self.buf, self._read_pos
        shared.close()
