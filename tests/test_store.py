"""The store interface, the same checks on each implementation: the local data directory, memory, and a real
redis-server (started here; missing, the test fails and says how to install it)."""

import asyncio

import pytest
import pytest_asyncio
from store_support import redis_server

from gateway.store import Item, LocalStore, StoreUnavailable, open_store

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def redis_url(tmp_path_factory):
    async with redis_server(tmp_path_factory.mktemp("redis")) as (url, _):
        yield url


@pytest_asyncio.fixture(loop_scope="module", params=["dir", "memory", "redis"])
async def store(request, tmp_path, redis_url):
    s = {"dir": lambda: LocalStore(tmp_path / "data"), "memory": lambda: LocalStore(),
         "redis": lambda: open_store(redis_url, None)}[request.param]()
    if request.param == "redis":
        await s.client.flushdb()
    yield s
    await s.close()


async def test_items_round_trip_with_their_blobs(store):
    first = Item("voice", "v1", "tenant-a", meta={"text": "hi"}, created=1.0)
    second = Item("voice", "v2", "", public=True, created=2.0)
    await store.put(second, {})
    await store.put(first, {"latents": b"\x00\x01" * 1000})
    assert [i.id for i in await store.items("voice")] == ["v1", "v2"]  # oldest first
    assert await store.get("voice", "v1") == first and await store.get("lora", "v1") is None
    assert await store.blobs("voice", "v1") == {"latents": b"\x00\x01" * 1000}
    first.public = True
    assert await store.update(first) and (await store.get("voice", "v1")).public
    assert await store.delete("voice", "v1") and not await store.delete("voice", "v1")
    assert not await store.update(first)  # gone: not brought back
    assert await store.get("voice", "v1") is None and await store.blobs("voice", "v1") == {}
    assert [i.id for i in await store.items("voice")] == ["v2"]


async def test_tokens_are_single_use_and_expire(store):
    await store.add_token("t1", "key", 30)
    await store.add_token("t2", "key", 0.05)
    assert await store.take_token("t1") == "key"
    assert await store.take_token("t1") is None
    await asyncio.sleep(0.15)
    assert await store.take_token("t2") is None


async def test_leases_hold_the_limit_expire_and_refresh(store):
    assert await store.reserve_lease("t", "l1", 2, 0.3) and await store.reserve_lease("t", "l2", 2, 0.3)
    assert not await store.reserve_lease("t", "l3", 2, 0.3)
    assert await store.reserve_lease("other", "l4", 2, 0.3)  # per tenant
    await store.release_lease("t", "l1")
    assert await store.reserve_lease("t", "l3", 2, 0.3)
    await store.refresh_leases({"t": ["l2"]}, 5.0)
    await asyncio.sleep(0.45)  # l3 expired, l2 was refreshed
    assert await store.reserve_lease("t", "l5", 2, 0.3)
    assert not await store.reserve_lease("t", "l6", 2, 0.3)


async def test_an_unreachable_redis_is_a_typed_error():
    from gateway.store.redis_store import RedisStore

    store = RedisStore("redis://127.0.0.1:9/0", timeout_s=0.5)
    try:
        for call in (store.get("voice", "x"), store.take_token("x"), store.reserve_lease("t", "l", 1, 1.0)):
            with pytest.raises(StoreUnavailable):
                await call
    finally:
        await store.close()
