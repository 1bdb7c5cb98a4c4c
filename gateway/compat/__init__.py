"""Foreign protocols over the one native `Session`: OpenAI speech (HTTP), ElevenLabs stream-input (WebSocket) and a
Twilio Media Streams bridge. Each adapter only translates messages: it feeds the session native client messages and
is the session's `Transport`, turning the native messages and audio frames the session sends into the foreign form.
Segmenting, pacing, encoding and cancellation exist once, in gateway.session and gateway.audio."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from gateway.audio import Encoder, OutputFormat
from gateway.auth import AuthError

if TYPE_CHECKING:  # gateway.server may import this package from its app factory
    from gateway.server import Gateway


def register(app: web.Application) -> None:
    """Add the compat routes to an application made by `gateway.server.create_app` (before it starts, and before
    any catch-all static route)."""
    from gateway.compat import elevenlabs, openai, twilio  # here: the adapters import this module's helpers

    openai.register(app)
    elevenlabs.register(app)
    twilio.register(app)


def native(kind: str, **fields: Any) -> str:
    """One native client message, as the session reads it."""
    return json.dumps({"type": kind, **fields}, ensure_ascii=False, separators=(",", ":"))


def check_api_key(gw: Gateway, key: str | None) -> str:
    """The identity for a raw API key (foreign protocols pass keys without `Bearer`); AuthError if refused."""
    if gw.auth.enabled and not key:
        raise AuthError("no API key")
    return gw.auth.check_key(f"Bearer {key}")


def gateway_of(request: web.Request) -> Gateway:
    from gateway.server import GATEWAY

    return request.app[GATEWAY]


class Transcoder:
    """PCM s16le frames from a session -> one container stream (MP3, Ogg Opus, AAC, FLAC, WAV) through
    gateway.audio's Encoder at the same rate, so nothing is resampled twice. `pcm_s16le` passes through."""

    def __init__(self, fmt: OutputFormat):
        self.fmt = fmt
        self._encoder = None if fmt.format == "pcm_s16le" else Encoder(fmt, fmt.sample_rate)

    def write(self, pcm: bytes) -> bytes:
        if self._encoder is None:
            return pcm
        return b"".join(self._encoder.encode(np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767.0))

    def finish(self) -> bytes:
        return b"" if self._encoder is None else b"".join(self._encoder.finish())


__all__ = ["register", "native", "check_api_key", "gateway_of", "Transcoder", "AuthError"]
