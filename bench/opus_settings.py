"""What libopus costs per frame at the gateway's Opus settings, and what encoder hints would save.

One encoder per variant, as the gateway builds it (`gateway.audio.opus.OpusFrames`: VOIP, VBR, no FEC/DTX, the
format's complexity and bitrate), fed `bench/paced_engine.py`'s speech-like signal at 48 kHz in 20 ms frames through
the same C helper the gateway uses. Per variant: CPU microseconds per frame (best of --repeat passes, one thread),
mean packet bytes, the modes and audio bandwidths libopus chose (from each packet's TOC byte, RFC 6716 3.1), and a
crude fidelity figure: the SNR of the decoded signal against the input (delay-aligned) and its log-spectral distance
in 0-8 kHz and 8-20 kHz. A variant that drops bandwidth or changes mode changes what a listener hears; only one whose
packets decode to the same quality at less CPU is a free saving.

    python bench/opus_settings.py --seconds 20 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_proc import git_commit, machine_info  # noqa: E402
from paced_engine import speech_like  # noqa: E402

from gateway.audio.formats import OutputFormat  # noqa: E402
from gateway.audio.opus import OpusFrames  # noqa: E402

RATE = 48000
FRAME = 960  # 20 ms at 48 kHz
# opus_defines.h values (opuslib names only some of them)
OPUS_SIGNAL_VOICE, OPUS_SIGNAL_MUSIC = 3001, 3002
OPUS_BANDWIDTH = {"wideband": 1103, "superwideband": 1104, "fullband": 1105}
_MODES = ("SILK", "hybrid", "CELT")
_BANDWIDTHS = ("NB", "MB", "WB", "SWB", "FB")


def _set_ctl(name: str, value: int) -> Callable[[OpusFrames], None]:
    def apply(frames: OpusFrames) -> None:
        import opuslib.api.ctl
        import opuslib.api.encoder
        opuslib.api.encoder.encoder_ctl(frames._encoder.encoder_state, getattr(opuslib.api.ctl, name), value)
    return apply


def variants(complexity: int) -> dict[str, tuple[OutputFormat, list[Callable[[OpusFrames], None]]]]:
    """name -> (format, extra encoder ctls on top of the gateway's)."""
    fmt = OutputFormat(complexity=complexity)
    return {
        f"gateway (c{complexity})": (fmt, []),
        "signal=voice": (fmt, [_set_ctl("set_signal", OPUS_SIGNAL_VOICE)]),
        "signal=music": (fmt, [_set_ctl("set_signal", OPUS_SIGNAL_MUSIC)]),
        "max_bandwidth=SWB": (fmt, [_set_ctl("set_max_bandwidth", OPUS_BANDWIDTH["superwideband"])]),
        "max_bandwidth=WB": (fmt, [_set_ctl("set_max_bandwidth", OPUS_BANDWIDTH["wideband"])]),
        "signal=voice, max_bandwidth=SWB": (fmt, [_set_ctl("set_signal", OPUS_SIGNAL_VOICE),
                                                 _set_ctl("set_max_bandwidth", OPUS_BANDWIDTH["superwideband"])]),
        "complexity 3 (reference)": (OutputFormat(complexity=3), []),
        "complexity 10 (reference)": (OutputFormat(complexity=10), []),
    }


def toc(packet: bytes) -> tuple[str, str]:
    """(mode, audio bandwidth) from an Opus packet's TOC byte."""
    config = packet[0] >> 3
    if config < 12:
        return "SILK", _BANDWIDTHS[config // 4]
    if config < 16:
        return "hybrid", _BANDWIDTHS[3 + (config - 12) // 2]
    return "CELT", _BANDWIDTHS[(0, 2, 3, 4)[(config - 16) // 4]]


def decode(packets: list[bytes]) -> np.ndarray:
    import opuslib
    dec = opuslib.Decoder(RATE, 1)
    out = [np.frombuffer(dec.decode_float(p, FRAME), dtype=np.float32) for p in packets]
    return np.concatenate(out)


def band_distance(ref: np.ndarray, test: np.ndarray, lo: float, hi: float) -> float:
    """Mean log-spectral distance (dB) over 20 ms frames, in [lo, hi) Hz."""
    n = len(ref) // FRAME * FRAME
    win = np.hanning(FRAME)
    spec = [np.abs(np.fft.rfft(x[:n].reshape(-1, FRAME) * win, axis=1)) ** 2 + 1e-10 for x in (ref, test)]
    freqs = np.fft.rfftfreq(FRAME, 1 / RATE)
    band = (freqs >= lo) & (freqs < hi)
    d = 10 * np.log10(spec[0][:, band]) - 10 * np.log10(spec[1][:, band])
    return float(np.mean(np.sqrt(np.mean(d ** 2, axis=1))))


def measure(name: str, fmt: OutputFormat, ctls: list[Callable[[OpusFrames], None]], signal: np.ndarray,
            repeat: int) -> dict[str, Any]:
    best = float("inf")
    packets: list[bytes] = []
    lookahead = 0
    for _ in range(repeat):
        enc = OpusFrames(fmt)
        for apply in ctls:
            apply(enc)
        lookahead = enc.lookahead
        t0 = time.thread_time()
        packets = enc.encode(signal)
        best = min(best, time.thread_time() - t0)
    frames = len(signal) // FRAME
    decoded = decode(packets)[lookahead:]
    ref = signal[:len(decoded)]
    snr = 10 * np.log10(np.sum(ref ** 2) / max(np.sum((ref - decoded) ** 2), 1e-12))
    kinds = collections.Counter(toc(p) for p in packets)
    return {
        "variant": name,
        "us_per_frame": round(best / frames * 1e6, 1),
        "streams_per_core": round(0.020 * frames / best),
        "bytes_per_packet": round(sum(map(len, packets)) / frames, 1),
        "modes": {f"{m} {b}": round(c / frames, 3) for (m, b), c in sorted(kinds.items())},
        "snr_db": round(float(snr), 2),
        "lsd_db_0_8k": round(band_distance(ref, decoded, 50, 8000), 2),
        "lsd_db_8_20k": round(band_distance(ref, decoded, 8000, 20000), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of speech-like audio per pass")
    ap.add_argument("--repeat", type=int, default=5, help="passes per variant (the fastest counts)")
    ap.add_argument("--complexity", type=int, default=OutputFormat.complexity)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    signal = speech_like(seconds=args.seconds, rate=RATE).astype(np.float32)
    signal = signal[:len(signal) // FRAME * FRAME]
    rows = [measure(name, fmt, ctls, signal, args.repeat) for name, (fmt, ctls) in variants(args.complexity).items()]
    for r in rows:
        modes = ", ".join(f"{k} {v:.0%}" for k, v in r["modes"].items())
        print(f"{r['variant']:34s} {r['us_per_frame']:7.1f} us/frame {r['streams_per_core']:5d} streams/core "
              f"{r['bytes_per_packet']:6.1f} B  SNR {r['snr_db']:5.1f} dB  LSD {r['lsd_db_0_8k']:5.2f} / "
              f"{r['lsd_db_8_20k']:5.2f} dB  [{modes}]")
    if args.json:
        out = {"benchmark": "libopus cost per frame by encoder setting (bench/opus_settings.py)",
               "command": " ".join(["python", *sys.argv]), "git_commit": git_commit(), "machine": machine_info(),
               "seconds": args.seconds, "results": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
