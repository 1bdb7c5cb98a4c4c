"""Typed errors of the engine's public API.

Input errors are `InvalidRequest` (also a `ValueError`) and are raised in the caller's process before anything is
queued, so a bad request never reaches a worker. Capacity and process failures have their own types so the gateway
can map each one to a status code without reading messages.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequest(EngineError, ValueError):
    """The request can never be served as given (fix the input, do not retry)."""


class EmptyText(InvalidRequest):
    """The text has nothing to speak after normalisation."""


class TextTooLong(InvalidRequest):
    """The prompt does not fit the model's positions (or the KV cache) with room to speak."""


class InvalidParameter(InvalidRequest):
    """A sampling or length parameter is NaN, negative or out of range."""


class UnknownVoice(InvalidRequest):
    """No stored voice has this id."""


class InvalidAudio(InvalidRequest):
    """Prompt or reference audio (or latents) cannot be used."""


class InvalidLoRA(InvalidRequest):
    """A LoRA adapter cannot be used: missing config, unknown target, rank above the maximum, wrong shapes."""


class UnknownLoRA(InvalidRequest):
    """No registered LoRA adapter has this name."""


class EngineOverloaded(EngineError):
    """The wait queue is full: retry later or elsewhere."""


class TenantOverloaded(EngineOverloaded):
    """This tenant (API key) has its limit of requests waiting for first audio: retry once some have started."""


class AudioTooLong(InvalidAudio):
    """Prompt or voice audio is longer than the engine takes (`engine.guards.MAX_PROMPT_AUDIO_S`)."""


class WorkerCrashed(EngineError):
    """The worker process serving the request died; the engine restarts it."""


class WorkerCallFailed(EngineError):
    """A worker could not do what it was asked (store a voice's prefix, load or free an adapter) for a reason other
    than the caller's input: the message says why."""


class EngineStopped(EngineError):
    """The engine was stopped (or is not started)."""
