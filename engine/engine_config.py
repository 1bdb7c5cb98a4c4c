"""`EngineConfig`: every tunable of `Engine(...)`, each with its default, range check and CLI flag, defined once.

Where the configuration lives:
- `EngineConfig` (here): what an operator sizes and switches, per engine (`Engine(model, config=...)`, or the same
  names as keyword arguments; `voxgate serve/say` flags are generated from these fields).
- `engine.worker.WorkerConfig`: an `EngineConfig` plus one worker's model, device(s) and environment switches.
- `engine.settings.EngineSettings`: the `VOXGATE_*` environment switches (A/B timing, debugging, tests).
- `engine.guards.SamplingRanges`: what a request's settings may be (shared with the gateway's protocol check).
- `gateway.gateway_config.GatewayConfig`: the gateway's options (the other `voxgate serve` flags).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from engine.errors import InvalidParameter
from engine.options import check_options, float_in, fraction, int_in, option

VAE_DTYPES = ("float32", "bfloat16")  # what `EngineConfig.vae_dtype` may be
MAX_TIMESTEPS = 100  # the most an operator may serve (`max_timesteps`); a request may ask for what is served


def device_list(raw: str) -> list[int | str]:
    """"0,1" -> [0, 1]; "cpu,cpu" -> ["cpu", "cpu"] (ValueError otherwise)."""
    try:
        return [d.strip() if d.strip() == "cpu" else int(d) for d in raw.split(",")]
    except ValueError:
        raise ValueError(f"{raw!r}: expected indices like 0,1 (or cpu)") from None


@dataclass(frozen=True)
class EngineConfig:
    """An engine's sizes and switches; every field is checked on construction (`InvalidParameter`)."""

    devices: tuple[int | str, ...] | None = option(
        None, flag="--devices", from_flag=device_list, default_text="the first GPU, else one CPU worker",
        help="CUDA device indices, e.g. 0,1 (one engine worker per GPU, or per group of --tensor-parallel-size "
             "GPUs); cpu,cpu: two CPU workers")
    tensor_parallel_size: int = option(
        1, flag="--tensor-parallel-size", check=int_in(1),
        help="GPUs per engine worker: the LMs and LocDiT split across them")
    max_num_seqs: int = option(256, flag="--max-num-seqs", check=int_in(1), help="concurrent requests per worker")
    max_waiting: int | None = option(
        None, flag="--max-waiting", check=int_in(0), default_text="--max-num-seqs",
        help="requests per worker queued beyond --max-num-seqs; more are refused as overloaded")
    max_num_batched_tokens: int = option(
        32768, flag="--max-num-batched-tokens", check=int_in(1),
        help="positions one step takes at most (sizes the step's activations)")
    max_prefill_tokens_while_speaking: int = option(
        8192, flag="--max-prefill-tokens-while-speaking", check=int_in(1),
        help="prompt positions one step takes while any stream is speaking (each step is every listener's wait)")
    gpu_memory_utilization: float = option(
        0.9, flag="--gpu-memory-utilization", check=fraction,
        help="share of the GPU's memory the worker may use (the KV cache takes what the model and graphs leave)")
    inference_timesteps: int = option(
        10, flag="--timesteps", check=int_in(1, MAX_TIMESTEPS), help="diffusion steps per patch")
    max_timesteps: int | None = option(
        None, flag="--max-timesteps", default_text="--timesteps",  # checked in __post_init__
        help="the most diffusion steps a request may ask for. Fewer than --timesteps cost nothing; a request above "
             "it adds a short tail (its extra LocDiT evaluations, for its own rows only) to the steps it is in")
    dtype: str | None = option(
        None, flag="--dtype", default_text="the checkpoint's on a GPU, float32 on a CPU",
        help="the model's weights and activations: float32, bfloat16 or float16")
    block_size: int = option(16, flag="--block-size", check=int_in(1), help="positions per KV cache block")
    num_kv_blocks: int | None = option(
        None, flag="--num-kv-blocks", check=int_in(1), default_text="sized from --gpu-memory-utilization",
        help="KV cache blocks per worker")
    sit_out_ms: float = option(
        2000.0, flag="--sit-out-ms", check=float_in(0),
        help="a stream whose listener has this much audio buffered may sit out a step when the GPU is full")
    worker_threads: int = option(1, flag="--worker-threads", check=int_in(1), help="CPU threads per worker process")
    max_loras: int = option(
        0, flag="--max-loras", check=int_in(0, 4096),
        help="LoRA adapters resident on each worker at once (0: no adapters can be registered)")
    max_lora_rank: int = option(32, flag="--max-lora-rank", check=int_in(1, 1024),
                                help="the largest adapter rank accepted")
    vae_dtype: str = option(
        "float32", flag="--vae-dtype", choices=VAE_DTYPES,
        help="the streaming audio decoder's precision: bfloat16 is faster at scale, with ~2.7% relative audio error "
             "(float32 as the official code; prompts are always encoded in float32)")
    # beyond 320 speaking streams a full VoxCPM2 step is long enough that a new prompt's ~3 steps of wait approach the
    # 300 ms TTFB target (split, each wait is about half as long, for a few % of throughput)
    split_decodes_above: int | None = option(
        320, flag="--split-decodes-above", check=int_in(1), optional=True, from_flag=lambda n: n or None,
        help="more speaking streams than this (per worker) decode in two halves taking turns: first audio ~2x "
             "sooner at high load, each stream still a patch every two steps (0 on the command line, None in "
             "Python: never split)")
    merge_lora: bool = option(
        True, flag="--no-merge-lora",
        help="always the batched LoRA kernels; by default steps whose streams all use one adapter run it merged into "
             "the weights (base-model speed, ~0.8 GB more GPU memory for VoxCPM2)")
    fp8_prefill: bool = option(
        False, flag="--fp8-prefill",
        help="run the LMs' large prefill GEMMs (bursts of prompts, long prompts) in FP8: ~1.5x faster GEMMs (a burst "
             "of prompts gets its first audio sooner), for FP8 rounding in the prompts' KV cache and ~1.7 GB more GPU "
             "memory for VoxCPM2; needs an Ada or Hopper GPU; not with LoRA or tensor parallelism")
    fp8_dit: bool = option(
        False, flag="--fp8-dit",
        help="run the LocDiT's GEMMs of busy steps (~47+ streams) in FP8: more streams per GPU, with FP8 rounding in "
             "every patch of those steps; needs an Ada or Hopper GPU; not with LoRA or tensor parallelism")
    max_queued_per_tenant: int | None = option(
        None, flag="--max-queued-per-key", check=int_in(1), default_text="no limit",
        help="prompts of one API key (tenant) waiting for their first audio at most; more are refused with "
             "rate_limited (prefill is shared fairly between keys either way)")

    def __post_init__(self) -> None:
        if isinstance(self.devices, list):  # frozen and hashable: a caller's list becomes a tuple
            object.__setattr__(self, "devices", tuple(self.devices))
        check_options(self)
        if self.max_timesteps is not None:  # below the default it would refuse the default itself
            int_in(self.inference_timesteps, MAX_TIMESTEPS)("max_timesteps", self.max_timesteps)
        if self.fp8_prefill or self.fp8_dit:
            if self.max_loras:  # a merged adapter changes the weights the FP8 copies came from
                raise InvalidParameter("fp8_prefill and fp8_dit do not combine with LoRA slots (max_loras) yet")
            if self.tensor_parallel_size > 1:  # the sharded linears keep no FP8 copy yet
                raise InvalidParameter("fp8_prefill and fp8_dit do not combine with tensor parallelism yet")

    @property
    def served_timesteps(self) -> int:
        """The most diffusion steps a request may ask for (`max_timesteps`, default `inference_timesteps`)."""
        return self.max_timesteps or self.inference_timesteps

    @property
    def waiting_room(self) -> int:
        """Requests per worker queued beyond `max_num_seqs` (`max_waiting`, default `max_num_seqs`)."""
        return self.max_num_seqs if self.max_waiting is None else self.max_waiting

    def as_kwargs(self) -> dict[str, Any]:
        """Every field of `EngineConfig` by name (what `WorkerConfig` copies)."""
        return {f.name: getattr(self, f.name) for f in fields(EngineConfig)}
