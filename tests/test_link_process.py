"""The link across real processes: the engine host in a child process (real tiny engine), a front here. The front
connects while the host is still starting, speaks, measures the link, then the host is killed: the front's open
stream fails with `HostLost` and `on_lost` is called."""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys

import pytest

from gateway.link import HostLost, connect

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

HOST = """
import asyncio, sys
from engine import Engine
from gateway.link import EngineHost
from gateway.store import LocalStore

async def main():
    engine = Engine(sys.argv[1], max_num_seqs=4, inference_timesteps=4)
    await engine.wait_for_ready()
    await EngineHost(engine, LocalStore(), sys.argv[2]).start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_front_in_another_process_than_its_host(tiny_v2_dir, tmp_path):
    path = tmp_path / "host.sock"
    host = subprocess.Popen([sys.executable, "-c", HOST, str(tiny_v2_dir), str(path)], env=dict(os.environ),
                            start_new_session=True)  # its worker goes with it (`os.killpg`)
    try:
        lost = asyncio.Event()
        front = await connect(path, 1, on_lost=lost.set, timeout_s=60)  # retries while the host starts
        await front.engine.wait_for_ready()
        parts = []
        for i in range(8):
            stream = front.engine.generate("Across processes.", seed=i, max_length=2)
            chunks = [c async for c in stream]
            assert chunks and chunks[-1].is_last
            parts.append(stream.link_parts_ms)
        request, chunk = (statistics.median(p[k] for p in parts) for k in (0, 1))
        print(f"\nlink across processes: request front->host median {request:.3f} ms, first chunk host->front "
              f"median {chunk:.3f} ms")
        assert 0 <= request < 100 and 0 <= chunk < 100
        stream = front.engine.generate("Cut off when the host dies.", seed=1, min_length=400, max_length=500)
        await anext(stream)
        os.killpg(host.pid, signal.SIGKILL)
        with pytest.raises(HostLost):
            while True:
                await anext(stream)
        await asyncio.wait_for(lost.wait(), 10)
        assert front.engine.health()["status"] == "stopped"
    finally:
        if host.poll() is None:
            os.killpg(host.pid, signal.SIGKILL)
        host.wait(10)
