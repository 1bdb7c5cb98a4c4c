"""`HostStore`: the host's store (`gateway.store.base.Store`) as a front process sees it, each call run at the host.

Every front writes the same store, so it is `shared`: a front's voice catalog reads items through and loads them
into the (one) engine on first use, and tokens and leases are atomic across fronts because one store holds them.
`StoreUnavailable` and the other errors come back as themselves."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gateway.store.base import Item


class HostStore:
    """`Store` over the link: each method is the host store's, called there."""

    shared = True

    def __init__(self, call: Callable[..., Awaitable[Any]], description: str):
        self._call = call
        self.description = f"{description} (through the engine host)"

    async def put(self, item: Item, blobs: dict[str, bytes]) -> None:
        await self._call("store", "put", item, blobs)

    async def get(self, kind: str, item_id: str) -> Item | None:
        return await self._call("store", "get", kind, item_id)

    async def blobs(self, kind: str, item_id: str) -> dict[str, bytes]:
        return await self._call("store", "blobs", kind, item_id)

    async def items(self, kind: str) -> list[Item]:
        return await self._call("store", "items", kind)

    async def update(self, item: Item) -> bool:
        return await self._call("store", "update", item)

    async def delete(self, kind: str, item_id: str) -> bool:
        return await self._call("store", "delete", kind, item_id)

    async def add_token(self, token: str, key: str, ttl_s: float) -> None:
        await self._call("store", "add_token", token, key, ttl_s)

    async def take_token(self, token: str) -> str | None:
        return await self._call("store", "take_token", token)

    async def reserve_lease(self, owner: str, lease: str, limit: int, ttl_s: float) -> bool:
        return await self._call("store", "reserve_lease", owner, lease, limit, ttl_s)

    async def refresh_leases(self, leases: dict[str, list[str]], ttl_s: float) -> None:
        await self._call("store", "refresh_leases", leases, ttl_s)

    async def release_lease(self, owner: str, lease: str) -> None:
        await self._call("store", "release_lease", owner, lease)

    async def api_keys(self) -> dict[str, list[str]] | None:
        return await self._call("store", "api_keys")

    async def close(self) -> None:
        """Nothing to release here: the host owns the store (the link closes with `FrontLink.close`)."""
