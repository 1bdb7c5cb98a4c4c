"""The store interface: what users store (voices, LoRA adapters) and what nodes share (single-use tokens, per-key
session leases, optionally API keys). Two implementations: `LocalStore` (a data directory, or memory) and
`RedisStore` (many nodes)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


class StoreUnavailable(Exception):
    """The store cannot be reached now (Redis down); the operation that needs it fails with a typed error."""


@dataclass
class Item:
    """A stored voice or adapter: who owns it, whether every key may use it, and what rebuilds it (`meta`, plus
    blobs kept beside it)."""

    kind: str  # "voice", "lora" or "pronunciation"
    id: str  # a voice id, or an adapter's engine name (its owner's namespace + its name)
    owner: str  # the owning key's tenant id ("" when the server has no API keys: shared by all)
    public: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0  # wall-clock seconds: listings are oldest first

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Item:
        return cls(kind=str(data["kind"]), id=str(data["id"]), owner=str(data["owner"]),
                   public=bool(data.get("public", False)), meta=dict(data.get("meta") or {}),
                   created=float(data.get("created", 0.0)))


class Store(Protocol):
    """One small interface over the local and the Redis store. Every method may raise StoreUnavailable."""

    shared: bool  # True: other nodes write it too (state is read through, engine copies are made on first use)
    description: str  # where it is, for the start-up line

    async def put(self, item: Item, blobs: dict[str, bytes]) -> None:
        """Store an item and its blobs atomically: after a crash it is there whole, or not at all."""

    async def get(self, kind: str, item_id: str) -> Item | None:
        """The item's record, or None."""

    async def blobs(self, kind: str, item_id: str) -> dict[str, bytes]:
        """The item's blobs ({} if it is gone)."""

    async def items(self, kind: str) -> list[Item]:
        """Every item of a kind, oldest first."""

    async def update(self, item: Item) -> bool:
        """Replace an existing item's record (not its blobs); False if it is gone."""

    async def delete(self, kind: str, item_id: str) -> bool:
        """Remove an item and its blobs; False if there was none."""

    async def add_token(self, token: str, key: str, ttl_s: float) -> None:
        """Remember a single-use token for `key` for ttl_s seconds."""

    async def take_token(self, token: str) -> str | None:
        """The key of an unexpired token, consumed atomically (a second take, on any node, gets None)."""

    async def reserve_lease(self, owner: str, lease: str, limit: int, ttl_s: float) -> bool:
        """Take a session lease for `owner` if it holds fewer than `limit` live ones (atomic); it lives ttl_s unless
        refreshed."""

    async def refresh_leases(self, leases: dict[str, list[str]], ttl_s: float) -> None:
        """Extend these leases ({owner: [lease, ...]}) by ttl_s from now."""

    async def release_lease(self, owner: str, lease: str) -> None:
        """Give a lease back."""

    async def api_keys(self) -> dict[str, list[str]] | None:
        """API keys kept in the store ({key: [flag, ...]}), or None if this store keeps none."""

    async def close(self) -> None:
        """Release connections and files."""
