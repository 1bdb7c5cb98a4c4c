"""`GatewayConfig`: every option of `voxgate serve` that is the gateway's, with its default, range check and flag.

The engine's options are `engine.engine_config.EngineConfig`; the CLI's flags are generated from both
(`gateway.flags`), and a TOML config file maps onto those flags (`gateway.config_file`). At start the CLI turns a
`GatewayConfig` into the running server's `gateway.server.ServerConfig` (which takes its defaults from here) and the
sessions' `gateway.protocol.Limits` (whose `idle_timeout_s` default is the one this config shows). Environment
switches: `gateway.settings.GatewaySettings`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import InvalidParameter
from engine.options import check_options, float_in, int_in, option
from gateway.leases import DEFAULT_LEASE_TTL_S
from gateway.protocol import Limits
from gateway.settings import fronts_count
from gateway.store.local import DEFAULT_DATA_DIR


def home_relative(path: Path) -> str:
    """`path` as ~/... when it is under the home directory (help texts and the README read the same everywhere)."""
    return f"~/{path.relative_to(Path.home())}" if path.is_relative_to(Path.home()) else str(path)


def check_fronts(name: str, value: Any) -> None:
    """auto, or an integer of at least 1 (as text or a number: a config file may give either)."""
    try:
        fronts_count(str(value))
    except ValueError as e:
        raise InvalidParameter(f"{name}: {value!r} {e}") from None


def check_log_level(name: str, value: Any) -> None:
    """A logging level's name, in any case (debug, info, warning, error, critical)."""
    if not isinstance(value, str) or not isinstance(logging.getLevelNamesMapping().get(value.upper()), int):
        raise InvalidParameter(f"{name}: unknown level {value!r} (debug, info, warning, error)")


@dataclass(frozen=True)
class GatewayConfig:
    """How one gateway serves: where it listens, who may connect, where state lives, limits, logs."""

    host: str = option("0.0.0.0", flag="--host",
                       help="address to listen on (0.0.0.0: every interface; 127.0.0.1: this machine only)")
    port: int = option(8080, flag="--port", check=int_in(0, 65535), help="TCP port to listen on")
    api_keys_file: str | None = option(
        None, flag="--api-keys-file", default_text="no authentication",
        help="file with one API key per line, optionally followed by flags: operator (shares voices and adapters "
             "with every key, manages all), strict (unknown voice ids are not-found errors)")
    api_keys_from_store: bool = option(
        False, flag="--api-keys-from-store",
        help="also accept the keys in the store's voxgate:keys hash (key -> flags), re-read every few seconds: keys "
             "are added and revoked without a restart (needs --store)")
    data_dir: str | None = option(
        None, flag="--data-dir", default_text=home_relative(DEFAULT_DATA_DIR),
        help="where stored voices and LoRA adapters are kept across restarts, for one server (many nodes share state "
             "with --store instead)")
    store_url: str | None = option(
        None, flag="--store", metavar="URL", default_text="the local --data-dir",
        help="shared state for many nodes: redis://host:port/db holds voices, adapters, tokens and per-key session "
             "leases")
    lease_ttl_s: float = option(
        DEFAULT_LEASE_TTL_S, flag="--session-lease-ttl", check=float_in(0.001),
        help="seconds a per-key session place outlives a node that died without giving it back (the node refreshes "
             "its places every third of it)")
    strict_voices: bool = option(
        False, flag="--strict-voices",
        help="ElevenLabs, Cartesia and Deepgram requests naming an unknown voice get the protocol's not-found error "
             "(default: they speak with the default voice, logged)")
    metrics_key_file: str | None = option(
        None, flag="--metrics-key-file", default_text="/metrics is open",
        help="file whose first line is the key GET /metrics requires as 'Authorization: Bearer <key>' (/healthz and "
             "/readyz are always open)")
    max_sessions: int = option(
        1000, flag="--max-sessions", check=int_in(1),
        help="concurrent sessions (WebSocket or HTTP) this server accepts; more are refused with an 'overloaded' "
             "error")
    max_sessions_per_key: int = option(
        100, flag="--max-sessions-per-key", check=int_in(1),
        help="concurrent sessions per API key, with --api-keys-file")
    idle_timeout_s: float = option(
        Limits.idle_timeout_s, flag="--idle-timeout", check=float_in(0.001), help="seconds without a message")
    shutdown_timeout_s: float = option(
        10.0, flag="--shutdown-timeout", check=float_in(0), help="seconds turns may take to finish on SIGTERM")
    fronts: str | None = option(
        None, flag="--fronts", metavar="N|auto", check=check_fronts, default_text="VOXGATE_FRONTS, else auto",
        help="gateway processes (fronts) serving this port over the one engine, each with its own event loop: raise "
             "it when one gateway process's loop is the bottleneck (hundreds of sessions); 1: one process; auto: 1 "
             "below 8 cores, else cores // 2, at most 8")
    web_client_dir: str | None = option(
        None, flag="--web-client", default_text="the demo page, gateway/web_client/",
        help="folder of the browser client to serve at /")
    log_level: str = option("warning", flag="--log-level", check=check_log_level,
                            help="debug, info, warning or error")
    log_json: bool = option(False, flag="--log-json", help="one JSON object per log line")

    def __post_init__(self) -> None:
        check_options(self)
        if self.api_keys_from_store and not self.store_url:
            raise InvalidParameter("--api-keys-from-store needs --store redis://...")
