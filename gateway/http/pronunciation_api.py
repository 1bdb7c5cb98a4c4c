"""HTTP API for pronunciation dictionaries (`/v1/pronunciations`): parse requests, answer them; the rules and who
may use what are gateway.text.pronunciation's job."""

from __future__ import annotations

from aiohttp import web

from gateway.app_keys import GATEWAY
from gateway.auth import Caller
from gateway.http.http_errors import error_response
from gateway.http.voice_api import keyed
from gateway.protocol import ErrorCode, ProtocolError, load_json
from gateway.text.pronunciation import RuleError


@keyed
async def add_dictionary(request: web.Request, caller: Caller) -> web.Response:
    """POST /v1/pronunciations: `{"name"?, "rules": [{"word" | "regex", "phonemes" | "alias", "case_sensitive"?}]}`
    -> 201 `{pronunciation_id, name, rules, public}`, owned by the calling key."""
    try:
        body = load_json(await request.read())
    except ProtocolError as e:  # not JSON, or strings that are not valid Unicode
        return error_response(400, e.code, e.message)
    try:
        view = await request.app[GATEWAY].pronunciations.create(caller, body)
    except RuleError as e:
        return error_response(400, ErrorCode.INVALID_VALUE, str(e))
    return web.json_response(view, status=201)


@keyed
async def list_dictionaries(request: web.Request, caller: Caller) -> web.Response:
    """GET /v1/pronunciations: the dictionaries this key may use."""
    return web.json_response({"pronunciations": await request.app[GATEWAY].pronunciations.list(caller)})


@keyed
async def remove_dictionary(request: web.Request, caller: Caller) -> web.Response:
    """DELETE /v1/pronunciations/{id}: 204; another key's dictionary is a 404, as if it did not exist."""
    await request.app[GATEWAY].pronunciations.delete(caller, request.match_info["pronunciation_id"])
    return web.Response(status=204)


def register(app: web.Application) -> None:
    r = app.router
    r.add_post("/v1/pronunciations", add_dictionary)
    r.add_get("/v1/pronunciations", list_dictionaries)
    r.add_delete("/v1/pronunciations/{pronunciation_id}", remove_dictionary)
