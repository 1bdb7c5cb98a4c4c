"""The node's session limit across gateway fronts, in one process: two applications over one engine and one store
stand for two fronts (`ServerConfig.node_lease_owner`, as `gateway.fronts` sets it). A session refused for its key
gives its node place back at once."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from gateway.auth import Auth
from gateway.client import VoxgateClient
from gateway.server import ServerConfig, create_app, start_server
from gateway.store.local import LocalStore

pytestmark = pytest.mark.asyncio(loop_scope="module")

NODE_LIMIT = 3


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fronts(engine) -> AsyncIterator[list[str]]:
    store = LocalStore(None)
    config = ServerConfig(web_client_dir=None, max_sessions=NODE_LIMIT, max_sessions_per_key=1,
                          node_lease_owner="voxgate-node:test")
    runners, urls = [], []
    for _ in range(2):
        app = create_app(engine, config, auth=Auth(["a", "b", "c", "d"]), store=store)
        runner, port = await start_server(app)
        runners.append(runner)
        urls.append(f"ws://127.0.0.1:{port}/v1/stream")
    yield urls
    for runner in runners:
        await runner.cleanup()


async def _refused(url: str, key: str) -> str:
    async with await VoxgateClient.connect(url, api_key=key) as client:
        return (await client.expect("error", timeout=10))["code"]


async def test_the_node_limit_holds_across_fronts_and_key_refusals_keep_no_node_place(fronts):
    first, second = fronts
    opened = [await VoxgateClient.connect(first, api_key="a")]
    try:
        await opened[0].start(output={"format": "pcm_s16le"})
        for url in (first, second, first, second):  # over the key's limit: each takes and gives back a node place
            assert await _refused(url, "a") == "rate_limited"
        for url, key in ((second, "b"), (second, "c")):  # so the node still has room for two more
            client = await VoxgateClient.connect(url, api_key=key)
            opened.append(client)
            await client.start(output={"format": "pcm_s16le"})
        # three sessions on the node, at most two on a front: the node's count refuses on either front
        assert await _refused(first, "d") == "overloaded"
        assert await _refused(second, "d") == "overloaded"
        assert (await opened[1].speak("Still served.", "s")).done["audio_ms"] > 0
    finally:
        for client in opened:
            await client.close()
