"""Every 4xx answer logged at the default level (WARNING), one structured line each: the route (its pattern, so no
ids or query-string credentials), the method, the status and the reason the answer itself gives (its error message,
never the request), so an operator sees why a client's calls fail."""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

log = logging.getLogger("voxgate.refused")

MAX_REASON_CHARS = 300
_REASON_KEYS = ("message", "description", "detail", "error")  # where each protocol's error body says why


def _reason_in(body: Any) -> str | None:
    """The first error message in a JSON error body of any of the gateway's protocols (native, OpenAI, ElevenLabs,
    Cartesia, Deepgram)."""
    if isinstance(body, str):
        return body
    if isinstance(body, dict):
        for key in _REASON_KEYS:
            found = _reason_in(body.get(key))
            if found:
                return found
    return None


def reason(response: web.StreamResponse) -> str:
    """Why the answer refuses: its body's message, Deepgram's `dg-error` header, or the HTTP reason phrase."""
    body = getattr(response, "body", None)
    found = None
    if isinstance(body, bytes | bytearray) and body:
        try:
            found = _reason_in(json.loads(body))
        except ValueError:
            found = None
    found = found or response.headers.get("dg-error") or response.reason
    return found[:MAX_REASON_CHARS]


def route(request: web.Request) -> str:
    """The matched route's pattern (`/v1/text-to-speech/{voice_id}/stream`), or the path when none matched."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else request.path


async def log_refusal(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare` hook: one WARNING line per 4xx answer (refused WebSocket handshakes included)."""
    if 400 <= response.status < 500:
        log.warning("refused route=%s method=%s status=%d reason=%s", route(request), request.method,
                    response.status, json.dumps(reason(response), ensure_ascii=False))
