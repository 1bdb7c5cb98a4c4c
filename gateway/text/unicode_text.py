"""Whether what a client sent is valid Unicode text. JSON lets a lone surrogate through as an escape (`"\\ud800"`):
valid JSON, but not text, and nothing downstream can encode it (the tokenizer, a JSON reply, aiohttp's send_str, a
log line). Pure functions: `gateway.protocol.load_json` applies them to every client JSON document."""

from __future__ import annotations

from typing import Any


def is_text(s: str) -> bool:
    """No lone surrogate (the only way a Python str from JSON can fail to be text); ASCII is the common fast path."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def first_invalid(value: Any) -> str | None:
    """The path (`text`, `generation.seed`, `items[2]`) of the first string, value or key, in a JSON value that is
    not valid text ("" for the value itself, the parent's path for a key); None if all are. Iterative: JSON nested
    as deep as the parser allows is fine."""
    stack = [(value, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not is_text(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if not is_text(key):
                    return path
                stack.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
    return None
