"""voxgate engine: streaming VoxCPM inference with continuous batching, one worker process per device."""

from engine.errors import (
    EmptyText,
    EngineError,
    EngineOverloaded,
    EngineStopped,
    InvalidAudio,
    InvalidParameter,
    InvalidRequest,
    TextTooLong,
    UnknownVoice,
    WorkerCrashed,
)
from engine.pool import AudioChunk, Engine, EngineStats, Generation, ModelInfo, SyncEngine, VoiceInfo

__all__ = [
    "AudioChunk", "EmptyText", "Engine", "EngineError", "EngineOverloaded", "EngineStats", "EngineStopped",
    "Generation", "InvalidAudio", "InvalidParameter", "InvalidRequest", "ModelInfo", "SyncEngine", "TextTooLong",
    "UnknownVoice", "VoiceInfo", "WorkerCrashed",
]
