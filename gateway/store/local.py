"""The embedded store: items in a data directory (or in memory), tokens and leases in this process.

Layout: `<data_dir>/<kind>/<digest>/` holds `item.json` and one file per blob. An item is written whole in a
fresh folder under `<data_dir>/tmp/` (every file fsynced), then renamed into place and the parent fsynced: a crash
leaves it whole or absent. Leftovers in `tmp/` (a crash mid-write) are removed at start."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

from gateway.store.base import Item

log = logging.getLogger("voxgate.store")

RECORD = "item.json"
DEFAULT_DATA_DIR = Path("~/.local/share/voxgate").expanduser()  # `voxgate serve --data-dir`


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class LocalStore:
    """Items in `data_dir` (None: in memory, gone with the process); tokens and leases in this process, which is
    exact for one node."""

    shared = False

    def __init__(self, data_dir: str | Path | None = None):
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.description = str(self.data_dir) if self.data_dir is not None else "memory (not kept across restarts)"
        self._memory: dict[tuple[str, str], tuple[Item, dict[str, bytes]]] = {}
        self._tokens: dict[str, tuple[float, str]] = {}  # token -> (expiry, key)
        self._leases: dict[str, dict[str, float]] = {}  # owner -> {lease: expiry}
        if self.data_dir is not None:
            self._prepare()

    def _prepare(self) -> None:
        assert self.data_dir is not None
        self.data_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.data_dir / "tmp"
        if tmp.exists():
            leftovers = list(tmp.iterdir())
            if leftovers:
                log.warning("removing %d unfinished write(s) from %s (a crash mid-upload)", len(leftovers), tmp)
            shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(exist_ok=True)  # a second server started at the same moment on the same directory did it too
        _fsync_dir(self.data_dir)

    def _dir(self, kind: str, item_id: str) -> Path:
        assert self.data_dir is not None
        # ids are client-chosen for adapters: a digest keeps every id a safe folder name
        return self.data_dir / kind / hashlib.sha256(item_id.encode()).hexdigest()[:32]

    # ---- items -------------------------------------------------------------------------------------------
    async def put(self, item: Item, blobs: dict[str, bytes]) -> None:
        if self.data_dir is None:
            self._memory[(item.kind, item.id)] = (item, dict(blobs))
            return
        await asyncio.to_thread(self._put, item, blobs)

    def _put(self, item: Item, blobs: dict[str, bytes]) -> None:
        assert self.data_dir is not None
        staging = self.data_dir / "tmp" / uuid.uuid4().hex
        staging.mkdir()
        for name, data in blobs.items():
            _write_file(staging / f"blob-{name}", data)
        _write_file(staging / RECORD, json.dumps(item.to_json()).encode())
        _fsync_dir(staging)
        target = self._dir(item.kind, item.id)
        if not target.parent.is_dir():
            target.parent.mkdir()
            _fsync_dir(self.data_dir)  # the new kind folder's own entry is durable too
        if target.exists():  # a re-upload under the same id replaces the old one
            self._remove(target)
        os.rename(staging, target)
        _fsync_dir(target.parent)

    async def get(self, kind: str, item_id: str) -> Item | None:
        if self.data_dir is None:
            entry = self._memory.get((kind, item_id))
            return entry[0] if entry else None
        return await asyncio.to_thread(self._read, self._dir(kind, item_id))

    def _read(self, folder: Path) -> Item | None:
        try:
            return Item.from_json(json.loads((folder / RECORD).read_bytes()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("skipping %s: unreadable record (%s)", folder, e)
            return None

    async def blobs(self, kind: str, item_id: str) -> dict[str, bytes]:
        if self.data_dir is None:
            entry = self._memory.get((kind, item_id))
            return dict(entry[1]) if entry else {}
        return await asyncio.to_thread(self._blobs, self._dir(kind, item_id))

    @staticmethod
    def _blobs(folder: Path) -> dict[str, bytes]:
        if not folder.is_dir():
            return {}
        return {p.name.removeprefix("blob-"): p.read_bytes() for p in folder.iterdir() if p.name.startswith("blob-")}

    async def items(self, kind: str) -> list[Item]:
        if self.data_dir is None:
            found = [item for (k, _), (item, _) in self._memory.items() if k == kind]
        else:
            found = await asyncio.to_thread(self._items, kind)
        return sorted(found, key=lambda item: item.created)

    def _items(self, kind: str) -> list[Item]:
        assert self.data_dir is not None
        folder = self.data_dir / kind
        if not folder.is_dir():
            return []
        return [item for sub in folder.iterdir() if (item := self._read(sub)) is not None]

    async def update(self, item: Item) -> bool:
        if self.data_dir is None:
            entry = self._memory.get((item.kind, item.id))
            if entry is None:
                return False
            self._memory[(item.kind, item.id)] = (item, entry[1])
            return True
        return await asyncio.to_thread(self._update, item)

    def _update(self, item: Item) -> bool:
        folder = self._dir(item.kind, item.id)
        if not (folder / RECORD).exists():
            return False
        staged = folder / f"{RECORD}.{uuid.uuid4().hex}"
        _write_file(staged, json.dumps(item.to_json()).encode())
        os.replace(staged, folder / RECORD)
        _fsync_dir(folder)
        return True

    async def delete(self, kind: str, item_id: str) -> bool:
        if self.data_dir is None:
            return self._memory.pop((kind, item_id), None) is not None
        return await asyncio.to_thread(self._delete, self._dir(kind, item_id))

    def _delete(self, folder: Path) -> bool:
        if not folder.exists():
            return False
        self._remove(folder)
        return True

    def _remove(self, folder: Path) -> None:
        """Out of sight in one rename (a crash cannot leave half an item listed), then removed."""
        assert self.data_dir is not None
        trash = self.data_dir / "tmp" / f"deleted-{uuid.uuid4().hex}"
        os.rename(folder, trash)
        _fsync_dir(folder.parent)
        shutil.rmtree(trash, ignore_errors=True)

    # ---- tokens and leases (this process) -------------------------------------------------------------------
    async def add_token(self, token: str, key: str, ttl_s: float) -> None:
        now = time.monotonic()
        for t in [t for t, (expiry, _) in self._tokens.items() if expiry < now]:
            del self._tokens[t]
        self._tokens[token] = (now + ttl_s, key)

    async def take_token(self, token: str) -> str | None:
        entry = self._tokens.pop(token, None)
        if entry is None or time.monotonic() > entry[0]:
            return None
        return entry[1]

    async def reserve_lease(self, owner: str, lease: str, limit: int, ttl_s: float) -> bool:
        now = time.monotonic()
        live = {k: v for k, v in self._leases.get(owner, {}).items() if v > now}
        if len(live) >= limit:
            self._leases[owner] = live
            return False
        live[lease] = now + ttl_s
        self._leases[owner] = live
        return True

    async def refresh_leases(self, leases: dict[str, list[str]], ttl_s: float) -> None:
        expiry = time.monotonic() + ttl_s
        for owner, ids in leases.items():
            held = self._leases.setdefault(owner, {})
            held.update(dict.fromkeys(ids, expiry))

    async def release_lease(self, owner: str, lease: str) -> None:
        held = self._leases.get(owner)
        if held is not None:
            held.pop(lease, None)
            if not held:
                del self._leases[owner]

    async def api_keys(self) -> dict[str, list[str]] | None:
        return None

    async def close(self) -> None:
        return None
