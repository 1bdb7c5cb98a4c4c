"""voxgate engine: streaming VoxCPM inference with continuous batching, one worker process per device."""

from engine.errors import (
    EmptyText,
    EngineError,
    EngineOverloaded,
    EngineStopped,
    InvalidAudio,
    InvalidLoRA,
    InvalidParameter,
    InvalidRequest,
    TextTooLong,
    UnknownLoRA,
    UnknownVoice,
    WorkerCrashed,
)
from engine.pool import AudioChunk, Engine, EngineStats, Generation, LoRAInfo, ModelInfo, SyncEngine, VoiceInfo

__all__ = [
    "AudioChunk", "EmptyText", "Engine", "EngineError", "EngineOverloaded", "EngineStats", "EngineStopped",
    "Generation", "InvalidAudio", "InvalidLoRA", "InvalidParameter", "InvalidRequest", "LoRAInfo", "ModelInfo",
    "SyncEngine", "TextTooLong", "UnknownLoRA", "UnknownVoice", "VoiceInfo", "WorkerCrashed",
]
