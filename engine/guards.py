"""Checks of the caller's arguments, each failing with a typed `InvalidRequest` before anything is queued.

They run in the caller's process (no weights there), so a bad request never reaches a worker.
"""

from __future__ import annotations

import itertools
import random
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.config import ModelConfig
from engine.engine_config import MAX_TIMESTEPS
from engine.errors import AudioTooLong, EmptyText, InvalidAudio, InvalidParameter
from engine.options import check_int
from engine.sampling import SamplingParams
from engine.text import normalize_text

# Prompt and voice audio: VoxCPM clones a voice from a few seconds to a few tens of seconds of speech (the official
# examples use 3-20 s); a minute is ample, and keeps one prompt within ~375 VoxCPM2 positions of KV and its encode a
# bounded amount of work. Decoded samples (all channels) are capped too: a minute of 48 kHz stereo, 23 MB as float32.
MAX_PROMPT_AUDIO_S = 60.0
MAX_PROMPT_SAMPLES = int(MAX_PROMPT_AUDIO_S * 48000 * 2)


@dataclass(frozen=True)
class SamplingRanges:
    """The per-request sampling settings a server takes, defined once: the engine's guard (`sampling_params`) and
    the gateway's protocol check both read it, so both refuse the same values with the same words.

    `max_timesteps` is what the runner's graphs serve (the operator sets it; default: the default timesteps): every
    value up to the default rides along in the step at no cost to its batch-mates; one above it adds its extra
    evaluations, for its own rows only, after the step (`engine.runner`, the tail)."""

    max_timesteps: int = MAX_TIMESTEPS
    cfg_value: tuple[float, float] = (0.0, 10.0)
    temperature: tuple[float, float] = (0.0, 2.0)

    def describe(self, name: str) -> str:
        """The valid values of setting `name`, in words."""
        if name == "timesteps":
            return f"an integer in [1, {self.max_timesteps}] (the diffusion steps this server serves)"
        lo, hi = getattr(self, name)
        return f"a finite number in [{lo:g}, {hi:g}]"

    def valid(self, name: str, value: Any) -> bool:
        """Whether `value` is a valid setting `name` (timesteps, cfg_value or temperature)."""
        if isinstance(value, bool):
            return False
        if name == "timesteps":
            return isinstance(value, int) and 1 <= value <= self.max_timesteps
        lo, hi = getattr(self, name)
        return isinstance(value, (int, float)) and lo <= value <= hi  # NaN compares False

    def check(self, name: str, value: Any) -> None:
        """`value` is valid for `name`, else InvalidParameter naming the valid values."""
        if not self.valid(name, value):
            raise InvalidParameter(f"{name} must be {self.describe(name)} (got {value!r})")


def check_audio_length(frames: int, sample_rate: int, channels: int = 1) -> None:
    """Prompt audio of `frames` samples per channel is at most `MAX_PROMPT_AUDIO_S` long and at most
    `MAX_PROMPT_SAMPLES` samples in all (`AudioTooLong`); checked from a file's header before it is decoded."""
    seconds = frames / sample_rate
    if seconds > MAX_PROMPT_AUDIO_S or frames * channels > MAX_PROMPT_SAMPLES:
        raise AudioTooLong(f"prompt audio is {seconds:.1f} s ({frames * channels} samples); at most "
                           f"{MAX_PROMPT_AUDIO_S:.0f} s and {MAX_PROMPT_SAMPLES} samples are taken")


def sampling_params(*, text: Any, cfg_value: Any, temperature: Any, timesteps: Any, min_length: Any,
                    max_length: Any, priority: Any, seed: Any, ranges: SamplingRanges) -> SamplingParams:
    """The text to speak is a non-empty string and the sampling parameters are in `ranges`; `seed=None` draws one.
    `max_length` is 0 when not given: the spec builder caps it."""
    if not isinstance(text, str):
        raise InvalidParameter(f"text must be a string (got {type(text).__name__})")
    if not text.strip():  # what `prompt_layout` refuses after normalizing, without normalizing twice per request
        raise EmptyText("text is empty")
    for name, value in (("cfg_value", cfg_value), ("temperature", temperature), ("timesteps", timesteps)):
        ranges.check(name, value)
    check_int("min_length", min_length, 0)
    if max_length is not None:
        check_int("max_length", max_length, 1)
    check_int("priority", priority, -1000, 1000)
    if seed is None:
        seed = random.getrandbits(63)
    check_int("seed", seed, 0, 2**63 - 1)
    return SamplingParams(cfg_value=float(cfg_value), temperature=float(temperature), seed=seed,
                          max_length=max_length or 0, min_length=min_length, timesteps=timesteps, priority=priority)


# Fresh request ids: 32 hex digits like a uuid4's, a random half per process and a counter half, so one costs no
# call to the OS's random source on the event loop (uuid4 per request did).
_ID_PREFIX = uuid.uuid4().hex[:16]
_id_counter = itertools.count()


def new_request_id() -> str:
    """A request id unique within this process and, by its random half, across processes."""
    return f"{_ID_PREFIX}{next(_id_counter):016x}"


def request_id_or_new(request_id: Any, in_flight: dict[str, Any]) -> str:
    """The caller's request id (non-empty, not in flight) or a fresh one."""
    if request_id is None:
        request_id = new_request_id()
        while request_id in in_flight:  # a caller chose an id of this form: take the next one
            request_id = new_request_id()
        return request_id
    if not isinstance(request_id, str) or not request_id:
        raise InvalidParameter("request_id must be a non-empty string")
    if request_id in in_flight:
        raise InvalidParameter(f"request_id {request_id!r} is already in flight")
    return request_id


def check_prompt_sources(config: ModelConfig, *, voice: bool, prompt_audio: Any, prompt_latents: Any,
                         prompt_text: str | None, reference_audio: Any, reference_latents: Any) -> None:
    """At most one source for each of the prompt and the reference, the prompt with its transcript, and reference
    audio only on VoxCPM2; a stored `voice` is the reference (a prompt may follow it: reference + continuation)."""
    if voice and (reference_audio is not None or reference_latents is not None):
        raise InvalidParameter("give either a stored voice or reference audio, not both")
    if (prompt_audio is not None) + (prompt_latents is not None) > 1 or \
            (reference_audio is not None) + (reference_latents is not None) > 1:
        raise InvalidParameter("give audio or latents, not both")
    if (prompt_audio is not None or prompt_latents is not None) and not prompt_text:
        raise InvalidParameter("prompt audio needs its transcript (prompt_text)")
    if prompt_text and prompt_audio is None and prompt_latents is None:
        raise InvalidParameter("prompt_text needs prompt audio (prompt_audio or prompt_latents)")
    if (reference_audio is not None or reference_latents is not None) and not config.is_v2:
        raise InvalidParameter(f"reference audio needs a VoxCPM2 model ({config.architecture} has none)")


def check_latents(config: ModelConfig, latents: Any, name: str) -> np.ndarray:
    """Caller-given patches as a float32 [T, P, D] array, T >= 1, all finite: a read-only copy (`held_copy`), so
    the request is what the caller gave at the call whatever it writes to its array later. No torch op: this runs on
    the caller's thread."""
    shape = (config.patch_size, config.feat_dim)
    try:
        a = np.asarray(latents)
        if a.dtype.kind not in "biuf":
            raise TypeError(f"dtype {a.dtype}")
    except (TypeError, ValueError) as e:
        raise InvalidAudio(f"{name}: not an array of numbers ({e})") from None
    if a.ndim != 3 or a.shape[1:] != shape or a.shape[0] == 0:
        raise InvalidAudio(f"{name} must be [T, {shape[0]}, {shape[1]}] with T >= 1 (got {a.shape})")
    a = held_copy(a)
    if not all_finite(a):
        raise InvalidAudio(f"{name} holds NaN or infinite values")
    return a


# numpy drops the GIL inside a loop over more than this many elements (NPY_BEGIN_THREADS_THRESHOLDED), and the event
# loop then waits to take it back behind the gateway's other threads. A continuation's tail (3 patches, 768 values)
# is copied and checked without such a loop.
NUMPY_GIL_HELD_ELEMENTS = 500


def held_copy(a: np.ndarray) -> np.ndarray:
    """A read-only float32 copy of `a`, made as bytes (one memcpy with the GIL held); a caller's float32 array is
    not cast or repacked first."""
    a = np.ascontiguousarray(a, np.float32)
    return np.frombuffer(a.tobytes(), np.float32).reshape(a.shape)


def all_finite(a: np.ndarray) -> bool:
    """No NaN or infinity in `a`; a small array in blocks that keep the GIL, a large one (a reference) in one pass."""
    flat = a.reshape(-1)
    if flat.size > 8 * NUMPY_GIL_HELD_ELEMENTS:
        return bool(np.isfinite(flat).all())
    step = NUMPY_GIL_HELD_ELEMENTS
    return all(np.isfinite(flat[i:i + step]).all() for i in range(0, flat.size, step))


def check_voice_source(config: ModelConfig, *, audio: Any, latents: Any, text: str | None) -> None:
    """A stored voice is audio or latents (exactly one); a pre-v2 voice is a prompt and needs its transcript."""
    if (audio is None) == (latents is None):
        raise InvalidParameter("give the voice as audio or as latents (exactly one)")
    if text is not None and not normalize_text(text):
        raise InvalidParameter("text is empty")
    if not config.is_v2 and text is None:
        raise InvalidParameter(f"a {config.architecture} voice is a prompt: give its transcript (text)")


def voice_id_or_new(voice_id: Any) -> str:
    """The caller's voice id or a fresh short one."""
    voice_id = voice_id or uuid.uuid4().hex[:12]
    if not isinstance(voice_id, str):
        raise InvalidParameter("voice_id must be a string")
    return voice_id
