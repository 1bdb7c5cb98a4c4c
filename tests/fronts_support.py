"""For the `voxgate serve --fronts N` tests: the node as a real child process on a free loopback port, which front
answers a new connection, and the processes below the node (from /proc)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from gateway.fronts import FRONT_HEADER

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@dataclass
class Node:
    proc: asyncio.subprocess.Process
    port: int
    data_dir: Path
    banner: str
    log: list[str]  # its stderr after the banner

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_node(model: Path, data_dir: Path, *extra: str, fronts: int = 2,
                     env: dict[str, str] | None = None) -> Node:
    """`voxgate serve --fronts N` on `model`, once it serves (its stderr is read on in the background)."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
        "--port", str(port), "--fronts", str(fronts), "--max-num-seqs", "8", "--data-dir", str(data_dir), *extra,
        env=env or ENV, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    banner = b""
    while b"serving" not in banner:
        line = await asyncio.wait_for(proc.stderr.readline(), 180)
        assert line, f"the server exited before serving: {banner.decode()}"
        banner += line
    assert f"{fronts} gateway processes".encode() in banner
    node = Node(proc, port, data_dir, banner.decode(), [])
    asyncio.get_running_loop().create_task(_read_log(node))  # a full pipe must not block the server's logs
    return node


async def _read_log(node: Node) -> None:
    assert node.proc.stderr is not None
    while line := await node.proc.stderr.readline():
        node.log.append(line.decode())


async def stop_node(node: Node) -> None:
    if node.proc.returncode is None:
        node.proc.kill()
        await node.proc.wait()


async def health(port: int) -> tuple[int, int]:
    """(front, pid) of the front that answers a new connection's GET /healthz."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http, \
            http.get(f"http://127.0.0.1:{port}/healthz") as r:
        assert r.status == 200
        return int(r.headers[FRONT_HEADER]), (await r.json())["pid"]


async def fronts_by_pid(port: int, want: int = 2, tries: int = 64) -> dict[int, int]:
    """front -> pid for every front seen over fresh connections (the kernel spreads them) until `want` are seen."""
    seen: dict[int, int] = {}
    for _ in range(tries):
        front, pid = await health(port)
        seen[front] = pid
        if len(seen) == want:
            break
    return seen


def descendants(pid: int) -> set[int]:
    """Every living process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` that run (a zombie has ended)."""
    running = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                running.add(pid)
    return running


async def still_running_after(pids: set[int], seconds: float) -> set[int]:
    """Those of `pids` still running after `seconds` (sooner when none is)."""
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return alive(pids)
