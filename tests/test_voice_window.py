"""A voice being created is nobody else's while its record is stored: between the engine taking it and the store
holding its record, another key resolving its id gets what an unknown id gets (not an operator's shared voice). In
one process (the catalog's own bookkeeping) and across gateway fronts over one engine host (the host keeps the voice
its creator front's until the record is stored; a voice whose creator went away first leaves the engine)."""

import asyncio
import contextlib
import io
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
import soundfile

from gateway.auth import Caller
from gateway.link import EngineHost, FrontLink, HostLost, connect
from gateway.link.host import STATUS_S
from gateway.store import LocalStore, StoreUnavailable
from gateway.voices import Catalog

pytestmark = pytest.mark.asyncio(loop_scope="module")


class SlowStore(LocalStore):
    """A local store whose `put` waits until released: the window stays open for the test."""

    def __init__(self) -> None:
        super().__init__()
        self.putting, self.release = asyncio.Event(), asyncio.Event()

    async def put(self, item, blobs) -> None:
        self.putting.set()
        await self.release.wait()
        await super().put(item, blobs)


class FlakyStore(LocalStore):
    """A local store that, once armed, cannot be reached for the one `get` after each `blobs`: the host's record
    check while a front loads a stored voice."""

    def __init__(self) -> None:
        super().__init__()
        self.armed, self._fail_next_get = False, False

    async def blobs(self, kind, item_id):
        self._fail_next_get = self.armed
        return await super().blobs(kind, item_id)

    async def get(self, kind, item_id):
        if self._fail_next_get:
            self._fail_next_get = False
            raise StoreUnavailable("unreachable for this test")
        return await super().get(kind, item_id)


def _wav(seconds: float = 0.5, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


async def test_a_voice_is_not_another_keys_while_its_record_is_stored(engine):
    store = SlowStore()
    catalog = Catalog(engine, store)
    owner, other = Caller("key-a", "tenant-a"), Caller("key-b", "tenant-b")
    before = {v.voice_id for v in engine.list_voices()}
    creating = asyncio.create_task(catalog.create_voice(owner, audio=_wav(), text="A short sample."))
    await asyncio.wait_for(store.putting.wait(), 30)
    (voice_id,) = {v.voice_id for v in engine.list_voices()} - before  # in the engine, its record not yet stored
    assert await catalog.resolve(voice_id, other) is None
    assert voice_id not in {v["voice_id"] for v in await catalog.list_voices(other)}
    store.release.set()
    view = await creating
    assert view["voice_id"] == voice_id
    assert await catalog.resolve(voice_id, owner) == voice_id
    assert await catalog.resolve(voice_id, other) is None  # stored: private to its owner
    await catalog.delete_voice(owner, voice_id)
    assert voice_id not in {v.voice_id for v in engine.list_voices()}


@contextlib.asynccontextmanager
async def _fronts(engine, store: LocalStore, socket_dir, count: int) -> AsyncIterator[list[FrontLink]]:
    """`count` front links (real, over a unix socket) to a host serving `engine` and `store`."""
    host = EngineHost(engine, store, socket_dir / "host.sock")
    await host.start()
    links = [await connect(host.path, n) for n in range(count)]
    try:
        yield links
    finally:
        for link in links:
            await link.close()  # (again for one a test closed: a no-op)
        await host.close()


def _ids(voices) -> set[str]:
    return {v.voice_id for v in voices}


async def test_across_fronts_a_voice_is_its_creator_fronts_until_its_record_is_stored(engine, tmp_path_factory):
    store = SlowStore()
    async with _fronts(engine, store, tmp_path_factory.mktemp("w"), 2) as (one, two):
        creator, elsewhere = Catalog(one.engine, one.store), Catalog(two.engine, two.store)
        owner, same_tenant, other = Caller("key-a", "tenant-a"), Caller("key-a2", "tenant-a"), Caller("key-b", "b")
        operator = Caller("op", "", operator=True)
        before = _ids(engine.list_voices())
        creating = asyncio.create_task(creator.create_voice(owner, audio=_wav(), text="A short sample."))
        await asyncio.wait_for(store.putting.wait(), 30)
        (voice_id,) = _ids(engine.list_voices()) - before  # in the engine, its record not yet stored
        await asyncio.sleep(3 * STATUS_S)  # the host's periodic pushes have run too
        for caller in (other, operator, same_tenant):  # on the other front: what an unknown id gets
            assert await elsewhere.resolve(voice_id, caller) is None
            assert voice_id not in {v["voice_id"] for v in await elsewhere.list_voices(caller)}
        assert voice_id not in _ids(two.engine.list_voices())  # not even in its mirror: it cannot speak it
        assert voice_id in _ids(one.engine.list_voices())  # its creator's front has it (it reads it back)
        assert await creator.resolve(voice_id, other) is None
        store.release.set()
        view = await creating
        assert view["voice_id"] == voice_id
        # stored: every front has it, and its record says who may use it
        assert voice_id in _ids(two.engine.list_voices())
        assert await elsewhere.resolve(voice_id, same_tenant) == voice_id
        assert await elsewhere.resolve(voice_id, other) is None
        assert await creator.resolve(voice_id, owner) == voice_id
        await creator.delete_voice(owner, voice_id)
    assert voice_id not in _ids(engine.list_voices())


async def test_a_voice_whose_creator_front_goes_away_before_storing_it_leaves_the_engine(engine, tmp_path_factory):
    store = SlowStore()
    async with _fronts(engine, store, tmp_path_factory.mktemp("w"), 2) as (one, two):
        before = _ids(engine.list_voices())
        creating = asyncio.create_task(
            Catalog(one.engine, one.store).create_voice(Caller("key-a", "tenant-a"), audio=_wav(), text="Gone."))
        await asyncio.wait_for(store.putting.wait(), 30)
        (voice_id,) = _ids(engine.list_voices()) - before
        await one.close()  # its front goes away while the record is being stored
        with pytest.raises(HostLost):
            await creating
        deadline = time.monotonic() + 10
        while voice_id in _ids(engine.list_voices()):
            assert time.monotonic() < deadline, "the abandoned voice stayed in the engine"
            await asyncio.sleep(0.05)
        elsewhere = Catalog(two.engine, two.store)
        assert await elsewhere.resolve(voice_id, Caller("key-b", "tenant-b")) is None
        assert voice_id not in _ids(two.engine.list_voices())
        store.release.set()  # the put that was under way lands: the voice is its owner's, loaded on first use
        await asyncio.sleep(3 * STATUS_S)
        assert await elsewhere.resolve(voice_id, Caller("key-a2", "tenant-a")) == voice_id
        assert await elsewhere.resolve(voice_id, Caller("key-b", "tenant-b")) is None
        await elsewhere.delete_voice(Caller("key-a2", "tenant-a"), voice_id)
    assert voice_id not in _ids(engine.list_voices())


async def test_a_stored_voice_loaded_while_the_store_cannot_say_is_every_fronts_once_another_front_loads_it(
        engine, tmp_path_factory):
    store = FlakyStore()
    owner, same_tenant = Caller("key-a", "tenant-a"), Caller("key-a2", "tenant-a")
    async with _fronts(engine, store, tmp_path_factory.mktemp("w"), 2) as (one, two):
        voice_id = (await Catalog(one.engine, one.store).create_voice(owner, audio=_wav(), text="Stored."))["voice_id"]
        await engine.remove_voice(voice_id)  # as on a node that has not loaded it yet
        store.armed = True
        assert await Catalog(one.engine, one.store).resolve(voice_id, owner) == voice_id  # loaded: no record seen
        assert voice_id in _ids(one.engine.list_voices())
        await asyncio.sleep(3 * STATUS_S)
        assert voice_id not in _ids(two.engine.list_voices())  # the host counts it as being created there
        elsewhere = Catalog(two.engine, two.store)
        assert await elsewhere.resolve(voice_id, same_tenant) == voice_id  # it read the record: every front's now
        assert voice_id in _ids(two.engine.list_voices())
        store.armed = False
        await elsewhere.delete_voice(owner, voice_id)
    assert voice_id not in _ids(engine.list_voices())
