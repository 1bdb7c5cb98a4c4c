"""The compat adapters' routes, added to the gateway's application in one call."""

from __future__ import annotations

from aiohttp import web

from gateway.compat import cartesia, deepgram, elevenlabs, elevenlabs_pronunciation, openai, twilio


def register(app: web.Application) -> None:
    """Add the compat routes to an application made by `gateway.server.create_app` (before it starts, and before
    any catch-all static route)."""
    openai.register(app)
    elevenlabs.register(app)
    elevenlabs_pronunciation.register(app)
    cartesia.register(app)
    deepgram.register(app)
    twilio.register(app)
