"""The output formats: names, binary-header kinds, sample rates and frame sizes each allows, and
`OutputFormat`, the audio a client asked for."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

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
