"""PCM samples: float to int16, and the streaming resampler."""

from __future__ import annotations

import numpy as np
import soxr


def float_to_int16(pcm: np.ndarray) -> np.ndarray:
    """float [-1, 1] -> int16, clipped (the model can overshoot slightly)."""
    return np.rint(np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16)


class Resampler:
    """Streaming resampler (soxr, high quality). One per turn: it keeps filter state across chunks."""

    def __init__(self, in_rate: int, out_rate: int):
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError(f"sample_rate: rates must be positive (got {in_rate} -> {out_rate})")
        self.in_rate, self.out_rate = in_rate, out_rate
        self._stream = None if in_rate == out_rate else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32")

    def process(self, pcm: np.ndarray, last: bool = False) -> np.ndarray:
        """Resample the next chunk; `last=True` flushes the filter tail."""
        pcm = np.ascontiguousarray(pcm, dtype=np.float32)
        if self._stream is None:
            return pcm.copy()
        return self._stream.resample_chunk(pcm, last=last)
