"""Shared state for many nodes (issue 29): a real `redis-server` and two `voxgate serve` nodes on loopback with the
demo model. A voice made through node A speaks on node B (B computes its KV on first use); a token minted on A
works once on B, then fails on A; a per-key session limit holds across both nodes; keys added to Redis work without
a restart; `kill -9` of a node frees its per-key places within the lease time; with Redis stopped, voice calls get
a typed 503 and plain streams go on."""

import asyncio
import contextlib
import time

import aiohttp
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from store_support import Node, bearer, post_voice, redis_server, speak, voice_ids
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.client import ServerError, VoxgateClient

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

A, B, LIMIT, LEASE_S = "key-a", "key-b", 2, 3.0


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tiny_v2_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("cluster")
    (work / "keys").write_text(f"{A}\n{B}\n")
    async with redis_server(work) as (url, redis_proc):
        args = ("--store", url, "--api-keys-file", str(work / "keys"), "--api-keys-from-store",
                "--max-sessions-per-key", str(LIMIT), "--session-lease-ttl", str(LEASE_S))
        nodes = await asyncio.gather(Node.start(tiny_v2_dir, *args), Node.start(tiny_v2_dir, *args))
        try:
            async with aiohttp.ClientSession() as http:
                yield nodes[0], nodes[1], http, url, redis_proc
        finally:
            await asyncio.gather(*(n.kill() for n in nodes))


async def _opened(node: Node, key: str) -> VoxgateClient:
    c = await VoxgateClient.connect(f"{node.ws}/v1/stream", api_key=key)
    await c.start(output={"format": "pcm_s16le"})
    return c


async def _refused(node: Node, key: str) -> bool:
    """Whether a new session of `key` on `node` is refused for the per-key limit."""
    c = await VoxgateClient.connect(f"{node.ws}/v1/stream", api_key=key)
    try:
        await c.start(output={"format": "pcm_s16le"})
    except ServerError as e:
        assert e.code == "rate_limited"
        return True
    except ConnectionClosed as e:  # the refusal and its close came before session.start went out
        assert e.rcvd is not None and e.rcvd.reason == "rate_limited", e
        return True
    finally:
        with contextlib.suppress(ConnectionClosed):
            await c.ws.close()
    return False


async def test_a_voice_made_on_one_node_speaks_on_the_other(cluster):
    node_a, node_b, http, _, _ = cluster
    voice = await post_voice(http, node_a, A)
    assert voice in await voice_ids(http, node_b, A) and voice not in await voice_ids(http, node_b, B)
    on_b = await speak(node_b, A, "Made elsewhere", voice=voice)  # B loads it and computes its KV here
    assert on_b == await speak(node_a, A, "Made elsewhere", voice=voice)
    with pytest.raises(ServerError) as refused:
        await speak(node_b, B, "Not mine", voice=voice)
    assert refused.value.code == "unknown_voice"
    async with http.delete(f"{node_b.http}/v1/voices/{voice}", headers=bearer(A)) as r:
        assert r.status == 204
    with pytest.raises(ServerError):  # deleted through B: gone on A too
        await speak(node_a, A, "Gone", voice=voice)


async def test_a_token_is_single_use_across_nodes(cluster):
    node_a, node_b, http, _, _ = cluster
    async with http.post(f"{node_a.http}/v1/tokens", headers=bearer(A)) as r:
        token = (await r.json())["token"]
    async with await VoxgateClient.connect(f"{node_b.ws}/v1/stream", token=token) as c:
        await c.start(output={"format": "pcm_s16le"})
    with pytest.raises(InvalidStatus) as used:
        await VoxgateClient.connect(f"{node_a.ws}/v1/stream", token=token)
    assert used.value.response.status_code == 401


async def test_the_per_key_limit_holds_across_nodes(cluster):
    node_a, node_b, _, _, _ = cluster
    first, second = await _opened(node_a, A), await _opened(node_b, A)
    try:
        assert await _refused(node_a, A) and await _refused(node_b, A)
        async with await _opened(node_b, B):  # other keys are not affected
            pass
    finally:
        await first.close()
        await second.close()
    for _ in range(50):  # places are given back as sessions end
        if not await _refused(node_a, A):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("a closed session's place was not given back")


async def test_keys_added_to_redis_work_without_a_restart(cluster):
    node_a, node_b, http, url, _ = cluster
    client = aioredis.from_url(url)
    try:
        await client.hset("voxgate:keys", "key-new", "")
        for _ in range(60):
            async with http.get(f"{node_b.http}/v1/voices", headers=bearer("key-new")) as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.1)
        assert r.status == 200
        await client.hdel("voxgate:keys", "key-new")
        for _ in range(60):
            async with http.get(f"{node_b.http}/v1/voices", headers=bearer("key-new")) as r:
                if r.status == 401:
                    break
            await asyncio.sleep(0.1)
        assert r.status == 401  # revoked
    finally:
        await client.aclose()


async def test_kill_9_frees_the_nodes_places_within_the_lease_time(cluster):
    node_a, node_b, _, _, _ = cluster
    held = [await _opened(node_a, A) for _ in range(LIMIT)]
    assert await _refused(node_b, A)
    await node_a.kill()
    killed = time.monotonic()
    while await _refused(node_b, A):
        assert time.monotonic() - killed < LEASE_S + 2, "a dead node's places outlived the lease time"
        await asyncio.sleep(0.2)
    for c in held:
        await c.ws.close()


async def test_with_redis_stopped_voice_calls_are_503_and_streams_go_on(cluster):
    _, node_b, http, _, redis_proc = cluster
    redis_proc.kill()
    await redis_proc.wait()
    for method, path in (("GET", "/v1/voices"), ("GET", "/v1/loras"), ("POST", "/v1/tokens")):
        async with http.request(method, f"{node_b.http}{path}", headers=bearer(A)) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "store_unavailable", path
    async with http.post(f"{node_b.http}/v1/voices", data=b"RIFF", headers=bearer(A)) as r:
        assert r.status in (400, 503)  # unreadable audio is refused before the store is needed
    with pytest.raises(ServerError) as refused:
        await speak(node_b, A, "Stored voice", voice="abc123")
    assert refused.value.code == "store_unavailable"
    assert await speak(node_b, A, "Plain streams need no store")
