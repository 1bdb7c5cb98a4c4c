"""Audio out of the gateway: float32 PCM at the model rate in, wire frames out. No I/O.

One `Encoder` per turn: resample (soxr, stream state kept across chunks so chunk boundaries never click), cut into
fixed frames (remainders carried across chunks), encode (Opus, PCM s16le, G.711 mu-law/A-law), and on `finish()`
flush everything so the ending is never cut off. Container formats for HTTP streaming (WAV, Ogg Opus, and through
PyAV when installed: MP3, FLAC, AAC) come out of the same Encoder as byte chunks to concatenate.

The package by job: `formats` (the formats table, `OutputFormat`), `pcm` (int16 conversion, resampling), `g711`,
`opus`, `containers` (Ogg, WAV, PyAV), `codecs` (the one format -> codec registry) and `encoder` (the per-turn
`Encoder`). The native protocol's binary frame header is `gateway.protocol.frames`.
"""

from gateway.audio.codecs import CODECS
from gateway.audio.containers import OggOpusWriter, WavStreamWriter, av_available
from gateway.audio.encoder import Encoder
from gateway.audio.formats import (
    AAC_RATES,
    FORMATS,
    KINDS,
    MP3_RATES,
    NATIVE_FORMATS,
    OPUS_FRAME_MS,
    OPUS_RATES,
    PCM_RATES,
    OutputFormat,
)
from gateway.audio.g711 import alaw_decode, alaw_encode, mulaw_decode, mulaw_encode
from gateway.audio.opus import OpusFrames, opus_available
from gateway.audio.pcm import Resampler, float_to_int16

__all__ = [
    "FORMATS", "NATIVE_FORMATS", "KINDS", "OutputFormat", "Resampler", "Encoder", "OggOpusWriter", "OpusFrames",
    "WavStreamWriter", "mulaw_encode", "mulaw_decode", "alaw_encode", "alaw_decode", "float_to_int16",
    "opus_available", "av_available", "CODECS", "AAC_RATES", "MP3_RATES", "PCM_RATES", "OPUS_RATES", "OPUS_FRAME_MS",
]
