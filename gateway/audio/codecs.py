"""One codec per output format, and `CODECS`, the one registry from format name to codec class: how a block of
resampled samples becomes wire chunks. A new format is a class here and a row in `gateway.audio.formats`."""

from __future__ import annotations

from typing import ClassVar, Protocol

import numpy as np

from gateway.audio.containers import OggOpusWriter, WavStreamWriter, _AvStream
from gateway.audio.formats import OutputFormat
from gateway.audio.g711 import alaw_encode, mulaw_encode
from gateway.audio.opus import OpusFrames
from gateway.audio.pcm import float_to_int16


class Codec(Protocol):
    """What `Encoder` needs of a format. A codec may also have `emit_head(block, produced)`: the frames that start a
    listener's audio, coded for speed (`Encoder.encode_head`); without it they are `emit`'s."""

    framed: bool  # fixed-size frames (Opus, PCM, G.711, Ogg Opus); WAV/MP3/FLAC/AAC stream whatever arrives
    lookahead: int  # output-rate samples of codec delay before the first real sample (Opus pre-skip)

    def emit(self, block: np.ndarray, end: bool, produced: int) -> list[bytes]:
        """`block`: whole frames (framed) or whatever arrived -> wire chunks; `end`: the turn's last block;
        `produced`: output-rate samples of real audio so far."""
        ...


class PcmFrames:
    """pcm_s16le: one little-endian int16 frame per `frame_ms`."""

    framed = True
    lookahead = 0

    def __init__(self, fmt: OutputFormat):
        self.frame_samples = fmt.frame_samples

    def _frames(self, block: np.ndarray) -> list[np.ndarray]:
        pcm = float_to_int16(block)
        return [pcm[i:i + self.frame_samples] for i in range(0, len(pcm), self.frame_samples)]

    def emit(self, block: np.ndarray, end: bool, produced: int) -> list[bytes]:
        return [f.astype("<i2").tobytes() for f in self._frames(block)]


class MulawFrames(PcmFrames):
    """G.711 mu-law frames."""

    def emit(self, block: np.ndarray, end: bool, produced: int) -> list[bytes]:
        return [mulaw_encode(f) for f in self._frames(block)]


class AlawFrames(PcmFrames):
    """G.711 A-law frames."""

    def emit(self, block: np.ndarray, end: bool, produced: int) -> list[bytes]:
        return [alaw_encode(f) for f in self._frames(block)]


class OpusPackets:
    """Raw Opus: one packet per frame."""

    framed = True

    def __init__(self, fmt: OutputFormat):
        self._opus = OpusFrames(fmt)
        self.lookahead: int = self._opus.lookahead
        self._head_complexity: int | None = None  # read on the first head (in the encoder's process or thread)

    def emit(self, block: np.ndarray, end: bool, produced: int) -> list[bytes]:
        return self._opus.encode(block)

    def emit_head(self, block: np.ndarray, produced: int) -> list[bytes]:
        """At VOXGATE_OPUS_HEAD_COMPLEXITY, or the format's complexity when that is lower."""
        if self._head_complexity is None:
            from gateway.settings import GatewaySettings

            self._head_complexity = min(self._opus.complexity, GatewaySettings.from_env().opus_head_complexity)
        return self._opus.encode(block, self._head_complexity)


class _Container:
    """A byte stream whose header goes out with the first chunk."""

    framed: ClassVar[bool] = False
    lookahead = 0

    def __init__(self) -> None:
        self._started = False

    def header(self) -> bytes:
        return b""

    def body(self, block: np.ndarray, end: bool, produced: int) -> list[bytes]:
        raise NotImplementedError

    def emit(self, block: np.ndarray, end: bool, produced: int) -> list[bytes]:
        chunks = []
        if not self._started:
            self._started = True
            chunks.append(self.header())
        chunks.extend(self.body(block, end, produced))
        return [c for c in chunks if c]


class OggOpusPages(_Container):
    """Ogg Opus: Opus packets in Ogg pages; the last page's granule trims the final frame's padding."""

    framed = True

    def __init__(self, fmt: OutputFormat):
        super().__init__()
        self._opus = OpusFrames(fmt)
        self.lookahead: int = self._opus.lookahead
        self._scale = 48000 // fmt.sample_rate
        self._ogg = OggOpusWriter(fmt.frame_samples * self._scale, self.lookahead * self._scale, fmt.sample_rate)

    def header(self) -> bytes:
        return self._ogg.header()

    def body(self, block: np.ndarray, end: bool, produced: int) -> list[bytes]:
        packets = self._opus.encode(block)
        return [self._ogg.write(packets, produced * self._scale if end else None)]


class WavChunks(_Container):
    """WAV: a streaming header, then int16 samples as they arrive."""

    def __init__(self, fmt: OutputFormat):
        super().__init__()
        self._wav = WavStreamWriter(fmt.sample_rate)

    def header(self) -> bytes:
        return self._wav.header()

    def body(self, block: np.ndarray, end: bool, produced: int) -> list[bytes]:
        return [self._wav.write(block)]


class AvChunks(_Container):
    """MP3 / FLAC / AAC through PyAV; the end flushes the codec and closes the container."""

    def __init__(self, fmt: OutputFormat):
        super().__init__()
        self._av = _AvStream(fmt)

    def body(self, block: np.ndarray, end: bool, produced: int) -> list[bytes]:
        chunks = [self._av.write(block)]
        if end:
            chunks.append(self._av.close())
        return chunks


CODECS: dict[str, type[Codec]] = {
    "opus": OpusPackets,
    "pcm_s16le": PcmFrames,
    "mulaw": MulawFrames,
    "alaw": AlawFrames,
    "wav": WavChunks,
    "ogg_opus": OggOpusPages,
    "mp3": AvChunks,
    "flac": AvChunks,
    "aac": AvChunks,
}
