"""voxgate engine: streaming VoxCPM inference with continuous batching, one worker process per device."""

from engine.api import AudioChunk, EngineStats, LoRAInfo, ModelInfo, VoiceInfo
from engine.engine import Engine
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
from engine.generation import Generation
from engine.sync import SyncEngine

__all__ = [
    "AudioChunk", "AudioTooLong", "EmptyText", "Engine", "EngineConfig", "EngineError", "EngineOverloaded",
    "EngineStats", "EngineStopped", "Generation", "InvalidAudio", "InvalidLoRA", "InvalidParameter", "InvalidRequest",
    "LoRAInfo", "ModelInfo", "SyncEngine", "TenantOverloaded", "TextTooLong", "UnknownLoRA", "UnknownVoice",
    "VoiceInfo", "WorkerCallFailed", "WorkerCrashed",
]
