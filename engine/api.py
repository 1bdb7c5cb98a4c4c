"""The plain records the engine hands its callers: audio chunks, model, voice and adapter descriptions, stats."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class AudioChunk:
    """One generated patch of one request."""

    audio: np.ndarray  # float32 mono at sample_rate, one patch
    sample_rate: int
    index: int
    latents: np.ndarray  # [P, D] the patch
    is_last: bool
    stop_reason: str | None
    request_id: str
    step: int = -1  # the worker's step that produced it (its scheduler's step count; -1: not from a worker)


@dataclass
class ModelInfo:
    name: str
    architecture: str
    sample_rate: int
    samples_per_patch: int
    patch_ms: float
    max_length: int
    is_demo: bool
    dtype: str
    device: str


@dataclass
class VoiceInfo:
    voice_id: str
    mode: str  # "reference" (v2: shared prefix KV), "prompt" (continuation from its audio and text) or "lora"
    num_patches: int
    text: str | None
    lora: str | None = None  # the LoRA adapter every request of this voice uses


@dataclass
class LoRAInfo:
    name: str
    rank: int
    alpha: float
    num_layers: int  # target linears the adapter changes
    num_parameters: int
    in_flight: int  # requests using it now


@dataclass
class EngineStats:
    """Sums over the workers of what each reports every step, plus the pool's own counts."""

    running: int = 0
    waiting: int = 0
    in_flight: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    voice_blocks: int = 0
    steps: int = 0
    preemptions: int = 0
    workers: int = 0
    workers_ready: int = 0
    worker_restarts: int = 0
    # requests the least loaded ready worker still takes before `EngineOverloaded` (None: an engine that does not say)
    admission_room: int | None = None
