"""Traffic that follows capacity: the node's load report and `/readyz` (503 once it cannot take another stream), and
the SIGTERM drain (still listening: /readyz 503, handshakes refused with a typed 503, turns in progress finish)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, is_dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.app_keys import GATEWAY
from gateway.protocol import ErrorCode

if TYPE_CHECKING:
    from gateway.server import Gateway

log = logging.getLogger("voxgate.server")


def _gateway(app: web.Application) -> Gateway:
    return app[GATEWAY]


def load_report(gw: Gateway) -> dict[str, Any]:
    """The node's load for balancers: open sessions and free session slots (the node's: every front's), the engine's
    running requests, its queue and its room for more (None when the engine does not say), and whether the node
    drains."""
    stats = gw.engine.stats()
    engine = stats if isinstance(stats, dict) else asdict(stats) if is_dataclass(stats) else {}
    sessions = gw.metrics.node_sessions(len(gw.sessions))  # the node's, across its fronts (`--fronts N`)
    return {"sessions": sessions, "free_slots": max(gw.config.max_sessions - sessions, 0),
            "running": engine.get("running"), "queue": engine.get("waiting"),
            "engine_room": engine.get("admission_room"), "draining": gw.draining}


def readiness(gw: Gateway, engine_status: str | None, load: dict[str, Any]) -> str:
    """"ready", or why the node takes no new stream now: draining, the engine's state, full, engine_saturated."""
    if gw.draining:
        return "draining"
    if engine_status not in ("ok", "degraded"):  # degraded: some workers serve while others restart
        return f"engine {engine_status}"
    if load["free_slots"] == 0:
        return "full"
    if load["engine_room"] == 0:
        return "engine_saturated"
    return "ready"


async def readyz(request: web.Request) -> web.Response:
    """GET /readyz: 200 while the engine serves and the node can take another stream; 503 while it drains, is at
    `max_sessions`, or its engine would refuse a new request. The body is the load report and that status."""
    gw = _gateway(request.app)
    try:
        health = gw.engine.health()
        load = load_report(gw)
    except Exception as e:  # a stopped or crashed engine is "not ready", never a 500
        return web.json_response({"status": "engine unavailable", "detail": str(e), "draining": gw.draining},
                                 status=503)
    status = readiness(gw, health.get("status") if isinstance(health, dict) else None, load)
    return web.json_response({"status": status, **load}, status=200 if status == "ready" else 503)


@web.middleware
async def refuse_sockets_while_draining(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every WebSocket handshake (native and compat) is answered 503 `server_shutdown` during the drain, before any
    socket opens, so a balancer can retry it on another node."""
    if _gateway(request.app).draining and request.headers.get("Upgrade", "").lower() == "websocket":
        return web.json_response({"error": {"code": str(ErrorCode.SERVER_SHUTDOWN), "message":
                                            "the server is shutting down; connect again (another node)"}}, status=503)
    return await handler(request)


async def drain(app: web.Application) -> None:
    """Stop taking streams while still listening: /readyz answers 503, new sessions are refused (HTTP 503
    `server_shutdown`), turns in progress get `shutdown_timeout_s` to finish, then each session ends with
    `server_shutdown` (close 1001). `voxgate serve` runs it on SIGTERM before it stops listening; the application's
    shutdown runs it too (then it finds nothing left to wait for)."""
    gw = _gateway(app)
    gw.draining = True
    sessions = [s for s in gw.sessions if not s.closed]
    if sessions:
        log.info("draining: %d sessions get %.0f s to finish their turns", len(sessions),
                 gw.config.shutdown_timeout_s)
    await asyncio.gather(*(s.shutdown(gw.config.shutdown_timeout_s) for s in sessions), return_exceptions=True)
