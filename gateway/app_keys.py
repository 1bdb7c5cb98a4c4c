"""The application's key to its `Gateway`, in a module of its own so the route modules (voice_api,
pronunciation_api, readiness, compat) need not import `gateway.server`, which registers them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from gateway.server import Gateway

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway")

