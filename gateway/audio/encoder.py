"""The per-turn `Encoder`: resample (soxr, stream state kept across chunks so chunk boundaries never
click), cut into fixed frames (remainders carried across chunks), encode with the format's codec, and on `finish()`
flush everything so the ending is never cut off."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from gateway.audio.codecs import CODECS, Codec
from gateway.audio.formats import OutputFormat
from gateway.audio.pcm import Resampler


class Encoder:
    """One turn's audio: resample -> frame -> encode. `encode()` per model chunk, `finish()` once at the end."""

    def __init__(self, fmt: OutputFormat, input_rate: int):
        self.fmt = fmt
        self.kind = fmt.kind
        self.frame_samples = fmt.frame_samples
        self._resampler = Resampler(input_rate, fmt.sample_rate)
        self._pending = np.zeros(0, dtype=np.float32)
        self._produced = 0  # output-rate samples of real audio so far
        self._finished = False
        self._drained = True  # nothing encoded since the start or the last `drain`
        self._codec: Codec = CODECS[fmt.format](fmt)
        self.lookahead = self._codec.lookahead  # output-rate samples of codec delay before the first real sample

    @property
    def framed(self) -> bool:
        """Fixed-size frames (Opus, PCM, G.711); WAV/MP3/FLAC/AAC stream whatever arrives."""
        return self._codec.framed

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        """float32 mono samples at the input rate -> zero or more frames (or container byte chunks)."""
        return self._emit(self._take(pcm), end=False)

    def encode_slices(self, pcm: np.ndarray, frames: int) -> Iterator[tuple[list[bytes], bool]]:
        """`encode(pcm)` a slice of `frames` frames at a time (an encoder process serves a more urgent call between
        two): (a slice's packets, whether slices follow); all the slices' packets, in order, are `encode(pcm)`'s. The
        formats of a packet per frame (those with a binary header kind) are cut between frames, which changes no byte;
        the others come in one slice (a container writes a page or chunk per call). The encoder takes no other call
        until the last slice is out."""
        block = self._take(pcm)
        step = max(frames * self.frame_samples if self.kind else len(block), 1)
        for start in range(0, max(len(block), 1), step):
            yield self._emit(block[start:start + step], end=False), start + step < len(block)

    def _take(self, pcm: np.ndarray) -> np.ndarray:
        """Resample `pcm` -> what is ready to encode: whole frames (the remainder kept for the next call) in the
        framed formats, all of it in the others."""
        if self._finished:
            raise RuntimeError("Encoder.encode() after finish()")
        pcm = np.asarray(pcm)
        if pcm.ndim != 1:
            raise ValueError(f"pcm: expected mono samples (1-D), got shape {pcm.shape}")
        out = self._resampler.process(pcm)
        self._produced += len(out)
        self._drained = self._drained and not len(pcm)
        if not self.framed:
            return out
        buf = np.concatenate([self._pending, out]) if len(self._pending) else out
        n = len(buf) // self.frame_samples * self.frame_samples
        self._pending = buf[n:]
        return buf[:n]

    def encode_head(self, pcm: np.ndarray, frames: int, step: int) -> tuple[list[bytes], int]:
        """The start of `pcm` until `frames` frames came out (or `pcm` ended), `step` input samples (one frame's time)
        at a time past the first try: (those frames, input samples used). A resampler's output comes in blocks, so how
        much input that takes is only known by trying; the state carries on into `encode(pcm[used:])`. The head is
        coded as the codec codes a listener's first frames (`Codec`'s `emit_head`: Opus at its head complexity), else
        the head plus `encode(pcm[used:])` are the same bytes as one `encode(pcm)`."""
        out = self._emit_head(self._take(pcm[:frames * step]))
        used = frames * step
        while len(out) < frames and used < len(pcm):
            out += self._emit_head(self._take(pcm[used:used + step]))
            used += step
        return out, min(used, len(pcm))

    def _emit_head(self, block: np.ndarray) -> list[bytes]:
        emit_head = getattr(self._codec, "emit_head", None)
        return self._emit(block, end=False) if emit_head is None else emit_head(block, self._produced)

    def finish(self) -> list[bytes]:
        """The tail: flush the resampler, pad the last frame (past the codec delay), flush the codec."""
        if self._finished:
            return []
        self._finished = True
        out = self._resampler.process(np.zeros(0, dtype=np.float32), last=True)
        self._produced += len(out)
        if not self.framed:
            return self._emit(out, end=True)
        tail = np.concatenate([self._pending, out])
        # Opus output lags its input by the lookahead: encode enough padding that the last real sample comes out
        frames = -(-(len(tail) + self.lookahead) // self.frame_samples)
        return self._emit(np.pad(tail, (0, frames * self.frame_samples - len(tail))), end=True)

    def drain(self) -> tuple[list[bytes], int]:
        """Everything encoded so far out now, the turn going on (a flush: its last audio must not wait for the next
        text): the resampler's tail (a fresh resampler takes over) and the partial frame padded with silence to whole
        frames, past the codec delay. (the wire chunks, output-rate samples of silence added)."""
        if self._finished or self._drained:
            return [], 0
        self._drained = True
        out = self._resampler.process(np.zeros(0, dtype=np.float32), last=True)
        self._resampler = Resampler(self._resampler.in_rate, self._resampler.out_rate)
        self._produced += len(out)
        if not self.framed:  # a container codec keeps its own frame: what it holds goes out with the next audio
            return self._emit(out, end=False), 0
        tail = np.concatenate([self._pending, out])
        self._pending = np.zeros(0, dtype=np.float32)
        frames = -(-(len(tail) + self.lookahead) // self.frame_samples)
        padding = frames * self.frame_samples - len(tail)
        self._produced += padding
        return self._emit(np.pad(tail, (0, padding)), end=False), padding

    def _emit(self, block: np.ndarray, end: bool) -> list[bytes]:
        """`block`: whole frames (framed formats) or whatever arrived (WAV, PyAV containers) -> wire chunks."""
        return self._codec.emit(block, end, self._produced)
