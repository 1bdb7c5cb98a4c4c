"""A checked request turned into the `RequestSpec` a worker runs: the prompt built here, its length capped to fit.

This runs on the event loop once per request, so it builds no per-position Python objects, makes no torch op (each
drops the GIL and waits to take it back behind the loop's other threads) and copies no patches: the prompt layout
comes as plain lists and the caller's numpy patch runs (`engine.prompt_layout`); the worker makes the tensors.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import numpy as np

from engine.config import ModelConfig
from engine.errors import EngineError, InvalidRequest, TextTooLong
from engine.prompt_layout import length_cap, prompt_layout
from engine.sampling import SamplingParams
from engine.text import Tokenizer


@dataclass
class RequestSpec:
    """Everything the worker needs, built and checked in the caller's process.

    The caller (a gateway's event loop) builds it without a torch op, each of which would drop the GIL and wait to
    take it back behind the loop's other threads, and without copying patches: the prompt's audio travels as the
    runs the caller gave (numpy, pickled by value), and the worker's `Request` lays them out as tensors
    (`engine.prompt.prompt_tensors`). A text-only prompt (most requests) sends no patches at all."""

    request_id: str
    token_ids: list[int]
    audio_mask: list[int]  # [N] 1 at audio positions
    patch_shape: tuple[int, int]  # (P, D) of one patch
    params: SamplingParams
    # (first position, float32 patches [T, P, D]) of each audio run, in order; zeros at the other positions
    audio: list[tuple[int, np.ndarray]] = field(default_factory=list)
    n_context: int = 0  # last prompt patches that prime the VAE stream (continuation)
    voice_id: str | None = None  # a stored voice whose prefix KV this prompt starts with
    prefix_only: bool = False  # compute the prompt's KV and keep it as a stored voice; sample nothing
    lora: str | None = None  # a registered LoRA adapter applied to this request
    tenant: str | None = None  # who asked (the API key): prefill is shared fairly between tenants; None: shared

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids)


def request_spec(config: ModelConfig, tokenizer: Tokenizer, kv_positions: int, *, text: str,
                 prompt_text: str | None, prompt_patches: np.ndarray | None, ref_patches: np.ndarray | None,
                 params: SamplingParams, request_id: str, voice_id: str | None,
                 lora: str | None = None, tenant: str | None = None,
                 instruction: str | None = None) -> RequestSpec:
    """The prompt of one request; `params.max_length` becomes the official cap, bounded by the model's positions
    and the `kv_positions` a worker's KV cache holds."""
    try:
        layout = prompt_layout(config, tokenizer, text, prompt_text=prompt_text, prompt_patches=prompt_patches,
                               reference_patches=ref_patches, instruction=instruction)
    except EngineError:
        raise
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    n = len(layout.token_ids)
    cap = length_cap(layout.n_target_tokens, params.max_length or config.max_length)
    cap = min(cap, config.max_length - n, kv_positions - n)
    if cap < 1:
        raise TextTooLong(f"the prompt takes {n} positions; the model has {config.max_length} and the KV "
                          f"cache {kv_positions}: no room left to speak")
    params.max_length = cap
    return RequestSpec(
        request_id=request_id, token_ids=layout.token_ids, audio_mask=layout.audio_mask,
        patch_shape=(config.patch_size, config.feat_dim), params=params, audio=layout.audio,
        n_context=layout.n_context, voice_id=voice_id, lora=lora, tenant=tenant)


def voice_prefix_spec(config: ModelConfig, tokenizer: Tokenizer, kv_positions: int, voice_id: str,
                      ref: np.ndarray, lora: str | None = None) -> RequestSpec:
    """`[103, ref..., 104]`: the first positions of every prompt of this voice, as a prefix-only request."""
    layout = prompt_layout(config, tokenizer, "a", reference_patches=ref)
    n = ref.shape[0] + 2
    if n > kv_positions:
        raise TextTooLong(f"the voice takes {n} positions, more than the KV cache holds")
    return RequestSpec(
        request_id=f"voice:{voice_id}:{uuid.uuid4().hex[:8]}", token_ids=layout.token_ids[:n],
        audio_mask=layout.audio_mask[:n], patch_shape=(config.patch_size, config.feat_dim), params=SamplingParams(),
        audio=layout.audio, voice_id=voice_id, prefix_only=True, lora=lora)  # its one run: the reference
