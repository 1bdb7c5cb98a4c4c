"""`SamplingParams`: one request's sampling settings, with the API's defaults (torch-free, so the CLI's flags can
show them without loading the engine)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.engine_config import EngineConfig


@dataclass
class SamplingParams:
    """One request's sampling settings; these defaults are the API's (`Engine.generate`, `voxgate say`, the offline
    reference path)."""

    cfg_value: float = 2.0
    temperature: float = 1.0
    seed: int = 0
    max_length: int = 2000  # patches, already capped by the caller (official rule, positions, KV)
    min_length: int = 2  # the official rule: a stop flag counts only once more than this many patches exist
    timesteps: int = EngineConfig.inference_timesteps  # the caller sends the engine's own default
    priority: int = 0
