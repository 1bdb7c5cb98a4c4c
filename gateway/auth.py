"""API keys for servers, short-lived single-use tokens for browsers (which cannot set headers on a WebSocket)."""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from pathlib import Path


class AuthError(Exception):
    """Authentication failed; the message says why (no secret in it)."""


class Auth:
    """With no keys configured every request is allowed (a local or trusted-network deployment)."""

    def __init__(self, api_keys: set[str] | None = None, token_ttl_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.api_keys = set(api_keys or ())
        self.token_ttl_s = token_ttl_s
        self.clock = clock
        self._tokens: dict[str, tuple[float, str]] = {}  # token -> (expiry, the key it was issued for)

    @classmethod
    def from_file(cls, path: str | Path, **kwargs) -> Auth:
        """One key per line; blank lines and lines starting with # are skipped."""
        lines = Path(path).read_text().splitlines()
        keys = {line.strip() for line in lines if line.strip() and not line.strip().startswith("#")}
        if not keys:
            raise ValueError(f"{path}: no API keys in the file")
        return cls(keys, **kwargs)

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys)

    def check_key(self, authorization: str | None) -> str:
        """The key from an `Authorization: Bearer <key>` header; AuthError if missing or unknown."""
        if not self.enabled:
            return "anonymous"
        if not authorization:
            raise AuthError("missing Authorization: Bearer <api key>")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise AuthError("the Authorization header must be 'Bearer <api key>'")
        # constant-time comparison against every key: no timing hint about which prefix matched
        if not any(hmac.compare_digest(key.encode(), k.encode()) for k in self.api_keys):
            raise AuthError("invalid API key")
        return key

    def issue_token(self, key: str) -> tuple[str, float]:
        """A single-use token for `?token=`, valid for token_ttl_s; returns (token, ttl)."""
        self._expire()
        token = secrets.token_urlsafe(24)
        self._tokens[token] = (self.clock() + self.token_ttl_s, key)
        return token, self.token_ttl_s

    def redeem_token(self, token: str) -> str:
        """The key the token was issued for; the token is used up. AuthError if unknown, used or expired."""
        entry = self._tokens.pop(token, None)
        if entry is None:
            raise AuthError("invalid or already used token")
        expiry, key = entry
        if self.clock() > expiry:
            raise AuthError("token expired")
        return key

    def authenticate(self, authorization: str | None, token: str | None) -> str:
        """The key (identity) of a WebSocket handshake: a token if given, else the Authorization header."""
        if not self.enabled:
            return "anonymous"
        if token is not None:
            return self.redeem_token(token)
        return self.check_key(authorization)

    def _expire(self) -> None:
        now = self.clock()
        for token in [t for t, (expiry, _) in self._tokens.items() if expiry < now]:
            del self._tokens[token]
