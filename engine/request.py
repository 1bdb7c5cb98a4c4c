"""One request: what the caller sends (`RequestSpec`, picklable) and what the worker tracks while serving it.

A request's sequence is its prompt positions followed by the patches it generated. Before each new patch is sampled
every position but the newest must be in the KV cache; `num_computed` counts those that are. A decode step feeds one
position (the previous patch); a prefill feeds a chunk of the prompt; after a preemption the whole sequence so far
is recomputed, while the noise generator, the VAE stream slot and the emitted audio carry on untouched.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field

import torch

from engine.prompt import prompt_tensors
from engine.sampling import SamplingParams  # noqa: F401  (re-exported, as before)
from engine.specs import RequestSpec  # defined where a caller without torch builds it; re-exported here


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrivals = itertools.count()


@dataclass(eq=False)  # one object per request: compared (and searched in lists) by identity, not field by field
class Request:
    spec: RequestSpec
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    generated: list[torch.Tensor] = field(default_factory=list)  # [P, D] each
    vae_slot: int | None = None
    vae_primed: bool = False
    lora_slot: int = 0  # the model's LoRA slot holding spec.lora while admitted (0: none)
    decode_group: int = 0  # which half decodes it while the scheduler splits decodes (`split_decodes_above`)
    stop_reason: str | None = None
    num_preemptions: int = 0
    arrival: int = field(default_factory=lambda: next(_arrivals))
    # listener buffer estimate: reported ms at `reported_at`, plus audio emitted since, minus wall time since
    reported_ms: float | None = None
    reported_at: float = 0.0
    emitted_since_report_ms: float = 0.0
    first_emit_at: float | None = None
    generator: torch.Generator = field(init=False)
    # the prompt's tensors, made here in the worker (the caller's thread makes none)
    patches: torch.Tensor = field(init=False)  # [N, P, D]
    prompt_cond: torch.Tensor = field(init=False)  # [P, D] the patch that conditions the first sampled one
    context_patches: torch.Tensor = field(init=False)  # [C, P, D] primes the VAE stream (C = 0: no continuation)

    def __post_init__(self) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(self.spec.params.seed)
        spec = self.spec
        self.patches, self.prompt_cond, self.context_patches = prompt_tensors(
            spec.prompt_len, spec.audio, spec.n_context, spec.patch_shape)

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def seq_len(self) -> int:
        """Positions that must be in the KV cache before the next patch is sampled."""
        return self.spec.prompt_len + len(self.generated)

    @property
    def num_pending(self) -> int:
        return self.seq_len - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        # num_pending > 1, from the fields: the scheduler asks this of every running request at every step
        return not self.generated or self.num_computed + 1 < len(self.spec.token_ids) + len(self.generated)

    @property
    def cond(self) -> torch.Tensor:
        return self.generated[-1] if self.generated else self.prompt_cond

    def inputs(self, start: int, end: int) -> tuple[list[int], torch.Tensor, list[int]]:
        """Token ids, patches [n, P, D] and audio mask of positions [start, end)."""
        n_prompt = self.spec.prompt_len
        ids = self.spec.token_ids[start:min(end, n_prompt)]
        mask = self.spec.audio_mask[start:min(end, n_prompt)]
        parts = [self.patches[start:min(end, n_prompt)]]
        if end > n_prompt:
            new = self.generated[max(start, n_prompt) - n_prompt:end - n_prompt]
            ids = ids + [0] * len(new)
            mask = mask + [1] * len(new)
            parts.append(torch.stack(new))
        return ids, torch.cat(parts) if len(parts) > 1 else parts[0], mask

    def buffered_ms(self, now: float, patch_ms: float, unseen: int = 0) -> float:
        """Estimated audio queued at the listener; -inf before the first patch (the most urgent one). `unseen`:
        patches sampled but not appended yet (a step still on the device), counted as emitted `now`."""
        if not self.generated and not unseen:
            return -math.inf
        if self.reported_ms is not None:
            emitted = self.emitted_since_report_ms + unseen * patch_ms
            return self.reported_ms + emitted - 1000.0 * (now - self.reported_at)
        first = self.first_emit_at if self.first_emit_at is not None else now
        return (len(self.generated) + unseen) * patch_ms - 1000.0 * (now - first)

    def report_buffered(self, audio_ms: float) -> None:
        self.reported_ms, self.reported_at, self.emitted_since_report_ms = audio_ms, time.monotonic(), 0.0

    def append(self, patch: torch.Tensor, patch_ms: float) -> None:
        if self.first_emit_at is None:
            self.first_emit_at = time.monotonic()
        self.generated.append(patch)
        self.emitted_since_report_ms += patch_ms
