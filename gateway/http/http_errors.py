"""How HTTP failures look from outside: a server bug is logged once with its traceback and answered with a typed JSON
error, never aiohttp's bare 500; a client that hangs up mid-request is not an error; malformed HTTP (huge URLs,
header floods, conflicting lengths, TLS to a plain port) is noise any anonymous client can make, so it is logged in one
line at DEBUG, never as an ERROR with a traceback that would page an operator."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from gateway.protocol import ErrorCode

log = logging.getLogger("voxgate.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, code: str, message: str) -> web.Response:
    """The gateway's HTTP error body: {"error": {"code", "message"}}."""
    return web.json_response({"error": {"code": str(code), "message": message}}, status=status)


@web.middleware
async def typed_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Unexpected exceptions of any handler -> logged once, 500 {"error": {"code": "internal_error"}}; a client gone
    mid-request -> a DEBUG line (nobody is left to answer)."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except ConnectionError as e:
        log.debug("%s %s: the client went away (%s)", request.method, request.path, e)
        raise
    except Exception:
        log.exception("%s %s: internal error", request.method, request.path)
        if request.writer is not None and request.writer.output_size > 0:
            # the status has gone out (a streamed body, an upgraded socket): the body can only be cut short
            raise ConnectionResetError("the response had started: cut short after an internal error") from None
        return error_response(500, ErrorCode.INTERNAL_ERROR, "internal error; the server log has the details")


class _MalformedHttp(logging.Filter):
    """On aiohttp's server logger: errors caused by what a client sent (a request aiohttp cannot parse, a connection
    lost mid-request) become one DEBUG line; everything else passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError | ConnectionError):
            return True
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.debug("%s (%s: %s)", record.getMessage(), type(exc).__name__, first_line)
        return False


_FILTER = _MalformedHttp()


def quiet_malformed_http() -> None:
    """Install the filter on aiohttp's server logger (idempotent)."""
    server_log = logging.getLogger("aiohttp.server")
    if _FILTER not in server_log.filters:
        server_log.addFilter(_FILTER)
