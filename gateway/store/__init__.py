"""Where stored voices, adapters, tokens and leases live: `open_store` picks the implementation."""

from __future__ import annotations

from pathlib import Path

from gateway.store.base import Item, Store, StoreUnavailable
from gateway.store.local import LocalStore


def open_store(url: str | None, data_dir: str | Path | None) -> Store:
    """`redis://...` (or `rediss://`, `unix://`): the shared Redis store; otherwise the local store in `data_dir`
    (None: in memory)."""
    if url:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--store {url!r}: expected redis://host:port/db")
        from gateway.store.redis_store import RedisStore

        return RedisStore(url)
    return LocalStore(data_dir)


__all__ = ["Item", "LocalStore", "Store", "StoreUnavailable", "open_store"]
