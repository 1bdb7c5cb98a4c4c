"""A request's prompt laid out as positions (`engine.prompt` has the four layouts), with no tensor: the part of a
request a caller without torch builds (the engine's caller, a gateway front process)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.config import ModelConfig
from engine.errors import EmptyText, InvalidAudio, InvalidRequest
from engine.text import Tokenizer, normalize_text

AUDIO_START, AUDIO_END, REF_AUDIO_START, REF_AUDIO_END = 101, 102, 103, 104
# Last prompt patches the streaming VAE is primed with in continuation (the official streaming_prefix_len - 1).
CONTEXT_PATCHES = {"voxcpm": 2, "voxcpm2": 3}



def length_cap(n_target_tokens: int, max_len: int) -> int:
    """The official cap on generated patches: 6 per target token plus 10, at most `max_len`."""
    return min(int(6 * n_target_tokens + 10), max_len)


def build_final_text(text: str, instruction: str | None) -> str:
    """`(instruction)text`, exactly as the official CLI builds it (a blank instruction leaves the text as it is)."""
    instruction = (instruction or "").strip()
    return f"({instruction}){text}" if instruction else text


@dataclass
class PromptLayout:
    """A prompt before any tensor is built: what `build_prompt` and the engine's request builder share."""

    token_ids: list[int]  # 0 at audio positions
    audio_mask: list[int]  # 1 at audio positions
    audio: list[tuple[int, np.ndarray]]  # (first position, float32 patches [T, P, D]) of each audio run, in order
    n_target_tokens: int
    n_context: int  # last prompt patches that prime the VAE stream (continuation), else 0


def prompt_layout(config: ModelConfig, tokenizer: Tokenizer, text: str, *, prompt_text: str | None = None,
                  prompt_patches: np.ndarray | None = None, reference_patches: np.ndarray | None = None,
                  instruction: str | None = None) -> PromptLayout:
    """The positions of one request's prefill (see the module docstring for the four layouts), checked; plain
    lists and the given float32 arrays, so it makes no tensor (it runs on the engine caller's thread)."""
    if not isinstance(text, str):
        raise InvalidRequest(f"text must be a string (got {type(text).__name__})")
    target = normalize_text(text)
    if not target.strip():
        raise EmptyText("text is empty")
    if instruction is not None and not isinstance(instruction, str):
        raise InvalidRequest(f"instruction must be a string (got {type(instruction).__name__})")
    if instruction and instruction.strip():
        if prompt_text is not None:
            raise InvalidRequest("an instruction cannot come with a prompt (continuation), as in the official CLI")
        target = normalize_text(build_final_text(text, instruction))  # the official normalises the final text
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
    audio: list[tuple[int, np.ndarray]] = []

    def add_audio(patches: np.ndarray) -> None:
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
