"""bench/gateway_proc.py --fronts N: every front's own figures, asked privately.

A request on the shared port reaches one front the kernel picks, so each front (through `front_hook`, the
`app_hook` of `gateway.fronts.serve_fronts`) also listens on 127.0.0.1:0 and writes that port to a file in the
directory the host names in FRONTS_DIR_ENV. The host reads the directory and asks every front (`ask_fronts`).
The host's --gc-threshold reaches the fronts through the same directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web
from proc_stats import ProcessProbe

FRONTS_DIR_ENV = "GATEWAY_PROC_FRONTS_DIR"  # set by the host (bench/gateway_proc.py) before the fronts start
SETTINGS = "settings.json"  # in that directory: what the host's options say for every front (gc_threshold)


def bench_routes(app: web.Application, stats: Any, reset: Any) -> None:
    """GET /bench/stats answers `stats()` (a JSON-able dict); POST /bench/reset calls `reset()`."""

    async def get_stats(_: web.Request) -> web.Response:
        return web.json_response(await stats())

    async def post_reset(_: web.Request) -> web.Response:
        await reset()
        return web.json_response({"ok": True})

    app.router.add_get("/bench/stats", get_stats)
    app.router.add_post("/bench/reset", post_reset)


def front_hook(app: web.Application) -> None:
    """In a front process: its /bench routes on the shared app (they answer for whichever front the kernel picked)
    and on a private listener whose port goes to the host's directory while the front serves."""
    # multiprocessing names each front's process voxgate-front-<index>
    role = multiprocessing.current_process().name.replace("voxgate-", "").replace("-", "")
    probe = ProcessProbe(role)

    async def stats() -> dict[str, Any]:
        return probe.snapshot()

    async def reset() -> None:
        probe.reset()

    bench_routes(app, stats, reset)
    private = web.Application()
    bench_routes(private, stats, reset)
    runner = web.AppRunner(private, access_log=None)
    directory = Path(os.environ[FRONTS_DIR_ENV])
    entry = directory / f"front-{os.getpid()}.json"
    threshold = json.loads((directory / SETTINGS).read_text()).get("gc_threshold")

    async def on_startup(_: web.Application) -> None:
        from gateway.text import normalize

        # the normalisation grammars (seconds of pure Python holding the GIL) load before the front serves, as
        # bench/gateway_proc.py's single process does: no level measures them, and the front's freeze covers them
        await asyncio.to_thread(normalize.preload)
        probe.start()
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # aiohttp exposes it here only
        partial = entry.with_suffix(".tmp")
        partial.write_text(json.dumps({"role": role, "pid": os.getpid(), "port": port}))
        partial.rename(entry)  # the host never reads half a file
        if threshold:  # after the front's own gateway.gc_policy.settle_gc, which runs once it serves
            asyncio.get_running_loop().call_later(1.0, gc.set_threshold, *threshold)

    async def on_cleanup(_: web.Application) -> None:
        entry.unlink(missing_ok=True)
        probe.stop()
        await runner.cleanup()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)


def live_fronts(directory: Path) -> list[dict[str, Any]]:
    """The fronts that announced a private port and are still alive (a restarted front's old entry is skipped)."""
    out = []
    for path in sorted(directory.glob("front-*.json")):
        with contextlib.suppress(OSError, ValueError):
            info = json.loads(path.read_text())
            if Path(f"/proc/{info['pid']}").exists():
                out.append(info)
    return out


async def ask_fronts(directory: Path, method: str, path: str) -> list[dict[str, Any]]:
    """Every live front's answer to `method path` on its private port (a front that does not answer is left out)."""
    async with ClientSession(timeout=ClientTimeout(total=20)) as http:

        async def ask(info: dict[str, Any]) -> dict[str, Any] | None:
            try:
                async with http.request(method, f"http://127.0.0.1:{info['port']}{path}") as r:
                    return await r.json()
            except (TimeoutError, OSError, ValueError):
                return None

        answers = await asyncio.gather(*(ask(info) for info in live_fronts(directory)))
    return sorted((a for a in answers if a is not None), key=lambda a: a.get("role", ""))
