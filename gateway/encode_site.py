"""Where a turn's encoder runs: on the event loop (the cheap formats), in the gateway's encode thread pool
(`gateway.offload`), or in an encoder process (`gateway.encode_procs`, VOXGATE_ENCODE_PROCS). The turn's pipeline
(`gateway.turn`) talks to one `TurnEncoder` whichever it is."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import numpy as np

from gateway.audio import Encoder, OutputFormat
from gateway.encode_procs import shared_procs
from gateway.offload import OffloadPool, default_encode_procs, shared_pool
from gateway.settings import loop_settings

# Formats whose encoding is worth a hop off the loop (libopus: ~0.9 ms per 160 ms chunk at 48 kHz). PCM and G.711
# cost ~0.05 ms per chunk: cheaper on the loop than any hop.
OFFLOADED_FORMATS = ("opus",)


class TurnEncoder(Protocol):
    """One turn's `Encoder`, wherever it runs. `urgency`: ms until the turn's listener runs out of audio (the most
    urgent call goes first where calls queue). A turn awaits each call before making the next."""

    offloaded: bool  # off the loop: a chunk that starts the listener's audio is worth splitting (`encode_head`)

    async def encode(self, pcm: np.ndarray, urgency: float) -> list[bytes]: ...

    async def encode_head(self, pcm: np.ndarray, frames: int, step: int,
                          urgency: float) -> tuple[list[bytes], int]: ...

    def head_now(self, pcm: np.ndarray, frames: int, step: int, urgency: float,
                 on_answer: Callable[[tuple[list[bytes], int]], None] | None = None) -> asyncio.Future | None:
        """`encode_head`'s call made synchronously (no task step in between): its future, which gives what
        `encode_head` returns; None where the encoder cannot (on the loop, the thread pool) or cannot now.
        `on_answer` gets that answer where it is read, before any task step (not an error, nor a cancelled call's)."""

    def collect(self) -> None:
        """Answers to calls made by `head_now` taken now if they are here (no wait)."""

    async def drain(self, urgency: float) -> tuple[list[bytes], int]: ...

    async def finish(self, urgency: float) -> list[bytes]: ...

    def close(self) -> None:
        """The turn is over (ended, cancelled or failed): free what the encoder holds."""


class EncodeSite(Protocol):
    def open(self, fmt: OutputFormat, input_rate: int) -> TurnEncoder:
        """A new encoder for one turn."""


class LoopEncoder:
    """Encoded right on the event loop."""

    offloaded = False

    def __init__(self, encoder: Encoder):
        self.encoder = encoder

    async def encode(self, pcm: np.ndarray, urgency: float) -> list[bytes]:
        return self.encoder.encode(pcm)

    async def encode_head(self, pcm: np.ndarray, frames: int, step: int, urgency: float) -> tuple[list[bytes], int]:
        return self.encoder.encode_head(pcm, frames, step)

    def head_now(self, pcm: np.ndarray, frames: int, step: int, urgency: float,
                 on_answer: Callable[[tuple[list[bytes], int]], None] | None = None) -> asyncio.Future | None:
        return None

    def collect(self) -> None:
        pass

    async def drain(self, urgency: float) -> tuple[list[bytes], int]:
        return self.encoder.drain()

    async def finish(self, urgency: float) -> list[bytes]:
        return self.encoder.finish()

    def close(self) -> None:
        pass


class PooledEncoder:
    """Encoded in the thread pool, one pool call per call (the encoder is not thread-safe: the turn awaits each)."""

    offloaded = True

    def __init__(self, pool: OffloadPool, encoder: Encoder):
        self.pool, self.encoder = pool, encoder

    async def encode(self, pcm: np.ndarray, urgency: float) -> list[bytes]:
        packets: list[bytes] = await self.pool.run(self.encoder.encode, pcm, urgency=urgency)
        return packets

    async def encode_head(self, pcm: np.ndarray, frames: int, step: int, urgency: float) -> tuple[list[bytes], int]:
        head: tuple[list[bytes], int] = await self.pool.run(self.encoder.encode_head, pcm, frames, step,
                                                              urgency=urgency)
        return head

    def head_now(self, pcm: np.ndarray, frames: int, step: int, urgency: float,
                 on_answer: Callable[[tuple[list[bytes], int]], None] | None = None) -> asyncio.Future | None:
        return None  # a pool call starts in a task step

    def collect(self) -> None:
        pass

    async def drain(self, urgency: float) -> tuple[list[bytes], int]:
        drained: tuple[list[bytes], int] = await self.pool.run(self.encoder.drain, urgency=urgency)
        return drained

    async def finish(self, urgency: float) -> list[bytes]:
        packets: list[bytes] = await self.pool.run(self.encoder.finish, urgency=urgency)
        return packets

    def close(self) -> None:
        pass


class OnLoop:
    def open(self, fmt: OutputFormat, input_rate: int) -> TurnEncoder:
        return LoopEncoder(Encoder(fmt, input_rate))


class InPool:
    def __init__(self, pool: OffloadPool):
        self.pool = pool

    def open(self, fmt: OutputFormat, input_rate: int) -> TurnEncoder:
        return PooledEncoder(self.pool, Encoder(fmt, input_rate))


ON_LOOP = OnLoop()


def start_encoders() -> None:
    """Start this loop's Opus encoder processes now if Opus turns go to them: a serving process calls it once it
    listens, so its first Opus turn does not wait for them to start (~0.1-0.4 s: a Python child and its imports;
    every front of `--fronts N` has its own)."""
    procs = _opus_procs()
    if procs:
        shared_procs(procs).start()


def _opus_procs() -> int:
    """The running loop's Opus encoder processes (0: the thread pool)."""
    setting = loop_settings().encode_procs
    return default_encode_procs() if setting is None else setting


def encode_site(fmt: OutputFormat) -> EncodeSite:
    """Where a new turn in `fmt` encodes: the cheap formats on the loop; Opus in the encoder processes when
    VOXGATE_ENCODE_PROCS asks for them (made on first use), else in the shared thread pool. VOXGATE_ENCODE_PROCS is
    read once per event loop (its first Opus turn, or `start_encoders`). Call on the event loop."""
    if fmt.format not in OFFLOADED_FORMATS:
        return ON_LOOP
    procs = _opus_procs()
    if procs == 0:
        return InPool(shared_pool())
    return shared_procs(procs)
