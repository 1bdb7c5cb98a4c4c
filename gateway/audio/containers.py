"""Containers for HTTP streaming: Ogg pages around Opus packets, a streaming WAV header, and MP3 /
FLAC / AAC through PyAV when it is installed."""

from __future__ import annotations

import struct

import numpy as np

from gateway.audio.formats import OutputFormat
from gateway.audio.pcm import float_to_int16


def av_available() -> bool:
    """True when PyAV (`pip install av`) is importable: it provides mp3, flac and aac."""
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True



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
