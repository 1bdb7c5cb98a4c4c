"""The shared store for many nodes: Redis (`--store redis://host:port/db`), through redis-py's asyncio client.

Keys (all under `voxgate:`): `<kind>:<id>` a hash (`record` JSON + `blob:<name>` fields, written in one
MULTI/EXEC, so other nodes see an item whole or not at all), `<kind>s` a sorted set of ids by creation time,
`token:<t>` a single-use token (SET EX, consumed with GETDEL), `leases:<owner>` a sorted set of session leases
scored by expiry in Redis' own clock (no node's clock matters), `keys` a hash of API key -> flags."""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.store.base import Item, StoreUnavailable

PREFIX = "voxgate:"
T = TypeVar("T")

# purge expired leases, then take one if fewer than the limit are live: one script, so two nodes cannot both pass
_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 2)
return 1
"""
_REFRESH = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], expiry, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 2)
return 1
"""


class RedisStore:
    """Items, tokens, leases and (optionally) API keys in one Redis database shared by every node."""

    shared = True

    def __init__(self, url: str, timeout_s: float = 2.0):
        # short timeouts: a dead Redis must turn into a typed error quickly, not hang a handshake
        self.client = aioredis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                        health_check_interval=30)
        self.description = f"redis {url}"
        self._reserve = self.client.register_script(_RESERVE)
        self._refresh = self.client.register_script(_REFRESH)

    @staticmethod
    async def _call(op: Callable[[], Awaitable[T]]) -> T:
        try:
            return await op()
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise StoreUnavailable(f"the shared store (Redis) is unreachable: {e}") from None
        except RedisError as e:
            raise StoreUnavailable(f"the shared store (Redis) failed: {e}") from None

    # ---- items -------------------------------------------------------------------------------------------
    async def put(self, item: Item, blobs: dict[str, bytes]) -> None:
        fields: dict[str, Any] = {f"blob:{name}": data for name, data in blobs.items()}
        fields["record"] = json.dumps(item.to_json())

        async def op() -> None:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.delete(f"{PREFIX}{item.kind}:{item.id}")
                pipe.hset(f"{PREFIX}{item.kind}:{item.id}", mapping=fields)
                pipe.zadd(f"{PREFIX}{item.kind}s", {item.id: item.created})
                await pipe.execute()

        await self._call(op)

    async def get(self, kind: str, item_id: str) -> Item | None:
        raw = await self._call(lambda: self.client.hget(f"{PREFIX}{kind}:{item_id}", "record"))
        return Item.from_json(json.loads(raw)) if raw else None

    async def blobs(self, kind: str, item_id: str) -> dict[str, bytes]:
        raw = await self._call(lambda: self.client.hgetall(f"{PREFIX}{kind}:{item_id}"))
        return {k.decode().removeprefix("blob:"): v for k, v in raw.items() if k.startswith(b"blob:")}

    async def items(self, kind: str) -> list[Item]:
        async def op() -> list[Any]:
            ids = await self.client.zrange(f"{PREFIX}{kind}s", 0, -1)
            if not ids:
                return []
            async with self.client.pipeline(transaction=False) as pipe:
                for item_id in ids:
                    pipe.hget(f"{PREFIX}{kind}:{item_id.decode()}", "record")
                return await pipe.execute()

        return [Item.from_json(json.loads(raw)) for raw in await self._call(op) if raw]

    async def update(self, item: Item) -> bool:
        key = f"{PREFIX}{item.kind}:{item.id}"

        async def op() -> bool:
            # HSET XX-like: only an item that still exists gets its record replaced
            script = "if redis.call('HEXISTS', KEYS[1], 'record') == 1 then " \
                     "redis.call('HSET', KEYS[1], 'record', ARGV[1]) return 1 end return 0"
            return bool(await self.client.eval(script, 1, key, json.dumps(item.to_json())))

        return await self._call(op)

    async def delete(self, kind: str, item_id: str) -> bool:
        async def op() -> bool:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.delete(f"{PREFIX}{kind}:{item_id}")
                pipe.zrem(f"{PREFIX}{kind}s", item_id)
                removed, _ = await pipe.execute()
            return bool(removed)

        return await self._call(op)

    # ---- tokens, leases, keys ----------------------------------------------------------------------------
    async def add_token(self, token: str, key: str, ttl_s: float) -> None:
        await self._call(lambda: self.client.set(f"{PREFIX}token:{token}", key, px=max(1, math.ceil(ttl_s * 1000))))

    async def take_token(self, token: str) -> str | None:
        raw = await self._call(lambda: self.client.getdel(f"{PREFIX}token:{token}"))
        return raw.decode() if raw is not None else None

    async def reserve_lease(self, owner: str, lease: str, limit: int, ttl_s: float) -> bool:
        ttl_ms = max(1, math.ceil(ttl_s * 1000))
        return bool(await self._call(lambda: self._reserve(keys=[f"{PREFIX}leases:{owner}"],
                                                           args=[limit, ttl_ms, lease])))

    async def refresh_leases(self, leases: dict[str, list[str]], ttl_s: float) -> None:
        ttl_ms = max(1, math.ceil(ttl_s * 1000))

        async def op() -> None:
            async with self.client.pipeline(transaction=False) as pipe:
                for owner, ids in leases.items():
                    if ids:
                        await self._refresh(keys=[f"{PREFIX}leases:{owner}"], args=[ttl_ms, *ids], client=pipe)
                await pipe.execute()

        await self._call(op)

    async def release_lease(self, owner: str, lease: str) -> None:
        await self._call(lambda: self.client.zrem(f"{PREFIX}leases:{owner}", lease))

    async def api_keys(self) -> dict[str, list[str]] | None:
        raw = await self._call(lambda: self.client.hgetall(f"{PREFIX}keys"))
        return {k.decode(): v.decode().split() for k, v in raw.items()}

    async def close(self) -> None:
        await self.client.aclose()
