"""Per-tenant limit on queued prompts: a tenant's requests that have no audio yet (waiting or prefilling).

The scheduler shares prefill fairly between tenants (`engine.fair_share`); this bound keeps one tenant from queueing
without limit meanwhile. A tenant is the caller's API key; None (or "") is the shared tenant, which has no such
limit (the engine's `max_waiting` bounds everyone).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from engine.errors import InvalidParameter, TenantOverloaded


class QueuedPrompts:
    """Requests without audio yet, counted per tenant; at most `limit` each (None: no limit)."""

    def __init__(self, limit: int | None):
        self.limit = limit  # `EngineConfig.max_queued_per_tenant`, checked there
        self.counts: Counter[str] = Counter()

    def check(self, tenant: Any) -> str | None:
        """`tenant` as requests carry it (None: shared); `TenantOverloaded` when it already has `limit` requests
        without audio."""
        if tenant is not None and not isinstance(tenant, str):
            raise InvalidParameter(f"tenant must be a string (got {type(tenant).__name__})")
        if not tenant:
            return None
        if self.limit is not None and self.counts[tenant] >= self.limit:
            raise TenantOverloaded(f"{self.limit} requests of this tenant are already waiting for their first audio")
        return tenant

    def add(self, tenant: str | None) -> None:
        """Count a new request of a `check`ed tenant (the shared one is not counted)."""
        if tenant is not None:
            self.counts[tenant] += 1

    def release(self, tenant: str) -> None:
        """A counted request of `tenant` got its first audio or ended."""
        self.counts[tenant] -= 1
        if self.counts[tenant] <= 0:
            del self.counts[tenant]
