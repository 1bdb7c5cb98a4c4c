"""The caller's half of a request: its input checked and its prompt sources resolved, in the caller's process.

`Engine.generate` and a gateway front's `RemoteEngine.generate` (`gateway.link`) both run this, so a bad request is
the same typed `InvalidRequest` wherever the engine lives; what only the engine's owner decides (a worker, the
tenant's queued prompts, an adapter that is really there) comes after it."""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engine import guards
from engine.api import VoiceInfo
from engine.config import ModelConfig
from engine.errors import InvalidParameter


class StoredVoice(Protocol):
    """What a request reads of a stored voice (`engine.registries.Voice`, or a front's mirror of one)."""

    info: VoiceInfo
    latents: np.ndarray | None
    text: str | None

    @property
    def shared_prefix(self) -> bool:
        """Every worker keeps the voice's prefix KV (a reference voice on VoxCPM2)."""
        ...


@dataclass
class CheckedRequest:
    """A checked request: `args` are `engine.specs.request_spec`'s keywords; `audio` (prompt audio, reference audio,
    their sample rate) is what must be encoded into patches first (all None: nothing)."""

    args: dict[str, Any]
    audio: tuple[Any, Any, int | None]

    @property
    def lora(self) -> str | None:
        return self.args["lora"]

    @property
    def needs_encoding(self) -> bool:
        return self.audio[0] is not None or self.audio[1] is not None


def check_request(config: ModelConfig, *, ranges: guards.SamplingRanges, default_timesteps: int,
                  in_flight: Container[str], voice_of: Callable[[str], StoredVoice], text: str,
                  voice: str | None, prompt_audio: Any, prompt_sample_rate: int | None, prompt_latents: Any,
                  prompt_text: str | None, reference_audio: Any, reference_latents: Any, cfg_value: float,
                  temperature: float, seed: int | None, max_length: int | None, min_length: int,
                  timesteps: int | None, priority: int, request_id: str | None, lora: str | None,
                  tenant: str | None, instruction: str | None) -> CheckedRequest:
    """Check one request (`Engine.generate`'s arguments) and resolve its stored voice into its prompt; raises the
    typed `InvalidRequest` (`UnknownVoice` from `voice_of`). `lora` becomes the voice's adapter when not given;
    `tenant` is passed through unchecked (its owner counts it)."""
    params = guards.sampling_params(
        text=text, cfg_value=cfg_value, temperature=temperature,
        timesteps=default_timesteps if timesteps is None else timesteps, min_length=min_length,
        max_length=max_length, priority=priority, seed=seed, ranges=ranges)
    request_id = guards.request_id_or_new(request_id, in_flight)  # type: ignore[arg-type]
    v = None if voice is None else voice_of(voice)
    guards.check_prompt_sources(config, voice=v is not None, prompt_audio=prompt_audio,
                                prompt_latents=prompt_latents, prompt_text=prompt_text,
                                reference_audio=reference_audio, reference_latents=reference_latents)
    prompt_patches = guards.check_latents(config, prompt_latents, "prompt_latents") \
        if prompt_latents is not None else None
    ref_patches = guards.check_latents(config, reference_latents, "reference_latents") \
        if reference_latents is not None else None
    if v is not None:
        ref_patches = v.latents if v.info.mode == "reference" else None
        given_prompt = prompt_patches is not None or prompt_audio is not None
        if v.info.mode == "prompt" and given_prompt:
            raise InvalidParameter(f"stored voice {voice!r} is a prompt voice ({config.architecture}): it is "
                                   "the request's prompt and takes no other (continuation) prompt")
        # a given prompt (a continuation) replaces a voice's own; so does an instruction a reference voice's
        # (the two never come together, and the reference alone still carries the voice)
        styled = v.info.mode == "reference" and bool(instruction and instruction.strip())
        if v.text is not None and not given_prompt and not styled:
            prompt_text, prompt_patches = v.text, v.latents
        lora = v.info.lora if lora is None else lora
    if lora is not None and not isinstance(lora, str):
        raise InvalidParameter(f"lora must be an adapter name (got {type(lora).__name__})")
    # the voice's shared prefix KV was computed under the voice's adapter: another adapter recomputes it
    shared = v is not None and v.shared_prefix and lora == v.info.lora
    args = dict(text=text, prompt_text=prompt_text, prompt_patches=prompt_patches, ref_patches=ref_patches,
                params=params, request_id=request_id, voice_id=voice if shared else None, lora=lora,
                tenant=tenant, instruction=instruction)
    return CheckedRequest(args, (prompt_audio, reference_audio, prompt_sample_rate))
