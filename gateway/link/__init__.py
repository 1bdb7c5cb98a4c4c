"""The engine served to gateway front processes (`voxgate serve --fronts N`): one host process holds the `Engine` and
the store, N front processes each run the gateway app over a `RemoteEngine` and a `HostStore`.

Host side: `EngineHost(engine, store, path)` serves both over a unix socket (`start`, `close`, `fronts`).
Front side: `connect(path, front)` -> `FrontLink` with `.engine` (a `RemoteEngine`: what the gateway uses of
`engine.engine.Engine`) and `.store` (a `HostStore`: `gateway.store.base.Store` over the link, `shared = True`).

Requests are checked and built into `RequestSpec`s in the front (the same code as `Engine.generate`), so the host
only forwards specs to its pool and relays chunks, one message per front per worker step (its audio in the link's
shared-memory ring, `gateway.link.ring`, the message carrying its span). If the host goes away,
every open stream of the front fails with `HostLost` (an `EngineStopped`) and `FrontLink.on_lost` is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.link.front import FrontLink, connect
from gateway.link.host_store import HostStore
from gateway.link.remote_engine import RemoteEngine
from gateway.link.wire import HostLost

if TYPE_CHECKING:
    from gateway.link.host import EngineHost

__all__ = ["EngineHost", "FrontLink", "HostLost", "HostStore", "RemoteEngine", "connect"]


def __getattr__(name: str) -> Any:
    # the host side imports the engine (and torch) when first named: a front process never loads them
    if name == "EngineHost":
        from gateway.link.host import EngineHost

        return EngineHost
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
