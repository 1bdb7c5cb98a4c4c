"""For gateway tests that check what reached the engine: the real engine with its `generate` calls recorded."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def recorded_calls(engine: Any) -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """While open, every `engine.generate(text, **kwargs)` is recorded as (text, kwargs) and then run as usual."""
    calls: list[tuple[str, dict[str, Any]]] = []
    real = engine.generate

    def generate(text: str, **kwargs: Any) -> Any:
        calls.append((text, kwargs))
        return real(text, **kwargs)

    engine.generate = generate
    try:
        yield calls
    finally:
        del engine.generate  # the instance attribute: back to the class's method
