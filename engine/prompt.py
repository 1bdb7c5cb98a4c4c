"""Model inputs for one request, built exactly as the official `_generate` builds them (the one place that does).

A prompt is one position per text token or per audio patch:
  zero-shot                     [text, 101]
  continuation                  [prompt_text + text, 101, prompt patches]
  v2 reference                  [103, reference patches, 104, text, 101]
  v2 reference + continuation   [103, reference patches, 104, prompt_text + text, 101, prompt patches]
Audio becomes patches through the AudioVAE encoder: mono, resampled to the VAE's input rate, padded to whole patches
(left for prompt audio, whose end must touch the generated speech; right for v2 reference audio).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from engine.config import ModelConfig
from engine.errors import EmptyText, InvalidAudio, InvalidRequest
from engine.text import Tokenizer, normalize_text

AUDIO_START, AUDIO_END, REF_AUDIO_START, REF_AUDIO_END = 101, 102, 103, 104
# Last prompt patches the streaming VAE is primed with in continuation (the official streaming_prefix_len - 1).
CONTEXT_PATCHES = {"voxcpm": 2, "voxcpm2": 3}


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


def length_cap(n_target_tokens: int, max_len: int) -> int:
    """The official cap on generated patches: 6 per target token plus 10, at most `max_len`."""
    return min(int(6 * n_target_tokens + 10), max_len)


def read_audio(source: str | Path | bytes) -> tuple[np.ndarray, int]:
    """Decode a WAV/FLAC/OGG file or its bytes: (float32 samples [N] or [N, channels], sample rate)."""
    import soundfile as sf

    name = "audio bytes" if isinstance(source, bytes) else str(source)
    try:
        data, sr = sf.read(io.BytesIO(source) if isinstance(source, bytes) else str(source), dtype="float32",
                           always_2d=False)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError, OSError) as e:
        raise InvalidAudio(f"{name}: cannot decode audio ({e})") from None
    return data, int(sr)


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
    import soxr

    if pad not in ("left", "right"):
        raise ValueError(f"pad must be 'left' or 'right' (got {pad!r})")
    if not isinstance(sample_rate, int) or isinstance(sample_rate, bool) or sample_rate <= 0:
        raise InvalidAudio(f"sample rate must be a positive integer (got {sample_rate!r})")
    samples = _mono(audio)
    if sample_rate != vae.sample_rate:
        samples = soxr.resample(samples, sample_rate, vae.sample_rate).astype(np.float32)
    patch_len = patch_size * vae.encoder_hop
    if len(samples) < 1:
        raise InvalidAudio("audio is shorter than one sample at the model's rate")
    missing = -len(samples) % patch_len
    samples = np.pad(samples, (missing, 0) if pad == "left" else (0, missing))
    weight = next(vae.parameters())
    wav = torch.from_numpy(samples).to(weight.device, weight.dtype)[None, None]
    feat = vae.encode(wav)  # [1, D, frames]
    return feat.float().cpu().view(vae.latent_dim, -1, patch_size).permute(1, 2, 0).contiguous()


@dataclass
class PromptLayout:
    """A prompt before any tensor is built: what `build_prompt` and the engine's request builder share."""

    token_ids: list[int]  # 0 at audio positions
    audio_mask: list[int]  # 1 at audio positions
    audio: list[tuple[int, Tensor]]  # (first position, patches [T, P, D]) of each audio run, in order
    n_target_tokens: int
    n_context: int  # last prompt patches that prime the VAE stream (continuation), else 0


def prompt_layout(config: ModelConfig, tokenizer: Tokenizer, text: str, *, prompt_text: str | None = None,
                  prompt_patches: Tensor | None = None, reference_patches: Tensor | None = None) -> PromptLayout:
    """The positions of one request's prefill (see the module docstring for the four layouts), checked; plain
    lists, so a text-only request costs no tensor work here."""
    if not isinstance(text, str):
        raise InvalidRequest(f"text must be a string (got {type(text).__name__})")
    target = normalize_text(text)
    if not target.strip():
        raise EmptyText("text is empty")
    if (prompt_patches is None) != (prompt_text is None):
        raise InvalidRequest("prompt audio and prompt text must be given together")
    if reference_patches is not None and not config.is_v2:
        raise InvalidRequest("reference audio needs a VoxCPM2 model")
    shape = (config.patch_size, config.feat_dim)
    for name, p in (("prompt", prompt_patches), ("reference", reference_patches)):
        if p is not None and (p.ndim != 3 or tuple(p.shape[1:]) != shape or len(p) == 0):
            raise InvalidAudio(f"{name} patches must be [T > 0, {shape[0]}, {shape[1]}] (got {tuple(p.shape)})")

    text_ids = tokenizer.encode(target)
    n_target = len(text_ids)
    if prompt_text is not None:
        # tokenized together with the target, as the official code does (the ids at the seam may differ from
        # the two parts'): only then is the text tokenized twice, the target alone for its length
        text_ids = tokenizer.encode(prompt_text + target)
    text_ids.append(AUDIO_START)
    ids: list[int] = []
    mask: list[int] = []
    audio: list[tuple[int, Tensor]] = []

    def add_audio(patches: Tensor) -> None:
        audio.append((len(ids), patches))
        ids.extend([0] * len(patches))
        mask.extend([1] * len(patches))

    if reference_patches is not None:
        ids.append(REF_AUDIO_START)
        mask.append(0)
        add_audio(reference_patches)
        ids.append(REF_AUDIO_END)
        mask.append(0)
    ids.extend(text_ids)
    mask.extend([0] * len(text_ids))
    if prompt_patches is not None:
        add_audio(prompt_patches)
    n_context = min(CONTEXT_PATCHES[config.architecture], len(prompt_patches)) if prompt_patches is not None else 0
    return PromptLayout(ids, mask, audio, n_target, n_context)


def layout_patches(config: ModelConfig, layout: PromptLayout, n: int | None = None) -> Tensor:
    """float32 [n, P, D] of the layout's first `n` positions (all by default): its audio patches, zeros at text."""
    n = len(layout.token_ids) if n is None else n
    patches = torch.zeros(n, config.patch_size, config.feat_dim)
    for start, p in layout.audio:
        if start < n:
            patches[start:start + len(p)] = p[:n - start].detach()
    return patches


def build_prompt(config: ModelConfig, tokenizer: Tokenizer, text: str, *, prompt_text: str | None = None,
                 prompt_patches: Tensor | None = None, reference_patches: Tensor | None = None) -> Prompt:
    """The prefill sequence of one request (see the module docstring for the four layouts)."""
    layout = prompt_layout(config, tokenizer, text, prompt_text=prompt_text, prompt_patches=prompt_patches,
                           reference_patches=reference_patches)
    patches = layout_patches(config, layout)
    return Prompt(
        token_ids=torch.tensor(layout.token_ids, dtype=torch.long),
        patches=patches,
        audio_mask=torch.tensor(layout.audio_mask, dtype=torch.bool),
        n_target_tokens=layout.n_target_tokens,
        context_patches=patches[len(patches) - layout.n_context:],
        cond=patches[-1].clone(),
    )


def positions_left(config: ModelConfig, prompt_len: int) -> int:
    """Patches that still fit the model's KV positions after a prompt of `prompt_len` (0 when it does not fit)."""
    return max(0, config.max_length - prompt_len)


__all__ = ["Prompt", "PromptLayout", "build_prompt", "encode_prompt_audio", "layout_patches", "length_cap",
           "positions_left", "prompt_layout", "read_audio"]
