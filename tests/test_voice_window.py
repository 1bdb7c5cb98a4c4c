"""A voice being created is nobody else's while its record is stored: between the engine taking it and the store
holding its record, another key resolving its id gets what an unknown id gets (not an operator's shared voice)."""

import asyncio
import io

import numpy as np
import pytest
import soundfile

from gateway.auth import Caller
from gateway.store import LocalStore
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
