"""`SessionEngine`: what a gateway session needs of the engine (`engine.engine.Engine` is one; tests drive sessions
with stand-ins that implement the same methods)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from engine.api import AudioChunk, ModelInfo, VoiceInfo


class SessionEngine(Protocol):
    """The engine's async API as a session uses it."""

    def model_info(self) -> ModelInfo:
        """The model's name, sample rate and patch length (session.started reports them)."""
        ...

    def generate(self, text: str, **kwargs: Any) -> AsyncIterator[AudioChunk]:
        """Stream one segment's audio; input errors raise here; closing the iterator cancels the request."""
        ...

    async def cancel(self, request_id: str) -> None:
        """Stop a request."""
        ...

    def update_buffered(self, request_id: str, audio_ms: float) -> None:
        """The listener of `request_id` has `audio_ms` of audio queued (the scheduler's deadline hint)."""
        ...

    def list_voices(self) -> list[VoiceInfo]:
        """The stored voices (`gateway.voices.stored_voices` reads them)."""
        ...
