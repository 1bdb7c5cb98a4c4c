"""One value per event loop: made on the running loop's first use, gone with the loop (a weak reference to it).

What runs per turn or per chunk keeps its per-loop state here (the loop's switches, its lane, its current delivery):
the gateway's processes run one loop each, and tests run many loops one after another, each with its own state.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class LoopLocal(Generic[T]):
    """`make(loop)`'s value for the running loop; `get()` makes it on the loop's first call."""

    __slots__ = ("_make", "_of_loop")

    def __init__(self, make: Callable[[asyncio.AbstractEventLoop], T]):
        self._make = make
        self._of_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, T] = weakref.WeakKeyDictionary()

    def get(self) -> T:
        loop = asyncio.get_running_loop()
        found = self._of_loop.get(loop)
        if found is None:
            found = self._of_loop[loop] = self._make(loop)
        return found
