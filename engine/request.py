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

import numpy as np
import torch

from engine.sampling import SamplingParams


@dataclass
class RequestSpec:
    """Everything the worker needs, built and checked in the caller's process.

    Its arrays are numpy: the caller (a gateway's event loop) builds them without a torch op, each of which would
    drop the GIL and wait to take it back behind the loop's other threads; the worker's `Request` views them as
    tensors (`as_tensor`, no copy)."""

    request_id: str
    token_ids: list[int]
    patches: np.ndarray  # [N, P, D] float32; zeros at text positions (text-only: a read-only view of one zero)
    audio_mask: list[int]  # [N] 1 at audio positions
    cond: np.ndarray  # [P, D] float32: the patch that conditions the first sampled one
    context_patches: np.ndarray | None  # [C, P, D] float32: primes the VAE stream for continuation
    params: SamplingParams
    voice_id: str | None = None  # a stored voice whose prefix KV this prompt starts with
    prefix_only: bool = False  # compute the prompt's KV and keep it as a stored voice; sample nothing
    lora: str | None = None  # a registered LoRA adapter applied to this request
    tenant: str | None = None  # who asked (the API key): prefill is shared fairly between tenants; None: shared

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids)

    # Pickled with the audio rows only: a text-only prompt (most requests) sends its shape alone and skips the scan
    # of its mask, and the worker makes the same zero view.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if any(self.audio_mask):
            audio = [i for i, a in enumerate(self.audio_mask) if a]
            state["patches"] = (self.patches.shape, audio, self.patches[audio])
        else:
            state["patches"] = (self.patches.shape, None, None)
        return state

    def __setstate__(self, state: dict) -> None:
        shape, audio, values = state["patches"]
        if audio is None:
            state["patches"] = zero_patches(shape)
        else:
            state["patches"] = np.zeros(shape, np.float32)
            state["patches"][audio] = values
        self.__dict__.update(state)


# A fresh [N, P, D] zeros array per request costs page faults on each side of the pipe, and a worker unpickling a
# burst of 64 tiny-model prompts took 8-60 ms on a 2-core machine (~1 ms as views), all before the burst's first
# step. A broadcast view of one zero allocates nothing, and writes to it raise instead of corrupting it.
_ZERO = np.zeros((), np.float32)
_ZERO.flags.writeable = False
_ZERO_TENSOR = torch.zeros((), dtype=torch.float32)


def zero_patches(shape: tuple[int, ...]) -> np.ndarray:
    """All-zero float32 patches of `shape` (a text-only prompt's) as a read-only view: nothing allocated."""
    return np.broadcast_to(_ZERO, shape)


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """A spec's array as the worker's tensor, sharing its memory: a zero view (`zero_patches`) becomes the same
    view of one torch zero (in-place writes to it raise), any other read-only array a copy."""
    if array.size and not any(array.strides) and not array.flat[0]:
        return _ZERO_TENSOR.expand(array.shape)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


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
    # the spec's arrays as tensors (views, made here in the worker: the caller's thread makes no tensor)
    patches: torch.Tensor = field(init=False)  # [N, P, D]
    prompt_cond: torch.Tensor = field(init=False)  # [P, D]
    context_patches: torch.Tensor | None = field(init=False)  # [C, P, D]

    def __post_init__(self) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(self.spec.params.seed)
        spec = self.spec
        self.patches, self.prompt_cond = as_tensor(spec.patches), as_tensor(spec.cond)
        self.context_patches = None if spec.context_patches is None else as_tensor(spec.context_patches)

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
