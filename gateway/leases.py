"""Per-key session limits as leases in the store: a node takes one lease per session, refreshes the leases of its
sessions every third of the lease time and gives them back when they end; a node that dies stops refreshing, so
its leases expire within the lease time and its keys' places come back on every other node."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from gateway.store import Store, StoreUnavailable

log = logging.getLogger("voxgate.leases")

DEFAULT_LEASE_TTL_S = 15.0  # a dead node's per-key session places come back within this


class Leases:
    """Reserve (atomically, against the limit) when a session is admitted, `claim` when it is counted, `release`
    when it ends. With the store unreachable, sessions are admitted by this node's own count (logged): streams do
    not depend on the store."""

    def __init__(self, store: Store, ttl_s: float = DEFAULT_LEASE_TTL_S):
        self.store, self.ttl_s = store, ttl_s
        self._reserved: dict[str, list[tuple[str, float]]] = {}  # tenant -> [(lease, when)] not yet claimed
        self._held: dict[str, str] = {}  # lease -> tenant
        self._tasks: set[asyncio.Task] = set()
        self._store_down = False

    def count(self, tenant: str) -> int:
        """Leases this node holds or has reserved for a tenant."""
        return sum(1 for t in self._held.values() if t == tenant) + len(self._reserved.get(tenant, ()))

    async def reserve(self, tenant: str, limit: int) -> bool:
        """Take a place for a new session of `tenant` if it has fewer than `limit` across every node."""
        lease = uuid.uuid4().hex
        try:
            ok = await self.store.reserve_lease(tenant, lease, limit, self.ttl_s)
            self._up()
        except StoreUnavailable as e:
            self._down(e)
            ok = self.count(tenant) < limit
        if ok:
            self._reserved.setdefault(tenant, []).append((lease, time.monotonic()))
        return ok

    def claim(self, tenant: str) -> str | None:
        """The session being counted now takes a reserved place (None if none was reserved)."""
        reserved = self._reserved.get(tenant)
        if not reserved:
            return None
        lease, _ = reserved.pop()  # the newest: the handshake that reserved it is usually the one counted now
        if not reserved:
            del self._reserved[tenant]
        self._held[lease] = tenant
        return lease

    def unreserve(self, tenant: str) -> None:
        """Give back the newest unclaimed place of `tenant` (its session was refused for another reason)."""
        reserved = self._reserved.get(tenant)
        if not reserved:
            return
        lease, _ = reserved.pop()
        if not reserved:
            del self._reserved[tenant]
        self._background(self._give_back(tenant, lease))

    def release(self, lease: str | None) -> None:
        """The session ended: its place is given back (in the background)."""
        tenant = self._held.pop(lease, None) if lease is not None else None
        if tenant is not None:
            self._background(self._give_back(tenant, lease))

    async def _give_back(self, tenant: str, lease: str) -> None:
        with contextlib.suppress(StoreUnavailable):  # unreachable: the lease expires by itself
            await self.store.release_lease(tenant, lease)

    def _background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def keep_fresh(self) -> None:
        """Refresh held leases every ttl/3 and drop reservations no session took within the lease time (a handshake
        that failed after its admission; the store lets them expire by then), until cancelled."""
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            now = time.monotonic()
            for tenant, reserved in list(self._reserved.items()):
                stale = [lease for lease, when in reserved if now - when > self.ttl_s]
                self._reserved[tenant] = [(lease, when) for lease, when in reserved if lease not in stale]
                if not self._reserved[tenant]:
                    del self._reserved[tenant]
                for lease in stale:
                    await self._give_back(tenant, lease)
            by_tenant: dict[str, list[str]] = {}
            for lease, tenant in self._held.items():
                by_tenant.setdefault(tenant, []).append(lease)
            if not by_tenant:
                continue
            try:
                await self.store.refresh_leases(by_tenant, self.ttl_s)
                self._up()
            except StoreUnavailable as e:
                self._down(e)

    def _down(self, e: StoreUnavailable) -> None:
        if not self._store_down:
            log.warning("per-key session limits fall back to this node's own count: %s", e)
        self._store_down = True

    def _up(self) -> None:
        if self._store_down:
            log.warning("per-key session limits are shared through the store again")
        self._store_down = False

    async def close(self) -> None:
        """Give back every lease this node holds (a clean stop)."""
        held, self._held = self._held, {}
        for lease, tenant in held.items():
            await self._give_back(tenant, lease)
        await asyncio.gather(*self._tasks, return_exceptions=True)
