"""Opus: libopus's availability, the frame packetiser (`OpusFrames`) and the loader of its C helper
(gateway/_opus_frames.c, built by setup.py)."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

from gateway.audio.formats import OutputFormat
from gateway.settings import GatewaySettings


def opus_available() -> bool:
    """True when libopus can be loaded; raise `RuntimeError` with the fix when it cannot."""
    try:
        import opuslib  # noqa: F401
    except Exception as e:  # opuslib raises a bare Exception("Could not find Opus library") without libopus0
        raise RuntimeError(
            f"Opus output needs the libopus shared library ({e}). Install it with `apt-get install -y libopus0` "
            "(Debian/Ubuntu) or `brew install opus` (macOS), or ask for output format pcm_s16le."
        ) from e
    return True



class OpusFrames:
    """One libopus encoder (VOIP, VBR, no FEC/DTX) that encodes whole 20 ms (or `frame_ms`) frames.

    With the C helper built (gateway/_opus_frames.c) a block of frames is one call that releases the GIL once; without
    it opuslib encodes frame by frame, each call taking and dropping the GIL (same packets, more contention)."""

    def __init__(self, fmt: OutputFormat):
        opus_available()
        import opuslib
        import opuslib.api.ctl
        import opuslib.api.encoder

        enc = opuslib.Encoder(fmt.sample_rate, 1, opuslib.APPLICATION_VOIP)
        enc.bitrate = fmt.bitrate
        enc.vbr = 1
        # opuslib 3.0.1's `inband_fec` and `dtx` property setters are broken; set both through the raw ctl
        opuslib.api.encoder.encoder_ctl(enc.encoder_state, opuslib.api.ctl.set_inband_fec, 0)
        opuslib.api.encoder.encoder_ctl(enc.encoder_state, opuslib.api.ctl.set_dtx, 0)
        opuslib.api.encoder.encoder_ctl(enc.encoder_state, opuslib.api.ctl.set_complexity, fmt.complexity)
        self._encoder = enc  # owns the libopus state the addresses below point into
        self.complexity = fmt.complexity
        self.lookahead: int = enc.lookahead
        self.frame_samples = fmt.frame_samples
        self._batch = _opus_batch_encoder()
        self._addresses = (ctypes.cast(opuslib.api.libopus.opus_encode_float, ctypes.c_void_p).value,
                           ctypes.cast(enc.encoder_state, ctypes.c_void_p).value)

    def encode(self, block: np.ndarray, complexity: int | None = None) -> list[bytes]:
        """float32 samples, a whole number of frames -> one Opus packet per frame; `complexity`: these frames' own
        (libopus reads it per frame: the stream goes on at the format's after them)."""
        if complexity is None or complexity == self.complexity:
            return self._encode(block)
        self._set_complexity(complexity)
        try:
            return self._encode(block)
        finally:
            self._set_complexity(self.complexity)

    def _set_complexity(self, complexity: int) -> None:
        import opuslib.api.ctl
        import opuslib.api.encoder

        opuslib.api.encoder.encoder_ctl(self._encoder.encoder_state, opuslib.api.ctl.set_complexity, complexity)

    def _encode(self, block: np.ndarray) -> list[bytes]:
        block = np.ascontiguousarray(block, dtype=np.float32)
        n = self.frame_samples
        if len(block) % n:
            raise ValueError(f"Opus input must be whole frames of {n} samples, got {len(block)}")
        if self._batch is not None:
            return self._batch.encode(*self._addresses, block, n)
        return [self._encoder.encode_float(block[i:i + n].tobytes(), n) for i in range(0, len(block), n)]


@functools.cache
def _opus_batch_encoder() -> Any:
    """gateway._opus_frames when it was built (`pip install` compiles it where a C compiler is found), else None;
    VOXGATE_OPUS_BATCH=0 forces the frame-by-frame path."""
    if not GatewaySettings.from_env().opus_batch:
        return None
    try:
        from gateway import _opus_frames
    except ImportError:
        return None
    return _opus_frames
