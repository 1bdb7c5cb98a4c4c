"""`SyncEngine`: the `Engine` API, blocking, for code without an event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.api import AudioChunk, EngineStats, LoRAInfo, ModelInfo, VoiceInfo
from engine.errors import EngineStopped
from engine.generation import Generation

if TYPE_CHECKING:
    from engine.engine import Engine


class SyncEngine:
    """The same API, blocking, for code without an event loop: an `Engine` runs on a private loop thread and each
    method waits for the `Engine` method of the same name."""

    def __init__(self, make_engine: Callable[[], Engine]):
        """`make_engine` builds the `Engine` on the private loop thread (`Engine.from_pretrained` passes it)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="voxgate-engine")
        self._thread.start()

        async def make() -> Engine:
            return make_engine()

        self.engine: Engine = self._run(make())

    def _run(self, coro: Any) -> Any:
        if not self._loop.is_running():
            coro.close()
            raise EngineStopped("the engine is stopped")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _on_loop(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # even the engine's plain methods run on its loop thread: the state they read is the loop's alone
        async def call() -> Any:
            return fn(*args, **kwargs)

        return self._run(call())

    def generate(self, text: str, **kwargs: Any) -> Iterator[AudioChunk]:
        """Input errors raise here, at the call; the chunks come as the returned iterator is consumed."""
        return self._iterate(self._on_loop(self.engine.generate, text, **kwargs))

    def _iterate(self, gen: Generation) -> Iterator[AudioChunk]:
        try:
            while True:
                try:
                    yield self._run(gen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(gen.aclose())

    def cancel(self, request_id: str) -> None:
        self._run(self.engine.cancel(request_id))

    def update_buffered(self, request_id: str, audio_ms: float) -> None:
        self._on_loop(self.engine.update_buffered, request_id, audio_ms)

    def add_voice(self, **kwargs: Any) -> str:
        return self._run(self.engine.add_voice(**kwargs))

    def remove_voice(self, voice_id: str) -> None:
        self._run(self.engine.remove_voice(voice_id))

    def list_voices(self) -> list[VoiceInfo]:
        return self._on_loop(self.engine.list_voices)

    def register_lora(self, name: str, source: Any, config: dict[str, Any] | None = None) -> LoRAInfo:
        return self._run(self.engine.register_lora(name, source, config))

    def unregister_lora(self, name: str) -> None:
        self._run(self.engine.unregister_lora(name))

    def list_loras(self) -> list[LoRAInfo]:
        return self._on_loop(self.engine.list_loras)

    def encode_audio(self, audio: bytes | np.ndarray, sample_rate: int | None = None) -> np.ndarray:
        return self._run(self.engine.encode_audio(audio, sample_rate))

    def model_info(self) -> ModelInfo:
        return self._on_loop(self.engine.model_info)

    def health(self) -> dict[str, Any]:
        return self._on_loop(self.engine.health)

    def stats(self) -> EngineStats:
        return self._on_loop(self.engine.stats)

    def wait_for_ready(self) -> None:
        self._run(self.engine.wait_for_ready())

    def __enter__(self) -> SyncEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """End every request with `EngineStopped`, stop the workers and the loop thread (also on leaving `with`)."""
        if self._loop.is_running():
            self._run(self.engine.stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
