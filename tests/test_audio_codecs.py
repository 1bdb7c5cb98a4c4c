"""gateway.audio: every format decodes back to the right rate, length and signal; chunking never changes the output."""

import io
import sys
import warnings

import numpy as np
import opuslib
import pytest
import soundfile as sf
import soxr

from gateway.audio import (
    CODECS,
    FORMATS,
    NATIVE_FORMATS,
    Encoder,
    OpusFrames,
    OutputFormat,
    Resampler,
    alaw_decode,
    alaw_encode,
    av_available,
    mulaw_decode,
    mulaw_encode,
    opus_available,
)

MODEL_RATES = (16000, 44100, 48000)  # VoxCPM-0.5B, VoxCPM1.5, VoxCPM2


def speech_like(rate: int, seconds: float = 0.73, seed: int = 0) -> np.ndarray:
    """A gliding, jittered pitch with decaying harmonics, a syllable-rate envelope and breath noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    f0 = 110 + 80 * t + 15 * np.sin(2 * np.pi * 2.3 * t) + rng.normal(0, 0.5, len(t)).cumsum() / rate * 50
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(k * phase + k) / k for k in range(1, 10))
    envelope = 0.5 * (1 - np.cos(2 * np.pi * 3.1 * t)) * np.clip(t * 30, 0, 1)
    return (0.25 * voiced * envelope + 0.01 * rng.standard_normal(len(t))).astype(np.float32)


def reference(pcm: np.ndarray, in_rate: int, out_rate: int) -> np.ndarray:
    return pcm if in_rate == out_rate else soxr.resample(pcm, in_rate, out_rate)


def snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    n = min(len(ref), len(got))
    ref, got = ref[:n].astype(np.float64), got[:n].astype(np.float64)
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((ref - got) ** 2), 1e-20)))


def spectral_snr_db(ref: np.ndarray, got: np.ndarray, frame: int) -> float:
    """SNR of STFT magnitudes: fair to codecs that keep the spectrum but not the phase (Opus VOIP, AAC)."""
    n = min(len(ref), len(got)) // frame * frame
    window = np.hanning(frame)

    def mag(x: np.ndarray) -> np.ndarray:
        return np.abs(np.fft.rfft(x[:n].reshape(-1, frame) * window, axis=1))

    a, b = mag(ref), mag(got)
    return float(10 * np.log10(np.sum(a**2) / np.sum((a - b) ** 2)))


def decode(fmt: OutputFormat, chunks: list[bytes], encoder: Encoder) -> np.ndarray:
    """Wire bytes -> float samples at fmt.sample_rate, the way a client would decode them."""
    data = b"".join(chunks)
    if fmt.format == "opus":
        decoder = opuslib.Decoder(fmt.sample_rate, 1)
        pcm = [np.frombuffer(decoder.decode_float(p, encoder.frame_samples), np.float32) for p in chunks]
        return np.concatenate(pcm)[encoder.lookahead :]  # a player drops the pre-skip
    if fmt.format == "pcm_s16le":
        return np.frombuffer(data, "<i2") / 32767
    if fmt.format == "mulaw":
        return mulaw_decode(data) / 32767
    if fmt.format == "alaw":
        return alaw_decode(data) / 32767
    if fmt.format in ("wav", "ogg_opus"):
        pcm, rate = sf.read(io.BytesIO(data), dtype="float32")
        assert rate == fmt.sample_rate
        return pcm
    av = pytest.importorskip("av")
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.audio[0].sample_rate == fmt.sample_rate
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
    pcm = np.concatenate(frames) if frames else np.zeros(0, np.float32)
    return pcm / 32768 if pcm.dtype == np.int16 else pcm


def encode(fmt: OutputFormat, pcm: np.ndarray, rate: int, chunk_sizes=None) -> tuple[list[bytes], Encoder]:
    encoder = Encoder(fmt, rate)
    out: list[bytes] = []
    if chunk_sizes is None:
        out += encoder.encode(pcm)
    else:
        i = 0
        for n in chunk_sizes:
            out += encoder.encode(pcm[i : i + n])
            i += n
        assert i >= len(pcm)
    return out + encoder.finish(), encoder


def random_chunks(total: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    sizes = []
    while sum(sizes) < total:
        sizes.append(int(rng.choice([0, 1, 7, 160, 313, 1280, 3840, 5000])))
    return sizes


# (format, model rate, waveform SNR bound, spectral SNR bound). Opus VOIP high-passes and AAC shifts phase, so their
# waveform SNR says little; their spectra must still match. mp3/aac add encoder delay: they are aligned first.
CASES = [
    ("pcm_s16le", 16000, 70, 60),
    ("pcm_s16le", 44100, 70, 60),
    ("wav", 48000, 70, 60),
    ("mulaw", 48000, 30, 25),
    ("alaw", 16000, 30, 25),
    ("opus", 48000, None, 9),
    ("opus", 16000, None, 9),
    ("ogg_opus", 44100, None, 9),
    ("flac", 16000, 70, 60),
    ("mp3", 48000, 15, 12),
    ("aac", 44100, None, 9),
]


@pytest.mark.parametrize("name,rate,min_snr,min_spectral_snr", CASES)
def test_every_format_decodes_to_the_signal_at_the_right_rate_and_length(name, rate, min_snr, min_spectral_snr):
    fmt = OutputFormat.from_dict({"format": name}, model_rate=rate)
    pcm = speech_like(rate)
    chunks, encoder = encode(fmt, pcm, rate)
    got = decode(fmt, chunks, encoder)
    ref = reference(pcm, rate, fmt.sample_rate)

    if name in ("mp3", "aac"):  # encoder delay (priming samples) cannot be signalled in a raw stream
        lag = max(range(0, 2400), key=lambda k: snr_db(ref[:4800], got[k : k + 4800]))
        assert lag < 2400
        got = got[lag:]
        assert len(ref) <= len(got) < len(ref) + 2048
    elif name in ("wav", "flac", "ogg_opus"):
        assert len(got) == len(ref)  # containers carry the exact length (Ogg: end trimming via the granule)
    else:
        assert len(ref) <= len(got) < len(ref) + encoder.frame_samples  # the last frame is padded, nothing lost

    if min_snr is not None:
        assert snr_db(ref, got) > min_snr
    assert spectral_snr_db(ref, got, frame=fmt.sample_rate // 50) > min_spectral_snr


def test_every_format_has_one_codec_and_only_containers_stream_unframed():
    assert set(CODECS) == set(FORMATS)
    for name in FORMATS:
        fmt = OutputFormat.from_dict({"format": name})
        if name in ("mp3", "flac", "aac") and not av_available():
            continue
        encoder = Encoder(fmt, 24000)
        assert encoder.framed == (name in NATIVE_FORMATS or name == "ogg_opus"), name
        assert (encoder.lookahead > 0) == ("opus" in name), name


@pytest.mark.parametrize("name", [f for f in FORMATS if f != "ogg_opus"])
def test_chunked_input_gives_the_same_bytes_as_one_shot(name):
    if name in ("mp3", "flac", "aac"):
        pytest.importorskip("av")
    rate = 44100  # needs resampling for every format: the resampler must keep its state across chunks
    fmt = OutputFormat.from_dict({"format": name}, model_rate=rate)
    pcm = speech_like(rate, seconds=0.5)
    whole, _ = encode(fmt, pcm, rate)
    for seed in range(3):
        chunked, _ = encode(fmt, pcm, rate, random_chunks(len(pcm), seed))
        assert b"".join(chunked) == b"".join(whole)
        if name in ("opus", "pcm_s16le", "mulaw", "alaw"):
            assert chunked == whole  # same frame boundaries too


def test_ogg_opus_chunked_decodes_to_the_same_audio():
    pcm = speech_like(16000, seconds=0.5)
    fmt = OutputFormat(format="ogg_opus")
    whole, enc = encode(fmt, pcm, 16000)
    chunked, _ = encode(fmt, pcm, 16000, random_chunks(len(pcm), seed=5))
    assert np.array_equal(decode(fmt, whole, enc), decode(fmt, chunked, enc))


def test_ogg_opus_pages_are_well_formed():
    fmt = OutputFormat(format="ogg_opus")
    chunks, _ = encode(fmt, speech_like(48000, seconds=0.3), 48000, [4800] * 4)
    data = b"".join(chunks)
    pages, pos = [], 0
    while pos < len(data):
        assert data[pos : pos + 4] == b"OggS"
        flags, granule = data[pos + 5], int.from_bytes(data[pos + 6 : pos + 14], "little", signed=True)
        nseg = data[pos + 26]
        size = 27 + nseg + sum(data[pos + 27 : pos + 27 + nseg])
        pages.append((flags, granule, data[pos + 27 + nseg : pos + size]))
        pos += size
    assert pos == len(data)
    assert pages[0][0] == 0x02 and pages[0][2].startswith(b"OpusHead")
    assert int.from_bytes(pages[0][2][10:12], "little") == 312  # pre-skip
    assert pages[1][2].startswith(b"OpusTags")
    assert [p[0] for p in pages[2:]] == [0] * (len(pages) - 3) + [0x04]  # only the last page ends the stream
    granules = [p[1] for p in pages[2:]]
    assert granules == sorted(granules)
    assert granules[-1] == 312 + int(0.3 * 48000)


@pytest.mark.parametrize("in_rate,out_rate", [(16000, 48000), (44100, 24000), (48000, 8000)])
def test_streaming_resampler_matches_one_shot_resampling(in_rate, out_rate):
    pcm = speech_like(in_rate, seconds=0.4)
    resampler = Resampler(in_rate, out_rate)
    parts, i = [], 0
    for n in random_chunks(len(pcm), seed=1):
        parts.append(resampler.process(pcm[i : i + n]))
        i += n
    parts.append(resampler.process(np.zeros(0, np.float32), last=True))
    streamed = np.concatenate(parts)
    one_shot = soxr.resample(pcm, in_rate, out_rate)
    assert len(streamed) == len(one_shot)
    assert np.max(np.abs(streamed - one_shot)) < 1e-4
    # the failure this guards against: resampling each chunk on its own leaves edges (clicks) at every boundary
    naive = np.concatenate([soxr.resample(pcm[j : j + 1280], in_rate, out_rate) for j in range(0, len(pcm), 1280)])
    assert np.max(np.abs(naive[: len(one_shot)] - one_shot[: len(naive)])) > 1e-3


def test_frames_have_the_configured_size():
    pcm = speech_like(48000, seconds=0.33)
    for name, frame_ms, frame_bytes in (("mulaw", 20, 160), ("alaw", 40, 320), ("pcm_s16le", 10, 480)):
        fmt = OutputFormat.from_dict({"format": name, "frame_ms": frame_ms})
        chunks, encoder = encode(fmt, pcm, 48000, [960] * 17)
        assert {len(c) for c in chunks} == {frame_bytes}
        assert encoder.kind == {"pcm_s16le": 2, "mulaw": 3, "alaw": 4}[name]
    fmt = OutputFormat(frame_ms=60)
    chunks, encoder = encode(fmt, pcm, 48000)
    decoder = opuslib.Decoder(48000, 1)
    assert {len(decoder.decode_float(p, 2880)) // 4 for p in chunks} == {2880}
    assert encoder.kind == 1 and encoder.frame_samples == 2880


def test_an_empty_turn_still_produces_a_valid_stream():
    for name in ("opus", "ogg_opus", "pcm_s16le", "wav", "flac"):
        fmt = OutputFormat.from_dict({"format": name})
        encoder = Encoder(fmt, 16000)
        chunks = encoder.encode(np.zeros(0, np.float32)) + encoder.finish()
        assert encoder.finish() == []
        got = decode(fmt, chunks, encoder)
        assert len(got) < encoder.frame_samples and np.all(np.abs(got) < 1e-3)


@pytest.mark.parametrize("name, out_rate, rate", [("pcm_s16le", 24000, 16000), ("mulaw", 8000, 48000),
                                                  ("opus", 48000, 16000)])
def test_drain_puts_out_everything_encoded_so_far_and_the_turn_goes_on(name, out_rate, rate):
    fmt = OutputFormat.from_dict({"format": name, "sample_rate": out_rate})
    pcm = speech_like(rate, seconds=0.5)
    half = len(pcm) // 2 + 7  # not a whole frame
    encoder = Encoder(fmt, rate)
    first = encoder.encode(pcm[:half])
    drained, padding = encoder.drain()
    assert encoder.drain() == ([], 0)  # nothing new since: no frame of silence per flush
    # everything fed so far is out (whole frames, the last padded with silence past the codec delay)
    out = len(first + drained) * encoder.frame_samples
    fed = round(half * fmt.sample_rate / rate)
    assert drained and abs(out - padding - fed) <= 1  # soxr's count may round the other way
    assert encoder.lookahead <= padding < encoder.lookahead + encoder.frame_samples
    rest = encoder.encode(pcm[half:]) + encoder.finish()
    got = decode(fmt, first + drained + rest, encoder)
    expected = soxr.resample(pcm, rate, fmt.sample_rate)
    # the audio goes on after the inserted silence; the end is whole
    assert len(got) - (len(expected) + padding) in range(0, encoder.frame_samples + 2)
    tail = got[fed + padding:fed + padding + len(expected) - fed]
    corr = np.corrcoef(tail[fmt.sample_rate // 20:], expected[fed:][fmt.sample_rate // 20:len(tail)])[0, 1]
    assert corr > (0.75 if name == "opus" else 0.95)  # Opus is lossy (and high-passes): its waveform drifts more


def test_encoder_rejects_bad_input():
    encoder = Encoder(OutputFormat(format="pcm_s16le"), 24000)
    with pytest.raises(ValueError, match="pcm"):
        encoder.encode(np.zeros((2, 10), np.float32))
    encoder.finish()
    with pytest.raises(RuntimeError):
        encoder.encode(np.zeros(10, np.float32))


def test_samples_beyond_full_scale_are_clipped_not_wrapped():
    loud = np.array([1.7, -1.7, 1.0, -1.0], np.float32)
    chunks, _ = encode(OutputFormat(format="pcm_s16le", sample_rate=24000, frame_ms=20), loud, 24000)
    assert np.frombuffer(b"".join(chunks), "<i2")[:4].tolist() == [32767, -32767, 32767, -32767]


# --- G.711 against Python 3.11's audioop (removed in 3.13: our implementation replaces it) --------------------------

def _audioop():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pytest.importorskip("audioop", reason="audioop was removed in Python 3.13")


def test_g711_is_bit_exact_with_audioop_for_every_sample_and_code():
    audioop = _audioop()
    every_sample = np.arange(-32768, 32768, dtype=np.int16)
    every_code = bytes(range(256))
    assert mulaw_encode(every_sample) == audioop.lin2ulaw(every_sample.tobytes(), 2)
    assert alaw_encode(every_sample) == audioop.lin2alaw(every_sample.tobytes(), 2)
    assert mulaw_decode(every_code).tobytes() == audioop.ulaw2lin(every_code, 2)
    assert alaw_decode(every_code).tobytes() == audioop.alaw2lin(every_code, 2)


def test_g711_roundtrip():
    codes = np.arange(256, dtype=np.uint8)
    assert alaw_encode(alaw_decode(codes.tobytes())) == codes.tobytes()
    mu_codes = codes[codes != 0x7F]  # 0x7F is mu-law's "negative zero": it decodes to 0, which encodes as 0xFF
    assert mulaw_encode(mulaw_decode(mu_codes.tobytes())) == mu_codes.tobytes()
    x = np.arange(-32768, 32768, 7, dtype=np.int16)
    for enc, dec in ((mulaw_encode, mulaw_decode), (alaw_encode, alaw_decode)):
        err = np.abs(dec(enc(x)).astype(np.int32) - x)
        assert np.all(err <= np.maximum(np.abs(x.astype(np.int32)) // 16, 16) + 8)  # logarithmic: ~6% steps


# --- output format validation ------------------------------------------------------------------------------------

def test_output_format_defaults():
    assert OutputFormat.from_dict({}) == OutputFormat("opus", 48000, 32000, 20)
    assert OutputFormat.from_dict(None).format == "opus"
    assert OutputFormat.from_dict({"format": "mulaw"}).sample_rate == 8000
    assert OutputFormat.from_dict({"format": "alaw"}).frame_samples == 160
    assert OutputFormat.from_dict({"format": "pcm_s16le"}).sample_rate == 24000
    assert OutputFormat.from_dict({"format": "pcm_s16le", "sample_rate": 16000}).frame_samples == 320
    assert OutputFormat.from_dict({"format": "wav"}, model_rate=44100).sample_rate == 44100


@pytest.mark.parametrize("d,field", [
    ({"format": "mp4"}, "output.format"),
    ({"format": "pcm_s16le", "sample_rate": 12345}, "output.sample_rate"),
    ({"format": "mulaw", "sample_rate": 16000}, "output.sample_rate"),
    ({"sample_rate": "48000"}, "output.sample_rate"),
    ({"bitrate": 100}, "output.bitrate"),
    ({"frame_ms": 25}, "output.frame_ms"),
    ({"format": "pcm_s16le", "sample_rate": 22050, "frame_ms": 10}, "output.frame_ms"),
    ({"codec": "opus"}, "output.codec"),
    ({"complexity": 11}, "output.complexity"),
    ({"complexity": 5.0}, "output.complexity"),
])
def test_output_format_rejects_bad_values_naming_the_field(d, field):
    with pytest.raises(ValueError, match=field):
        OutputFormat.from_dict(d)


def test_missing_libopus_gives_an_install_hint(monkeypatch):
    assert opus_available()
    monkeypatch.setitem(sys.modules, "opuslib", None)  # import now fails, as it does without libopus0
    with pytest.raises(RuntimeError, match="apt-get install -y libopus0"):
        opus_available()
    with pytest.raises(RuntimeError, match="libopus0"):
        Encoder(OutputFormat(), 48000)


@pytest.mark.parametrize("complexity", [0, 10])
def test_opus_complexity_is_applied_and_decodes(complexity):
    fmt = OutputFormat(complexity=complexity)
    encoder = Encoder(fmt, 48000)
    signal = speech_like(48000, 0.5)
    packets = encoder.encode(signal) + encoder.finish()
    decoder = opuslib.Decoder(48000, 1)
    pcm = np.concatenate([np.frombuffer(decoder.decode(p, fmt.frame_samples), dtype="<i2") for p in packets])
    assert len(pcm) >= len(signal)
    assert np.abs(pcm).max() > 1000  # audible audio came back at either effort


def test_opus_frames_in_one_c_call_match_opuslib_frame_by_frame(monkeypatch):
    """The C helper (gateway/_opus_frames.c, built by `pip install`) gives opuslib's packets byte for byte; the
    frame-by-frame fallback serves when it is absent."""
    from gateway import _opus_frames  # noqa: F401  (scripts/setup.sh installs a compiler: it must be built)
    from gateway.audio.opus import _opus_batch_encoder

    fmt = OutputFormat()
    signal = speech_like(48000, 0.6)[:fmt.frame_samples * 28]
    batched = OpusFrames(fmt)
    assert batched._batch is not None
    one_call = [p for i in range(0, 28, 8) for p in batched.encode(signal[i * 960:(i + 8) * 960])]
    monkeypatch.setenv("VOXGATE_OPUS_BATCH", "0")
    _opus_batch_encoder.cache_clear()
    try:
        fallback = OpusFrames(fmt)
        assert fallback._batch is None
        per_frame = fallback.encode(signal)
    finally:
        _opus_batch_encoder.cache_clear()
    assert len(one_call) == 28 and one_call == per_frame
    with pytest.raises(ValueError, match="whole frames"):
        batched.encode(signal[:100])
    assert batched.encode(signal[:0]) == []
