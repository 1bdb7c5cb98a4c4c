"""For the store tests: `voxgate serve` and `redis-server` as real child processes on free loopback ports, and the
small client calls those tests make."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shutil
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import soundfile

from gateway.client import VoxgateClient

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wav(seconds: float = 0.5, hz: float = 180.0, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Node:
    """One `voxgate serve` process; `log` collects its stderr."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int):
        self.proc, self.port = proc, port
        self.http = f"http://127.0.0.1:{port}"
        self.ws = f"ws://127.0.0.1:{port}"
        self.log: list[str] = []
        self._reader: asyncio.Task | None = None

    @classmethod
    async def start(cls, model: Path, *args: str, timeout: float = 90.0) -> Node:
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--max-num-seqs", "8", "--shutdown-timeout", "0.5", "--log-level", "info", *args,
            env=ENV, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        node = cls(proc, port)
        try:
            await asyncio.wait_for(node._until_serving(), timeout)
        except BaseException:
            await node.kill()
            raise
        node._reader = asyncio.create_task(node._read())
        return node

    async def _until_serving(self) -> None:
        assert self.proc.stderr is not None
        while True:
            line = await self.proc.stderr.readline()
            if not line:
                raise AssertionError("voxgate serve exited before serving:\n" + "".join(self.log))
            self.log.append(line.decode(errors="replace"))
            if "voxgate: serving" in self.log[-1]:
                return

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.log.append(line.decode(errors="replace"))

    async def kill(self) -> None:
        """kill -9: no shutdown code runs."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


async def speak(node: Node, key: str | None, text: str, *, voice: str | None = None, seed: int = 7) -> bytes:
    """One turn's PCM through the native socket (at most 40 patches per segment)."""
    async with await VoxgateClient.connect(f"{node.ws}/v1/stream", api_key=key) as c:
        await c.start(voice=voice, output={"format": "pcm_s16le"}, generation={"seed": seed, "max_length": 40})
        utt = await c.speak(text, "t")
    return b"".join(utt.payloads)


async def post_voice(http: aiohttp.ClientSession, node: Node, key: str, **params: str) -> str:
    async with http.post(f"{node.http}/v1/voices", data=wav(), params=params, headers=bearer(key)) as r:
        assert r.status == 201, await r.text()
        return (await r.json())["voice_id"]


async def voice_ids(http: aiohttp.ClientSession, node: Node, key: str) -> list[str]:
    async with http.get(f"{node.http}/v1/voices", headers=bearer(key)) as r:
        assert r.status == 200, await r.text()
        return [v["voice_id"] for v in (await r.json())["voices"]]


@contextlib.asynccontextmanager
async def redis_server(workdir: Path) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """A private redis-server on a free port (no persistence): (its URL, the process). Fails, never skips, when
    redis-server is not installed."""
    exe = shutil.which("redis-server")
    assert exe, "redis-server is not installed: apt-get install redis-server (scripts/setup.sh test does it)"
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "", "--appendonly", "no",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        for _ in range(100):
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("redis-server did not start listening")
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
