"""What a step hands back: its outputs, the step in flight, and its timing."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.cuda_graphs import DecodeResult
from engine.scheduler import ScheduledSeq


@dataclass
class StepOutput:
    """Aligned with the scheduled seqs; None where a seq only prefilled. On CUDA the audio arrays view pinned
    buffers that the step after next overwrites: copy them before then."""

    patches: list[torch.Tensor | None]  # [P, D] float32 on CPU
    stops: list[bool]
    audio: list[np.ndarray | None]  # float32 mono, one patch


@dataclass
class PendingStep:
    """A launched step: `done` already when it ran eagerly, else the graph path's rows behind `event`."""

    seqs: list[ScheduledSeq]
    done: StepOutput | None = None
    result: DecodeResult | None = None  # CPU outputs, or pinned host copies on CUDA
    event: torch.cuda.Event | None = None
    emit: list[int] | None = None  # the seq of each result row (None: row j is seq j)
    kind: str = "mixed"  # graph (decode replay), decode (CPU decode body), mixed (flat LMs + sample body/graphs)
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # CUDA: brackets the step's device work
    sampled: torch.Tensor | None = None  # its patches where it made them (on the device), row j = seq emit[j]
    audio_event: torch.cuda.Event | None = None  # the VAE lane: its audio is in `result` once this fired
    lora: str = ""  # how it ran LoRA (`Runner._launch`), for the DEBUG step log


@dataclass
class StepTiming:
    """What the last collected step was and what it cost: the worker reports it and the bench summarises it."""

    kind: str
    prefill_tokens: int  # positions fed by chunks of more than one position, or a first patch's prompt
    decode_rows: int
    gpu_ms: float | None  # CUDA events around the step's device work (None on CPU)
    audio_ms: float | None = None  # from the step's start until its audio was back on the host (the VAE lane)
    lora: str = ""  # "merged <slot>", "bypass" or "kernels" (+ each seq's slot at DEBUG); "" without LoRA slots
