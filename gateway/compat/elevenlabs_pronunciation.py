"""ElevenLabs' `POST /v1/pronunciation-dictionaries/add-from-rules`, onto voxgate's pronunciation dictionaries
(gateway.text.pronunciation), so the ElevenLabs SDK's `pronunciation_dictionaries.create_from_rules` makes a dictionary
whose id `pronunciation_dictionary_locators` then selects.

Rules: `{"type": "alias", "string_to_replace", "alias"}` and `{"type": "phoneme", "string_to_replace", "phoneme",
"alphabet": "cmu-arpabet"}` (VoxCPM reads ARPAbet in braces; IPA is refused with a 422 that says so);
`case_sensitive` (default true) and `word_boundaries` (default true; false: the string matches anywhere) kept."""

from __future__ import annotations

import time
from typing import Any

import regex
from aiohttp import web

from gateway.auth import AuthError
from gateway.compat import check_api_key, gateway_of, json_body
from gateway.compat.elevenlabs import ElevenLabsError
from gateway.protocol import ErrorCode
from gateway.text.pronunciation import RuleError
from gateway.voices import VoiceRefused


def native_rules(rules: Any) -> list[dict[str, Any]]:
    """ElevenLabs rules -> voxgate rules (checked again by `gateway.text.pronunciation.check_rules`)."""
    if not isinstance(rules, list):
        raise ElevenLabsError("invalid_request", "rules must be a list", status=422)
    out = []
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict) or rule.get("type") not in ("alias", "phoneme"):
            raise ElevenLabsError("invalid_request", f"rules[{i}].type must be alias or phoneme", status=422)
        match = rule.get("string_to_replace")
        if not isinstance(match, str) or not match:
            raise ElevenLabsError("invalid_request", f"rules[{i}].string_to_replace is required", status=422)
        case, bounded = rule.get("case_sensitive", True), rule.get("word_boundaries", True)
        native: dict[str, Any] = {"word": match} if bounded is not False else {"regex": regex.escape(match)}
        native["case_sensitive"] = case is not False
        if rule["type"] == "alias":
            native["alias"] = rule.get("alias")
        elif rule.get("alphabet") != "cmu-arpabet":
            raise ElevenLabsError("invalid_request", f"rules[{i}].alphabet {rule.get('alphabet')!r}: VoxCPM reads "
                                  "CMU ARPAbet phonemes (cmu-arpabet); give IPA words as an alias", status=422)
        else:
            native["phonemes"] = rule.get("phoneme")
        out.append(native)
    return out


async def add_from_rules(request: web.Request) -> web.Response:
    """POST /v1/pronunciation-dictionaries/add-from-rules: ElevenLabs' AddPronunciationDictionaryResponseModel."""
    gw = gateway_of(request)
    try:
        try:
            key = check_api_key(gw, request.headers.get("xi-api-key"))
        except AuthError as e:
            gw.metrics.errors.labels(code=str(ErrorCode.UNAUTHORIZED)).inc()
            raise ElevenLabsError("invalid_api_key", f"Invalid API key: {e}", status=401) from None
        try:
            body = await json_body(request)
        except ValueError as e:
            raise ElevenLabsError("invalid_request", str(e), status=422) from None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise ElevenLabsError("invalid_request", "name (a string) and rules are required", status=422)
        try:
            made = await gw.pronunciations.create(gw.auth.caller(key),
                                                  {"name": body["name"], "rules": native_rules(body.get("rules"))})
        except RuleError as e:
            raise ElevenLabsError("invalid_request", str(e), status=422) from None
        except VoiceRefused as e:
            raise ElevenLabsError(e.code, e.message, status=e.status) from None
    except ElevenLabsError as e:
        return e.response()
    return web.json_response({
        "id": made["pronunciation_id"], "name": made["name"], "created_by": "voxgate",
        "creation_time_unix": int(time.time()), "version_id": made["pronunciation_id"],
        "version_rules_num": len(made["rules"]), "description": body.get("description"),
        "permission_on_resource": "admin"})


def register(app: web.Application) -> None:
    app.router.add_post("/v1/pronunciation-dictionaries/add-from-rules", add_from_rules)
