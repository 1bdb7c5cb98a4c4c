"""The frame that starts a listener's audio (`Encoder.encode_head`) is coded at VOXGATE_OPUS_HEAD_COMPLEXITY (default
0), the rest of the stream at the format's complexity: the head's packet is a complexity-0 encoder's, and the stream
decodes as close to the source as one coded at the format's complexity throughout."""

from __future__ import annotations

import numpy as np
import opuslib
import pytest

from gateway.audio import Encoder, OutputFormat
from gateway.settings import GatewaySettings
from tests.test_gateway_encode_split import speech

RATE, STEP, CHUNK = 48000, 960, 7680  # VoxCPM2's rate: 20 ms frames, 160 ms chunks
DELAY = 312  # Opus's encoder delay at 48 kHz


def streams(fmt: OutputFormat, pcm: np.ndarray) -> tuple[list[bytes], list[bytes]]:
    """(one `encode` per chunk, the first chunk as head + rest), each finished."""
    whole, split = Encoder(fmt, RATE), Encoder(fmt, RATE)
    want: list[bytes] = []
    got: list[bytes] = []
    for start in range(0, len(pcm), CHUNK):
        piece = pcm[start:start + CHUNK]
        want += whole.encode(piece)
        if start:
            got += split.encode(piece)
        else:
            head, used = split.encode_head(piece, 1, STEP)
            got += head + split.encode(piece[used:])
    return want + whole.finish(), got + split.finish()


def snr_db(decoded: np.ndarray, source: np.ndarray) -> float:
    x = decoded[DELAY:DELAY + len(source)]
    return float(10 * np.log10(np.sum(source[:len(x)] ** 2) / np.sum((x - source[:len(x)]) ** 2)))


def decode(packets: list[bytes]) -> np.ndarray:
    decoder = opuslib.Decoder(RATE, 1)
    pcm = np.concatenate([np.frombuffer(decoder.decode(p, STEP), dtype="<i2") for p in packets])
    return pcm.astype(np.float32) / 32767.0


@pytest.mark.parametrize("complexity", [5, 10])
def test_the_head_is_coded_at_complexity_0_and_the_stream_as_faithful(complexity: int) -> None:
    pcm = speech(1.6, RATE)
    whole, split = streams(OutputFormat(complexity=complexity), pcm)
    assert split[0] == Encoder(OutputFormat(complexity=0), RATE).encode(pcm[:STEP])[0]
    assert split[0] != whole[0] and len(split) == len(whole)
    got, want = decode(split), decode(whole)
    assert snr_db(got, pcm) > snr_db(want, pcm) - 0.5  # as close to the source, over the whole stream
    first = pcm[:2 * STEP]  # and over its first 40 ms, the head's frame and the one after it
    assert snr_db(got[:DELAY + len(first)], first) > snr_db(want[:DELAY + len(first)], first) - 0.5


def test_a_format_below_the_head_complexity_keeps_its_own(monkeypatch) -> None:
    monkeypatch.setenv("VOXGATE_OPUS_HEAD_COMPLEXITY", "3")
    whole, split = streams(OutputFormat(complexity=2), speech(0.5, RATE))
    assert split == whole  # the head at the format's 2: one call's bytes


def test_the_head_complexity_is_checked(monkeypatch) -> None:
    monkeypatch.setenv("VOXGATE_OPUS_HEAD_COMPLEXITY", "11")
    with pytest.raises(ValueError, match="VOXGATE_OPUS_HEAD_COMPLEXITY"):
        GatewaySettings.from_env()
