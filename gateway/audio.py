"""Audio out of the gateway: float32 PCM at the model rate in, wire frames out. No I/O.

One `Encoder` per turn: resample (soxr, stream state kept across chunks so chunk boundaries never click), cut into
fixed frames (remainders carried across chunks), encode (Opus, PCM s16le, G.711 mu-law/A-law), and on `finish()`
flush everything so the ending is never cut off. Container formats for HTTP streaming (WAV, Ogg Opus, and through
PyAV when installed: MP3, FLAC, AAC) come out of the same Encoder as byte chunks to concatenate.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import soxr

from gateway.settings import GatewaySettings

FORMATS = ("opus", "pcm_s16le", "mulaw", "alaw", "wav", "ogg_opus", "mp3", "flac", "aac")
NATIVE_FORMATS = ("opus", "pcm_s16le", "mulaw", "alaw")  # one binary frame per packet on the native WebSocket
KINDS = {"opus": 1, "pcm_s16le": 2, "mulaw": 3, "alaw": 4}  # binary header kind; container formats have kind 0

OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
PCM_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
AAC_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
OPUS_FRAME_MS = (10, 20, 40, 60)

# format -> (default rate, allowed rates); frame_ms only shapes frames for the frame formats
_RATES: dict[str, tuple[int, tuple[int, ...]]] = {
    "opus": (48000, OPUS_RATES),
    "ogg_opus": (48000, OPUS_RATES),
    "pcm_s16le": (24000, PCM_RATES),
    "wav": (24000, PCM_RATES),
    "mulaw": (8000, (8000,)),
    "alaw": (8000, (8000,)),
    "mp3": (24000, MP3_RATES),
    "flac": (24000, PCM_RATES),
    "aac": (24000, AAC_RATES),
}


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


def av_available() -> bool:
    """True when PyAV (`pip install av`) is importable: it provides mp3, flac and aac."""
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class OutputFormat:
    """The audio a client asked for (`session.start` "output")."""

    format: str = "opus"
    sample_rate: int = 48000
    bitrate: int = 32000
    frame_ms: int = 20
    # Opus encoder effort, 0..10. Measured on one core (speech-like input, VOIP, 32 kbps): 10 -> ~77 real-time
    # streams, 5 -> ~180. Speech at 32 kbps barely gains above 5, and the gateway must hold hundreds of streams.
    complexity: int = 5

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"output.format: {self.format!r} is not one of {', '.join(FORMATS)}")
        _, rates = _RATES[self.format]
        if type(self.sample_rate) is not int or self.sample_rate not in rates:
            raise ValueError(
                f"output.sample_rate: {self.sample_rate!r} is not allowed for {self.format} "
                f"(allowed: {', '.join(map(str, rates))})"
            )
        if type(self.bitrate) is not int or not 6000 <= self.bitrate <= 510000:
            raise ValueError(f"output.bitrate: {self.bitrate!r} must be an integer in 6000..510000")
        frame_ms_ok = self.frame_ms in OPUS_FRAME_MS if "opus" in self.format else 5 <= self.frame_ms <= 1000
        if type(self.frame_ms) is not int or not frame_ms_ok:
            allowed = ", ".join(map(str, OPUS_FRAME_MS)) if "opus" in self.format else "5..1000"
            raise ValueError(f"output.frame_ms: {self.frame_ms!r} is not allowed for {self.format} ({allowed})")
        if type(self.complexity) is not int or not 0 <= self.complexity <= 10:
            raise ValueError(f"output.complexity: {self.complexity!r} must be an integer in 0..10")
        if self.sample_rate * self.frame_ms % 1000:
            raise ValueError(
                f"output.frame_ms: {self.frame_ms} ms is not a whole number of samples at {self.sample_rate} Hz"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, model_rate: int | None = None) -> OutputFormat:
        """Parse `session.start` "output"; missing fields take the format's defaults (wav/flac: the model rate)."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ValueError(f"output.{key}: unknown field")
        fmt = d.get("format", cls.format)
        if fmt not in FORMATS:
            raise ValueError(f"output.format: {fmt!r} is not one of {', '.join(FORMATS)}")
        default_rate, rates = _RATES[fmt]
        if fmt in ("wav", "flac") and model_rate in rates:
            default_rate = model_rate
        d.setdefault("sample_rate", default_rate)
        return cls(**d)

    @property
    def kind(self) -> int:
        return KINDS.get(self.format, 0)

    @property
    def frame_samples(self) -> int:
        return self.sample_rate * self.frame_ms // 1000


# --- binary frame header (PROTOCOL.md) -----------------------------------------------------------------------------
# magic u8 'V', version u8, kind u8, flags u8, index u16, seq u32, pts_ms u32: 14 bytes (PROTOCOL.md's "12-byte"
# disagrees with its own field list), network byte order (big-endian: DataView's default in the browser).

FRAME_MAGIC = 0x56  # 'V'
FRAME_VERSION = 1
_HEADER = struct.Struct("!BBBBHII")
HEADER_SIZE = _HEADER.size
FLAG_LAST = 0x01  # last frame of the turn


def pack_frame_header(kind: int, flags: int, index: int, seq: int, pts_ms: int) -> bytes:
    """The 14-byte header in front of every binary audio frame."""
    for name, value, top in (("kind", kind, 0xFF), ("flags", flags, 0xFF), ("index", index, 0xFFFF),
                             ("seq", seq, 0xFFFFFFFF), ("pts_ms", pts_ms, 0xFFFFFFFF)):
        if type(value) is not int or not 0 <= value <= top:
            raise ValueError(f"{name}: {value!r} is not an integer in 0..{top}")
    return _HEADER.pack(FRAME_MAGIC, FRAME_VERSION, kind, flags, index, seq, pts_ms)


def pack_frames(kind: int, index: int, seq: int, pts_ms: float, frame_ms: float, payloads: list[bytes],
                last: bool = False) -> list[bytes]:
    """Consecutive frames of one turn, header + payload each: `payloads[i]` gets seq `seq + i` and pts `pts_ms + i *
    frame_ms`; `last` flags the final one. The bytes of pack_frame_header per frame without its per-field checks
    (this runs for every frame the gateway sends): kind comes from OutputFormat, the counters wrap."""
    head, index, final = _HEADER.pack, index & 0xFFFF, len(payloads) - 1 if last else -1
    return [head(FRAME_MAGIC, FRAME_VERSION, kind, FLAG_LAST if i == final else 0, index, (seq + i) & 0xFFFFFFFF,
                 int(pts_ms + i * frame_ms) & 0xFFFFFFFF) + payload for i, payload in enumerate(payloads)]


def unpack_frame_header(data: bytes) -> tuple[int, int, int, int, int]:
    """(kind, flags, index, seq, pts_ms) from the first HEADER_SIZE bytes of a binary frame."""
    if len(data) < HEADER_SIZE:
        raise ValueError(f"header: {len(data)} bytes, need {HEADER_SIZE}")
    magic, version, kind, flags, index, seq, pts_ms = _HEADER.unpack_from(data)
    if magic != FRAME_MAGIC:
        raise ValueError(f"magic: 0x{magic:02x}, expected 0x{FRAME_MAGIC:02x}")
    if version != FRAME_VERSION:
        raise ValueError(f"version: {version} is not supported (expected {FRAME_VERSION})")
    return kind, flags, index, seq, pts_ms


# --- G.711 ----------------------------------------------------------------------------------------------------------
# Hand-written because the stdlib `audioop` is removed in Python 3.13. Same algorithm as audioop (Sun's g711.c), so
# output is bit-identical (tested against audioop on Python 3.11). Encoding goes through a 64 Ki-entry table over all
# int16 values, built once with the vectorised reference formula.

_ULAW_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_SEG_END = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def _ulaw_from_int16(x: np.ndarray) -> np.ndarray:
    v = x.astype(np.int32) >> 2  # 14-bit
    mask = np.where(v < 0, 0x7F, 0xFF)
    v = np.minimum(np.abs(v), 8159) + 0x21  # clip, then add the bias (0x84 >> 2)
    seg = np.searchsorted(_ULAW_SEG_END, v)  # first segment whose end >= v
    code = np.where(seg >= 8, 0x7F, (np.minimum(seg, 7) << 4) | ((v >> (seg + 1)) & 0xF))
    return (code ^ mask).astype(np.uint8)


def _alaw_from_int16(x: np.ndarray) -> np.ndarray:
    v = x.astype(np.int32) >> 3  # 13-bit
    mask = np.where(v >= 0, 0xD5, 0x55)
    v = np.where(v >= 0, v, -v - 1)
    seg = np.searchsorted(_ALAW_SEG_END, v)
    quant = np.where(seg < 2, v >> 1, v >> np.maximum(seg, 1)) & 0xF
    code = np.where(seg >= 8, 0x7F, (np.minimum(seg, 7) << 4) | quant)
    return (code ^ mask).astype(np.uint8)


def _ulaw_to_int16(code: np.ndarray) -> np.ndarray:
    u = ~code.astype(np.int32) & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


def _alaw_to_int16(code: np.ndarray) -> np.ndarray:
    a = code.astype(np.int32) ^ 0x55
    seg = (a & 0x70) >> 4
    t = ((a & 0x0F) << 4) + np.where(seg == 0, 8, 0x108)
    t = np.where(seg > 1, t << np.maximum(seg - 1, 0), t)
    return np.where(a & 0x80, t, -t).astype(np.int16)


_ALL_INT16 = np.arange(-32768, 32768, dtype=np.int32)
_ULAW_ENCODE = _ulaw_from_int16(_ALL_INT16)  # indexed by sample + 32768
_ALAW_ENCODE = _alaw_from_int16(_ALL_INT16)
_ULAW_DECODE = _ulaw_to_int16(np.arange(256))
_ALAW_DECODE = _alaw_to_int16(np.arange(256))


def mulaw_encode(pcm16: np.ndarray) -> bytes:
    """int16 samples -> G.711 mu-law bytes (one per sample)."""
    return _ULAW_ENCODE[np.asarray(pcm16, dtype=np.int16).astype(np.int32) + 32768].tobytes()


def mulaw_decode(data: bytes) -> np.ndarray:
    """G.711 mu-law bytes -> int16 samples."""
    return _ULAW_DECODE[np.frombuffer(data, dtype=np.uint8)]


def alaw_encode(pcm16: np.ndarray) -> bytes:
    """int16 samples -> G.711 A-law bytes (one per sample)."""
    return _ALAW_ENCODE[np.asarray(pcm16, dtype=np.int16).astype(np.int32) + 32768].tobytes()


def alaw_decode(data: bytes) -> np.ndarray:
    """G.711 A-law bytes -> int16 samples."""
    return _ALAW_DECODE[np.frombuffer(data, dtype=np.uint8)]


def float_to_int16(pcm: np.ndarray) -> np.ndarray:
    """float [-1, 1] -> int16, clipped (the model can overshoot slightly)."""
    return np.rint(np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16)


# --- containers -----------------------------------------------------------------------------------------------------

def _ogg_crc_table() -> list[int]:
    table = []
    for i in range(256):
        r = i << 24
        for _ in range(8):
            r = ((r << 1) ^ 0x04C11DB7) if r & 0x80000000 else r << 1
        table.append(r & 0xFFFFFFFF)
    return table


_OGG_CRC = _ogg_crc_table()


def _ogg_crc(data: bytes) -> int:
    crc = 0
    for b in data:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ _OGG_CRC[(crc >> 24) ^ b]
    return crc


class OggOpusWriter:
    """Ogg Opus pages (RFC 7845) around raw Opus packets, for streaming over HTTP.

    Granule positions count 48 kHz samples decoded so far, pre-skip included; the end-of-stream page carries the last
    packet and a granule that trims the final frame's padding, so players stop exactly at the end of the speech.
    """

    def __init__(self, frame_samples_48k: int, pre_skip: int = 312, input_rate: int = 48000, serial: int = 0x766F78):
        self.frame_samples_48k = frame_samples_48k
        self.pre_skip = pre_skip
        self.input_rate = input_rate
        self.serial = serial
        self._page_no = 0
        self._packets = 0  # packets written so far

    def header(self) -> bytes:
        """The OpusHead (beginning of stream) and OpusTags pages."""
        head = b"OpusHead" + struct.pack("<BBHIhB", 1, 1, self.pre_skip, self.input_rate, 0, 0)
        vendor = b"voxgate"
        tags = b"OpusTags" + struct.pack("<I", len(vendor)) + vendor + struct.pack("<I", 0)
        return self._page([head], 0, 0x02) + self._page([tags], 0, 0)

    def write(self, packets: list[bytes], end_samples_48k: int | None = None) -> bytes:
        """Pages for these packets; `end_samples_48k` (real audio length) makes the last page end the stream."""
        packets = list(packets)
        out = b""
        while packets:
            # a page holds at most 255 lacing values; an Opus packet (<= 1275 bytes) needs at most 6
            batch, lacing = [], 0
            while packets and lacing + len(packets[0]) // 255 + 1 <= 255:
                lacing += len(packets[0]) // 255 + 1
                batch.append(packets.pop(0))
            self._packets += len(batch)
            granule = self._packets * self.frame_samples_48k
            last = end_samples_48k is not None and not packets
            if last:
                granule = min(granule, self.pre_skip + end_samples_48k)
            out += self._page(batch, granule, 0x04 if last else 0)
        return out

    def _page(self, packets: list[bytes], granule: int, flags: int) -> bytes:
        lacing = bytearray()
        for p in packets:
            lacing += b"\xff" * (len(p) // 255) + bytes([len(p) % 255])
        head = struct.pack("<4sBBqIIIB", b"OggS", 0, flags, granule, self.serial, self._page_no, 0, len(lacing))
        self._page_no += 1
        page = bytearray(head + lacing + b"".join(packets))
        page[22:26] = struct.pack("<I", _ogg_crc(bytes(page)))
        return bytes(page)


class WavStreamWriter:
    """A WAV header for a stream of unknown length (sizes 0xFFFFFFFF, which players read as "until EOF")."""

    def __init__(self, sample_rate: int, channels: int = 1):
        self.sample_rate = sample_rate
        self.channels = channels

    def header(self) -> bytes:
        block = 2 * self.channels
        fmt = struct.pack("<HHIIHH", 1, self.channels, self.sample_rate, self.sample_rate * block, block, 16)
        return b"RIFF" + b"\xff\xff\xff\xff" + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + b"\xff" * 4

    def write(self, pcm: np.ndarray) -> bytes:
        return float_to_int16(pcm).astype("<i2").tobytes()


class _ByteSink:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data, self.parts = b"".join(self.parts), []
        return data


class _AvStream:
    """MP3 / FLAC / AAC (ADTS) through PyAV, written to a non-seekable sink, so bytes flow as they are encoded."""

    CONTAINERS = {"mp3": ("mp3", "libmp3lame"), "flac": ("flac", "flac"), "aac": ("adts", "aac")}

    def __init__(self, fmt: OutputFormat):
        if not av_available():
            raise RuntimeError(f"output.format {fmt.format!r} needs PyAV: `pip install av`")
        import av

        self._av = av
        self._sink = _ByteSink()
        container, codec = self.CONTAINERS[fmt.format]
        self._container = av.open(self._sink, mode="w", format=container)
        self._stream = self._container.add_stream(codec, rate=fmt.sample_rate)
        self._stream.layout = "mono"
        if fmt.format != "flac":
            self._stream.bit_rate = fmt.bitrate
        self._rate = fmt.sample_rate
        self._pts = 0

    def write(self, pcm: np.ndarray) -> bytes:
        if len(pcm):
            frame = self._av.AudioFrame.from_ndarray(pcm[None, :].astype(np.float32), format="flt", layout="mono")
            frame.sample_rate, frame.pts = self._rate, self._pts
            self._pts += len(pcm)
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        return self._sink.take()

    def close(self) -> bytes:
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._sink.take()


# --- resampling and the per-turn encoder ----------------------------------------------------------------------------

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


class Encoder:
    """One turn's audio: resample -> frame -> encode. `encode()` per model chunk, `finish()` once at the end."""

    def __init__(self, fmt: OutputFormat, input_rate: int):
        self.fmt = fmt
        self.kind = fmt.kind
        self.frame_samples = fmt.frame_samples
        self.lookahead = 0  # output-rate samples of codec delay before the first real sample (Opus pre-skip)
        self._resampler = Resampler(input_rate, fmt.sample_rate)
        self._pending = np.zeros(0, dtype=np.float32)
        self._produced = 0  # output-rate samples of real audio so far
        self._started = False
        self._finished = False
        self._drained = True  # nothing encoded since the start or the last `drain`
        self._opus = None
        self._ogg: OggOpusWriter | None = None
        self._wav = WavStreamWriter(fmt.sample_rate) if fmt.format == "wav" else None
        self._av = _AvStream(fmt) if fmt.format in _AvStream.CONTAINERS else None
        if "opus" in fmt.format:
            self._opus = OpusFrames(fmt)
            self.lookahead = self._opus.lookahead
            if fmt.format == "ogg_opus":
                scale = 48000 // fmt.sample_rate
                self._ogg = OggOpusWriter(self.frame_samples * scale, self.lookahead * scale, fmt.sample_rate)

    @property
    def framed(self) -> bool:
        """Fixed-size frames (Opus, PCM, G.711); WAV/MP3/FLAC/AAC stream whatever arrives."""
        return self._wav is None and self._av is None

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        """float32 mono samples at the input rate -> zero or more frames (or container byte chunks)."""
        if self._finished:
            raise RuntimeError("Encoder.encode() after finish()")
        pcm = np.asarray(pcm)
        if pcm.ndim != 1:
            raise ValueError(f"pcm: expected mono samples (1-D), got shape {pcm.shape}")
        out = self._resampler.process(pcm)
        self._produced += len(out)
        self._drained = self._drained and not len(pcm)
        if not self.framed:
            return self._emit(out, end=False)
        buf = np.concatenate([self._pending, out])
        n = len(buf) // self.frame_samples * self.frame_samples
        self._pending = buf[n:]
        return self._emit(buf[:n], end=False)

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
        fmt = self.fmt.format
        if fmt in ("pcm_s16le", "mulaw", "alaw"):
            pcm = float_to_int16(block)
            frames = [pcm[i:i + self.frame_samples] for i in range(0, len(pcm), self.frame_samples)]
            if fmt == "pcm_s16le":
                return [f.astype("<i2").tobytes() for f in frames]
            return [mulaw_encode(f) if fmt == "mulaw" else alaw_encode(f) for f in frames]
        packets = self._opus.encode(block) if self._opus else []
        if fmt == "opus":
            return packets
        chunks = []
        if not self._started:
            self._started = True
            chunks.append(self._ogg.header() if self._ogg else self._wav.header() if self._wav else b"")
        if self._ogg is not None:
            end_48k = self._produced * (48000 // self.fmt.sample_rate) if end else None
            chunks.append(self._ogg.write(packets, end_48k))
        elif self._wav is not None:
            chunks.append(self._wav.write(block))
        else:
            chunks.append(self._av.write(block))
            if end:
                chunks.append(self._av.close())
        return [c for c in chunks if c]


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
        self.lookahead: int = enc.lookahead
        self.frame_samples = fmt.frame_samples
        self._batch = _opus_batch_encoder()
        self._addresses = (ctypes.cast(opuslib.api.libopus.opus_encode_float, ctypes.c_void_p).value,
                           ctypes.cast(enc.encoder_state, ctypes.c_void_p).value)

    def encode(self, block: np.ndarray) -> list[bytes]:
        """float32 samples, a whole number of frames -> one Opus packet per frame."""
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


__all__ = [
    "FORMATS", "NATIVE_FORMATS", "KINDS", "HEADER_SIZE", "FLAG_LAST", "OutputFormat", "Resampler", "Encoder",
    "OggOpusWriter", "OpusFrames", "WavStreamWriter", "pack_frame_header", "pack_frames", "unpack_frame_header",
    "mulaw_encode", "mulaw_decode", "alaw_encode", "alaw_decode", "float_to_int16", "opus_available", "av_available",
]
