"""The single-request path (`voxgate say`, oracle tests): prompt -> prefill -> one patch per step -> audio.

A thin driver over `engine.prompt` and the model API with a private paged KV cache. Randomness: the noise of step i
is the i-th `torch.randn(1, feat_dim, P)` of a CPU generator seeded with `seed`, times `temperature` (the official
draw, made device-independent), so a seed gives the same audio on every device up to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from engine.checkpoint import LoadedModel
from engine.errors import InvalidParameter, TextTooLong
from engine.model.attention import AttentionMetadata, KVCache
from engine.prompt import Prompt, build_prompt, encode_prompt_audio, length_cap, positions_left, read_audio
from engine.sampling import SamplingParams

AudioInput = str | Path | bytes | tuple[np.ndarray | Tensor, int]
BLOCK_SIZE = 64
DEFAULT = SamplingParams()  # the request defaults the engine uses, so the reference path matches it


class Synthesizer:
    """Speaks one text at a time with a loaded model; `stream` yields one float32 chunk per patch."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.config = loaded.config
        self.model = loaded.model
        self.vae = loaded.vae
        self.device = loaded.device

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    def encode_audio(self, audio: AudioInput, pad: str) -> Tensor:
        """A path, file bytes or (samples, sample_rate) -> latent patches [T, P, D]."""
        samples, sr = audio if isinstance(audio, tuple) else read_audio(audio)
        return encode_prompt_audio(self.vae, samples, sr, patch_size=self.config.patch_size, pad=pad)

    def prompt(self, text: str, *, prompt_audio: AudioInput | None = None, prompt_text: str | None = None,
               reference_audio: AudioInput | None = None, instruction: str | None = None) -> Prompt:
        return build_prompt(
            self.config, self.loaded.tokenizer, text, prompt_text=prompt_text, instruction=instruction,
            prompt_patches=None if prompt_audio is None else self.encode_audio(prompt_audio, "left"),
            reference_patches=None if reference_audio is None else self.encode_audio(reference_audio, "right"))

    def stream(self, text: str, *, prompt_audio: AudioInput | None = None, prompt_text: str | None = None,
               reference_audio: AudioInput | None = None, instruction: str | None = None,
               cfg_value: float = DEFAULT.cfg_value, timesteps: int = DEFAULT.timesteps,
               temperature: float = DEFAULT.temperature, seed: int | None = None, min_len: int = DEFAULT.min_length,
               max_len: int | None = None) -> Iterator[np.ndarray]:
        """Audio at `sample_rate`, one chunk of `samples_per_patch` per generated patch, as it is generated.

        The streaming VAE starts from the prompt's last patches in continuation, so the chunks join seamlessly to
        the prompt and their concatenation equals `generate` (offline decode)."""
        prompt = self.prompt(text, prompt_audio=prompt_audio, prompt_text=prompt_text,
                             reference_audio=reference_audio, instruction=instruction)
        steps = self._patches(prompt, cfg_value, timesteps, temperature, seed, min_len, max_len)
        return self._stream_audio(prompt, steps)

    def generate(self, text: str, **kwargs) -> np.ndarray:
        """The whole utterance (same arguments as `stream`), decoded offline in one pass."""
        keys = ("prompt_audio", "prompt_text", "reference_audio", "instruction")
        prompt = self.prompt(text, **{k: kwargs.pop(k) for k in keys if k in kwargs})
        patches = list(self._patches(prompt, **kwargs))
        latents = torch.cat([prompt.context_patches.to(self.device), *patches]).float()  # [C + T, P, D]
        audio = self.vae.decode(latents.reshape(1, -1, self.config.feat_dim).transpose(1, 2))
        return audio[0, 0, len(prompt.context_patches) * self.config.samples_per_patch:].cpu().numpy()

    @torch.inference_mode()
    def _stream_audio(self, prompt: Prompt, steps: Iterator[Tensor]) -> Iterator[np.ndarray]:
        state = self.vae.stream_state(1)
        if len(prompt.context_patches):
            self._decode(prompt.context_patches.to(self.device), state)
        for patch in steps:
            yield self._decode(patch, state)

    def _decode(self, patches: Tensor, state) -> np.ndarray:
        latents = patches.float().reshape(1, -1, self.config.feat_dim).transpose(1, 2)  # [1, D, frames]
        return self.vae.decode_stream(latents, state)[0, 0].cpu().numpy()

    def _patches(self, prompt: Prompt, cfg_value: float = DEFAULT.cfg_value, timesteps: int = DEFAULT.timesteps,
                 temperature: float = DEFAULT.temperature, seed: int | None = None,
                 min_len: int = DEFAULT.min_length, max_len: int | None = None) -> Iterator[Tensor]:
        """Generated patches [1, P, D], one per step, until the stop head fires (after min_len) or the cap.

        Arguments are checked here, before the first step, so bad input fails at the call, not mid-stream."""
        _check_params(cfg_value, timesteps, temperature, seed, min_len, max_len)
        room = positions_left(self.config, len(prompt))
        if room < 1:
            raise TextTooLong(f"the prompt takes {len(prompt)} positions; the model has {self.config.max_length}")
        cap = length_cap(prompt.n_target_tokens, min(room, max_len or room))
        return self._steps(prompt, cap, cfg_value, timesteps, temperature, seed, min_len)

    @torch.inference_mode()
    def _steps(self, prompt: Prompt, cap: int, cfg_value: float, timesteps: int, temperature: float,
               seed: int | None, min_len: int) -> Iterator[Tensor]:
        model, cfg, device = self.model, self.config, self.device
        gen = torch.Generator()
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)

        n_blocks = math.ceil((len(prompt) + cap) / BLOCK_SIZE)
        dtype = next(model.parameters()).dtype
        caches = (KVCache.allocate(cfg.lm, n_blocks, BLOCK_SIZE, device, dtype),
                  KVCache.allocate(cfg.residual_lm, n_blocks, BLOCK_SIZE, device, dtype))
        table = [list(range(n_blocks))]
        cfg_t = torch.tensor([float(cfg_value)], device=device)

        n = len(prompt)
        meta = AttentionMetadata.build([n], [0], table, BLOCK_SIZE, device)
        lm_h, res_h = model.forward_lms(prompt.token_ids.to(device), prompt.patches.to(device),
                                        prompt.audio_mask.to(device), meta.positions(), meta, caches,
                                        torch.tensor([n - 1], device=device))
        cond = prompt.cond.to(device)[None]
        one_token, audio_mask = torch.zeros(1, dtype=torch.long, device=device), torch.ones(1, dtype=torch.bool,
                                                                                            device=device)
        for i in range(cap):
            noise = torch.randn(1, cfg.feat_dim, cfg.patch_size, generator=gen) * temperature
            patch = model.sample_patches(lm_h, res_h, cond, noise.to(device, dtype), timesteps, cfg_t)
            yield patch
            if i > min_len and bool(model.stop_flags(lm_h)[0]):
                return
            if i == cap - 1:
                return
            meta = AttentionMetadata.build([1], [n + i], table, BLOCK_SIZE, device)
            lm_h, res_h = model.forward_lms(one_token, patch, audio_mask, meta.positions(), meta, caches,
                                            torch.zeros(1, dtype=torch.long, device=device))
            cond = patch


def _check_params(cfg_value: float, timesteps: int, temperature: float, seed: int | None, min_len: int,
                  max_len: int | None) -> None:
    def number(name: str, value: float, low: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
            raise InvalidParameter(f"{name} must be a finite number >= {low} (got {value!r})")

    def integer(name: str, value: int | None, low: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidParameter(f"{name} must be an integer >= {low} (got {value!r})")

    number("cfg_value", cfg_value, 0.0)
    number("temperature", temperature, 0.0)
    integer("timesteps", timesteps, 1)
    integer("min_len", min_len, 0)
    if max_len is not None:
        integer("max_len", max_len, 1)
    if seed is not None:
        integer("seed", seed, 0)
