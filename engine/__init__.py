"""voxgate engine: streaming VoxCPM inference with continuous batching, one worker process per device.

The configuration and the errors load with the package; what needs torch or numpy (the engine, its streams and
results) loads on first use, so that `voxgate --help`, a remote `voxgate say` and the gateway's config tables start
without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.engine_config import EngineConfig
from engine.errors import (
    AudioTooLong,
    EmptyText,
    EngineError,
    EngineOverloaded,
    EngineStopped,
    InvalidAudio,
    InvalidLoRA,
    InvalidParameter,
    InvalidRequest,
    TenantOverloaded,
    TextTooLong,
    UnknownLoRA,
    UnknownVoice,
    WorkerCallFailed,
    WorkerCrashed,
)

if TYPE_CHECKING:
    from engine.api import AudioChunk, EngineStats, LoRAInfo, ModelInfo, VoiceInfo
    from engine.engine import Engine
    from engine.generation import Generation
    from engine.sync import SyncEngine

LAZY = {  # public name -> the module that defines it, imported when the name is first read
    "AudioChunk": "engine.api", "EngineStats": "engine.api", "LoRAInfo": "engine.api", "ModelInfo": "engine.api",
    "VoiceInfo": "engine.api", "Engine": "engine.engine", "Generation": "engine.generation",
    "SyncEngine": "engine.sync",
}

__all__ = [
    "AudioChunk", "AudioTooLong", "EmptyText", "Engine", "EngineConfig", "EngineError", "EngineOverloaded",
    "EngineStats", "EngineStopped", "Generation", "InvalidAudio", "InvalidLoRA", "InvalidParameter", "InvalidRequest",
    "LoRAInfo", "ModelInfo", "SyncEngine", "TenantOverloaded", "TextTooLong", "UnknownLoRA", "UnknownVoice",
    "VoiceInfo", "WorkerCallFailed", "WorkerCrashed",
]


def __getattr__(name: str) -> Any:
    """`engine.Engine` and the other torch-backed names (PEP 562): imported here on first use, then cached."""
    module = LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *LAZY})
