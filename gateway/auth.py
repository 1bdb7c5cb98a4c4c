"""API keys for servers, short-lived single-use tokens for browsers (which cannot set headers on a WebSocket).

A key may carry flags: `operator` (may share voices and adapters with every key, and sees and manages all of
them) and `strict` (an unknown voice id is a not-found error on every protocol instead of the default voice).
In a keys file they follow the key on its line: `sk-123 operator strict`."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from gateway.store import LocalStore, Store, StoreUnavailable

log = logging.getLogger("voxgate.auth")

KEY_FLAGS = ("operator", "strict")
ANONYMOUS = "anonymous"  # the identity of every caller when no keys are configured


class AuthError(Exception):
    """Authentication failed; the message says why (no secret in it)."""


@dataclass(frozen=True)
class Caller:
    """Who makes a request: the identity counted by limits, the tenant that owns what it stores, its flags."""

    key: str
    tenant: str  # "" when the server has no keys: everything is shared
    operator: bool = False
    strict: bool = False


def tenant_of(key: str) -> str:
    """The tenant id a key's voices and adapters are stored under (a digest: the store never holds the key)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _flags(key: str, flags: Iterable[str], where: str) -> frozenset[str]:
    flags = frozenset(flags)
    unknown = sorted(flags - set(KEY_FLAGS))
    if unknown:
        raise ValueError(f"{where}: unknown flag(s) {unknown} for a key (known: {', '.join(KEY_FLAGS)})")
    return flags


class Auth:
    """With no keys configured every request is allowed (a local or trusted-network deployment). Tokens live in the
    store (so one minted on any node is single-use on all of them); with `keys_from_store` the store's keys are
    read again every `refresh_s`, so keys are added and revoked without a restart."""

    def __init__(self, api_keys: Iterable[str] | dict[str, Iterable[str]] | None = None, token_ttl_s: float = 60.0,
                 clock: Callable[[], float] = time.time, *, keys_from_store: bool = False, refresh_s: float = 2.0):
        keys = api_keys if isinstance(api_keys, dict) else dict.fromkeys(api_keys or (), ())
        self._file_keys = {k: _flags(k, f, "api keys") for k, f in keys.items()}
        self.api_keys: dict[str, frozenset[str]] = dict(self._file_keys)
        self.keys_from_store = keys_from_store
        self.token_ttl_s = token_ttl_s
        self.refresh_s = refresh_s
        self.clock = clock
        self.store: Store = LocalStore()

    @classmethod
    def from_options(cls, api_keys_file: str | None, keys_from_store: bool) -> Auth:
        """As `voxgate serve` (and each of its fronts) takes its keys: `--api-keys-file` (OSError / ValueError when it
        cannot be read), else none but the store's, if asked."""
        if api_keys_file:
            return cls.from_file(api_keys_file, keys_from_store=keys_from_store)
        return cls(keys_from_store=keys_from_store)

    @classmethod
    def from_file(cls, path: str | Path, **kwargs) -> Auth:
        """One key per line, optionally followed by flags (`operator`, `strict`); blank lines and lines starting
        with # are skipped."""
        keys: dict[str, list[str]] = {}
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            words = line.split()
            if words and not words[0].startswith("#"):
                _flags(words[0], words[1:], f"{path}:{n}")
                keys[words[0]] = words[1:]
        if not keys:
            raise ValueError(f"{path}: no API keys in the file")
        return cls(keys, **kwargs)

    def bind(self, store: Store) -> None:
        """Keep tokens (and, with keys_from_store, keys) in this store."""
        self.store = store

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys) or self.keys_from_store

    def caller(self, key: str) -> Caller:
        """Who an authenticated key is (the anonymous caller when keys are off)."""
        if not self.enabled:
            return Caller(ANONYMOUS, "")
        flags = self.api_keys.get(key, frozenset())
        return Caller(key, tenant_of(key), "operator" in flags, "strict" in flags)

    def check_key(self, authorization: str | None) -> str:
        """The key from an `Authorization: Bearer <key>` header; AuthError if missing or unknown."""
        if not self.enabled:
            return ANONYMOUS
        if not authorization:
            raise AuthError("missing Authorization: Bearer <api key>")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise AuthError("the Authorization header must be 'Bearer <api key>'")
        # constant-time comparison against every key: no timing hint about which prefix matched
        # surrogateescape: aiohttp decodes header bytes that are not UTF-8 to lone surrogates
        given = key.encode("utf-8", "surrogateescape")
        if not any(hmac.compare_digest(given, k.encode()) for k in self.api_keys):
            raise AuthError("invalid API key")
        return key

    def accepts(self, authorization: str | None) -> bool:
        """Whether an `Authorization: Bearer <key>` header carries one of the keys (check_key without the error)."""
        try:
            self.check_key(authorization)
        except AuthError:
            return False
        return True

    async def issue_token(self, key: str) -> tuple[str, float]:
        """A single-use token for `?token=`, valid for token_ttl_s; returns (token, ttl). StoreUnavailable if the
        store cannot keep it."""
        token = secrets.token_urlsafe(24)
        entry = json.dumps({"key": key, "expiry": self.clock() + self.token_ttl_s})
        await self.store.add_token(token, entry, self.token_ttl_s + 5)  # the expiry above is the one checked
        return token, self.token_ttl_s

    async def redeem_token(self, token: str) -> str:
        """The key the token was issued for; the token is used up, on every node. AuthError if unknown, used or
        expired, or if the store cannot be asked."""
        try:
            raw = await self.store.take_token(token)
        except StoreUnavailable as e:
            raise AuthError(f"cannot check the token now ({e})") from None
        if raw is None:
            raise AuthError("invalid or already used token")
        entry = json.loads(raw)
        if self.clock() > entry["expiry"]:
            raise AuthError("token expired")
        return str(entry["key"])

    async def authenticate(self, authorization: str | None, token: str | None) -> str:
        """The key (identity) of a WebSocket handshake: a token if given, else the Authorization header."""
        if not self.enabled:
            return ANONYMOUS
        if token is not None:
            return await self.redeem_token(token)
        return self.check_key(authorization)

    async def refresh_keys(self) -> None:
        """Read the store's keys (with keys_from_store): they join the file's keys. The last good set is kept
        while the store is unreachable."""
        stored = await self.store.api_keys()
        keys = dict(self._file_keys)
        for key, flags in (stored or {}).items():
            try:
                keys[key] = _flags(key, flags, "stored api keys")
            except ValueError as e:
                log.warning("%s", e)
        self.api_keys = keys

    async def keep_keys_fresh(self) -> None:
        """Refresh the keys every refresh_s until cancelled."""
        while True:
            with contextlib.suppress(StoreUnavailable):
                await self.refresh_keys()
            await asyncio.sleep(self.refresh_s)
