"""A session's settings: what `session.start` and `session.update` set (output format, chunking, generation, voice,
pronunciation dictionaries), checked and resolved before any of them is applied, so a refused update changes
nothing. `SessionSettings` is a part of `Session`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gateway import protocol as p
from gateway.audio import OutputFormat, opus_available
from gateway.engine_contract import SessionEngine
from gateway.protocol import ErrorCode, ProtocolError
from gateway.text.segmenter import ChunkingConfig
from gateway.voices import stored_voices


class SessionSettings:
    """The settings work of a `Session` (it mixes this in)."""

    # the Session's attributes these methods use
    engine: SessionEngine
    voices: Callable[[str], Awaitable[str | None]] | None
    pronunciations: Callable[[list[str]], Awaitable[Callable[[str], str] | None]] | None
    sampling_ranges: Any
    model_rate: int
    fmt: OutputFormat
    chunking: ChunkingConfig
    generation: p.GenerationSettings
    rewrite: Callable[[str], str] | None
    voice: str | None
    voice_is_prompt: bool

    async def _apply_settings(self, voice: str | None, output: dict | None, chunking: dict | None,
                              generation: dict | None, set_voice: bool) -> None:
        try:
            fmt = self.fmt if output is None else OutputFormat.from_dict(output, self.model_rate)
            chunk_cfg = self.chunking if chunking is None else _chunking_from_dict(chunking)
        except (ValueError, TypeError) as e:
            raise ProtocolError(ErrorCode.INVALID_VALUE, str(e)) from None
        if fmt.kind == 0:
            raise ProtocolError(ErrorCode.INVALID_VALUE, f"output.format {fmt.format!r} is for HTTP streaming; "
                                "the WebSocket sends opus, pcm_s16le, mulaw or alaw frames")
        if fmt.format == "opus":
            try:
                opus_available()
            except RuntimeError as e:  # libopus missing: the message says how to fix it, or to ask for PCM
                raise ProtocolError(ErrorCode.INVALID_VALUE, str(e)) from None
        if generation is not None:
            p.check_generation(generation, ranges=self.sampling_ranges)
        gen = self.generation if generation is None else self.generation.merged(generation)
        resolved = await self._resolve_voice(voice) if set_voice and voice is not None else None
        if set_voice and voice is not None and resolved is None:
            raise ProtocolError(ErrorCode.UNKNOWN_VOICE, f"no stored voice {voice!r}; create one with POST /v1/voices")
        is_prompt = (resolved is not None and resolved[1]) if set_voice else self.voice_is_prompt
        if is_prompt and gen.instruction and gen.instruction.strip():
            raise ProtocolError(ErrorCode.INVALID_VALUE, "generation.instruction cannot be used with a prompt voice "
                                "(VoxCPM 0.5B/1.5): the voice is a prompt, and an instruction never comes with one")
        rewrite = self.rewrite
        if generation is not None and "pronunciations" in generation:
            rewrite = await self._resolve_pronunciations(list(gen.pronunciations))
        self.fmt, self.chunking, self.generation, self.rewrite = fmt, chunk_cfg, gen, rewrite
        if set_voice:
            self.voice = voice
            self.voice_is_prompt = is_prompt

    async def _resolve_pronunciations(self, ids: list[str]) -> Callable[[str], str] | None:
        if not ids:
            return None
        if self.pronunciations is None:
            raise ProtocolError(ErrorCode.UNKNOWN_PRONUNCIATION, "this server keeps no pronunciation dictionaries")
        return await self.pronunciations(ids)

    async def _resolve_voice(self, voice: str) -> tuple[str, bool] | None:
        """The engine voice this session may speak with under `voice`, and whether it is a prompt voice (VoxCPM
        0.5B/1.5: every segment's prompt itself, so its turns take no continuation prompt); None if unknown."""
        found = await self.voices(voice) if self.voices is not None else voice
        if found is None:
            return None
        modes = await stored_voices(self.engine)
        if self.voices is None and found not in modes:
            return None
        return found, modes.get(found) == "prompt"


def _chunking_from_dict(d: dict[str, Any]) -> ChunkingConfig:
    from_dict = getattr(ChunkingConfig, "from_dict", None)
    return from_dict(d) if from_dict is not None else ChunkingConfig(**d)
