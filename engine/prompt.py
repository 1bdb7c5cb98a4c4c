"""Model inputs for one request, built exactly as the official `_generate` builds them (the one place that does).

A prompt is one position per text token or per audio patch:
  zero-shot                     [text, 101]
  continuation                  [prompt_text + text, 101, prompt patches]
  v2 reference                  [103, reference patches, 104, text, 101]
  v2 reference + continuation   [103, reference patches, 104, prompt_text + text, 101, prompt patches]
A style instruction (VoxCPM2 voice design) is a text prefix: the text spoken is `(instruction)text`, as the official
`build_final_text` (voxcpm/cli.py) makes it; like the official CLI, it never comes with a prompt (continuation).
Audio becomes patches through the AudioVAE encoder: mono, resampled to the VAE's input rate, padded to whole patches
(left for prompt audio, whose end must touch the generated speech; right for v2 reference audio). Prompt audio is at
most `engine.guards.MAX_PROMPT_AUDIO_S` long, checked from a file's header before anything is decoded; a worker
encodes it in slices between steps (`encode_in_slices`), exactly as in one go since the encoder is causal.
"""

from __future__ import annotations

import io
import time
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from engine import guards
from engine.config import ModelConfig
from engine.errors import InvalidAudio
from engine.prompt_layout import (  # re-exported: the layout is the part a caller without torch builds
    AUDIO_END,
    AUDIO_START,
    CONTEXT_PATCHES,
    REF_AUDIO_END,
    REF_AUDIO_START,
    PromptLayout,
    build_final_text,
    length_cap,
    prompt_layout,
)
from engine.text import Tokenizer


@dataclass
class Prompt:
    token_ids: Tensor  # int64 [T]; 0 at audio positions
    patches: Tensor  # float32 [T, P, D]; zeros at text positions
    audio_mask: Tensor  # bool [T]
    n_target_tokens: int  # tokens of the text to speak (not the prompt text): drives the length cap
    context_patches: Tensor  # float32 [C, P, D], C >= 0: primes the VAE stream in continuation
    cond: Tensor  # float32 [P, D]: the patch the first sampled patch is conditioned on

    def __len__(self) -> int:
        return len(self.token_ids)


def read_audio(source: str | Path | bytes) -> tuple[np.ndarray, int]:
    """Decode a WAV/FLAC/OGG file or its bytes: (float32 samples [N] or [N, channels], sample rate). Its length is
    checked from the header first (`AudioTooLong`, nothing decoded), and decoding stops past the limit whatever the
    header says."""
    import soundfile as sf

    name = "audio bytes" if isinstance(source, bytes) else str(source)

    def opened() -> io.BytesIO | str:
        return io.BytesIO(source) if isinstance(source, bytes) else str(source)

    try:
        info = sf.info(opened())
        sr, channels = int(info.samplerate), max(1, int(info.channels))
        guards.check_int("sample_rate", sr, 1000, 384000)
        guards.check_audio_length(int(info.frames), sr, channels)
        limit = min(int(guards.MAX_PROMPT_AUDIO_S * sr), guards.MAX_PROMPT_SAMPLES // channels)
        data, _ = sf.read(opened(), frames=limit + 1, dtype="float32", always_2d=False)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError, OSError) as e:
        if isinstance(e, InvalidAudio):
            raise
        raise InvalidAudio(f"{name}: cannot decode audio ({e})") from None
    if len(data) > limit:  # the header understated the length
        guards.check_audio_length(len(data), sr, channels)
    return data, sr


def prompt_samples(audio: bytes | np.ndarray | Tensor, sample_rate: int | None, vae_rate: int) -> np.ndarray:
    """Prompt audio (file bytes, or samples at `sample_rate`) as the encoder takes it: mono float32 at the VAE's
    rate, its length checked (`AudioTooLong`) before anything is decoded or converted."""
    import soxr

    if isinstance(audio, (bytes, bytearray, memoryview)):
        audio, sample_rate = read_audio(bytes(audio))
    if not isinstance(sample_rate, int) or isinstance(sample_rate, bool) or sample_rate <= 0:
        raise InvalidAudio(f"sample rate must be a positive integer (got {sample_rate!r})")
    size, shape = int(np.prod(audio.shape)), tuple(audio.shape)
    frames = shape[0] if len(shape) < 2 or not shape[0] <= 8 < shape[1] else shape[1]  # `_mono`'s layouts
    guards.check_audio_length(frames, sample_rate, max(1, size // max(1, frames)))
    samples = _mono(audio)
    if sample_rate != vae_rate:
        samples = soxr.resample(samples, sample_rate, vae_rate).astype(np.float32)
    if len(samples) < 1:
        raise InvalidAudio("audio is shorter than one sample at the model's rate")
    return samples


def _mono(audio: np.ndarray | Tensor) -> np.ndarray:
    """[N], [N, C] (soundfile layout) or [C, N] with C <= 8 (torch layout) -> float32 mono [N]."""
    a = audio.detach().cpu().numpy() if isinstance(audio, Tensor) else np.asarray(audio)
    if a.dtype.kind not in "fiu":
        raise InvalidAudio(f"audio must be numeric samples (got dtype {a.dtype})")
    if a.dtype.kind in "iu":  # integer PCM: scale to [-1, 1]
        a = a.astype(np.float32) / float(np.iinfo(a.dtype).max)
    a = a.astype(np.float32, copy=False)
    if a.ndim == 2:
        a = a.mean(axis=0) if a.shape[0] <= 8 < a.shape[1] else a.mean(axis=1)
    if a.ndim != 1:
        raise InvalidAudio(f"audio must be [samples] or [samples, channels] (got shape {a.shape})")
    if a.size == 0:
        raise InvalidAudio("audio is empty")
    if not np.isfinite(a).all():
        raise InvalidAudio("audio holds NaN or infinite samples")
    return a


@torch.inference_mode()
def encode_prompt_audio(vae: nn.Module, audio: np.ndarray | Tensor, sample_rate: int, *, patch_size: int,
                        pad: str) -> Tensor:
    """Audio -> latent patches [T, P, D] float32 on CPU, as the official `_encode_wav` (pad "left" or "right")."""
    wav = _padded(vae, prompt_samples(audio, sample_rate, vae.sample_rate), patch_size, pad)
    return _as_patches(vae, vae.encode(wav), patch_size)


# chunks of the sliced encode are a power of two patches (few shapes for cuDNN), at most this many (~5 min of audio)
MAX_SLICE_PATCHES = 2048


def encode_in_slices(vae: nn.Module, samples: np.ndarray, *, patch_size: int, pad: str,
                     slice_ms: float) -> Generator[bool, None, Tensor]:
    """`encode_prompt_audio` of `prompt_samples` as a chore (`engine.chores`): one chunk of whole patches per
    slice, sized so a chunk takes about `slice_ms` (measured: wall time on the CPU; on CUDA the chunk's events, read
    once it is done, never waited on). Yields whether the chunk is still on the device; returns the patches."""
    wav = _padded(vae, samples, patch_size, pad)
    patch_len = patch_size * vae.encoder_hop
    cuda = wav.device.type == "cuda"
    state = vae.encode_state()
    parts: list[Tensor] = []
    patches, pos = 1, 0
    while pos < wav.shape[-1]:
        chunk = wav[..., pos:pos + patches * patch_len]
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        parts.append(vae.encode_stream(chunk, state))
        pos += chunk.shape[-1]
        if cuda:
            end.record()
            yield True
            while not end.query():  # the device still runs it (behind the steps): no more work meanwhile
                yield True
            ms = start.elapsed_time(end)
        else:
            ms = 1000.0 * (time.perf_counter() - began)
            yield False
        if ms < slice_ms / 2:
            patches = min(2 * patches, MAX_SLICE_PATCHES)
        elif ms > slice_ms:
            patches = max(1, patches // 2)
    return _as_patches(vae, torch.cat(parts, dim=-1), patch_size)


def _padded(vae: nn.Module, samples: np.ndarray, patch_size: int, pad: str) -> Tensor:
    """[1, 1, T] on the VAE's device: `samples` padded to whole patches ("left" or "right")."""
    if pad not in ("left", "right"):
        raise ValueError(f"pad must be 'left' or 'right' (got {pad!r})")
    missing = -len(samples) % (patch_size * vae.encoder_hop)
    samples = np.pad(samples, (missing, 0) if pad == "left" else (0, missing))
    weight = next(vae.parameters())
    return torch.from_numpy(samples).to(weight.device, weight.dtype)[None, None]


def _as_patches(vae: nn.Module, feat: Tensor, patch_size: int) -> Tensor:
    """Encoder output [1, D, frames] -> patches [T, P, D] float32 on the CPU."""
    return feat.float().cpu().view(vae.latent_dim, -1, patch_size).permute(1, 2, 0).contiguous()


# A text-only prompt's patches are an expanded view of this one zero: nothing allocated (a burst of 64 fresh zero
# tensors cost a worker 8-60 ms of page faults on a 2-core machine before the burst's first step), and in-place
# writes to it raise instead of corrupting it.
_ZERO = torch.zeros((), dtype=torch.float32)


def prompt_tensors(n: int, audio: list[tuple[int, np.ndarray]], n_context: int,
                   shape: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """A prompt's first `n` positions as the model takes them: float32 patches [n, P, D] (the `audio` runs, zeros
    at text positions), the patch the first sampled one is conditioned on (the last position's, [P, D]) and the
    last `n_context` patches, which prime the VAE stream in continuation ([C, P, D])."""
    runs = [(start, p[:n - start]) for start, p in audio if start < n]
    if runs:
        filled = np.zeros((n, *shape), np.float32)
        for start, p in runs:
            filled[start:start + len(p)] = p
        patches = torch.from_numpy(filled)
    else:
        patches = _ZERO.expand(n, *shape)
    return patches, patches[-1], patches[n - n_context:]


def build_prompt(config: ModelConfig, tokenizer: Tokenizer, text: str, *, prompt_text: str | None = None,
                 prompt_patches: Tensor | None = None, reference_patches: Tensor | None = None,
                 instruction: str | None = None) -> Prompt:
    """The prefill sequence of one request (see the module docstring for the four layouts), as tensors; the
    patches come from the encoder (`encode_prompt_audio`)."""
    def array(p: Tensor | None) -> np.ndarray | None:
        return None if p is None else p.detach().float().cpu().numpy()

    layout = prompt_layout(config, tokenizer, text, prompt_text=prompt_text, prompt_patches=array(prompt_patches),
                           reference_patches=array(reference_patches), instruction=instruction)
    patches, cond, context = prompt_tensors(len(layout.token_ids), layout.audio, layout.n_context,
                                            (config.patch_size, config.feat_dim))
    return Prompt(
        token_ids=torch.tensor(layout.token_ids, dtype=torch.long),
        patches=patches,
        audio_mask=torch.tensor(layout.audio_mask, dtype=torch.bool),
        n_target_tokens=layout.n_target_tokens,
        context_patches=context,
        cond=cond,
    )


def positions_left(config: ModelConfig, prompt_len: int) -> int:
    """Patches that still fit the model's KV positions after a prompt of `prompt_len` (0 when it does not fit)."""
    return max(0, config.max_length - prompt_len)


__all__ = ["AUDIO_END", "AUDIO_START", "CONTEXT_PATCHES", "REF_AUDIO_END", "REF_AUDIO_START", "Prompt",
           "PromptLayout", "build_final_text", "build_prompt", "encode_in_slices", "encode_prompt_audio",
           "length_cap", "positions_left", "prompt_layout", "prompt_samples", "prompt_tensors", "read_audio"]
