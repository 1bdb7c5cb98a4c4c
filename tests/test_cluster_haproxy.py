"""Two `voxgate serve` nodes behind a real HAProxy running the shipped deploy/haproxy.cfg (ports rewritten to free
loopback ones): sessions spread over both; SIGTERM on node A while its streams speak: they finish, node A leaves the
pool within ~1-2 s, and new sessions through HAProxy all land on node B with zero failed handshakes."""

import asyncio
import contextlib
import csv
import io
import os
import re
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.client import VoxgateClient
from gateway.protocol import AudioFrame

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(150), pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
LONG_TEXT = ("Each of these streams keeps speaking while its node is told to stop, several seconds of audio, "
             "and it must be heard to the end before that node closes the session.")
NEW_SESSIONS = 12  # opened through HAProxy during node A's drain: a burst at once, then one every 0.25 s
BURST = 4
MAX_SESSIONS = 50  # set in the nodes' config file


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def haproxy_config(shipped: str, front: int, stats: int, nodes: dict[str, int]) -> str:
    """The shipped configuration with its listening ports and its servers replaced by loopback ones."""
    binds = iter((f"127.0.0.1:{front}", f"127.0.0.1:{stats}"))
    text = re.sub(r"(?m)^(\s+bind )\S+", lambda m: m.group(1) + next(binds), shipped)
    servers = "".join(f"    server {name} 127.0.0.1:{port}\n" for name, port in nodes.items())
    text, count = re.subn(r"(?m)^\s+server \S+ \S+.*\n", "", text)
    assert count, "the shipped haproxy.cfg names no servers"
    return re.sub(r"(?m)^(\s+default-server .*\n)", lambda m: m.group(1) + servers, text, count=1)


async def _start(args: list[str], log: Path) -> asyncio.subprocess.Process:
    with log.open("wb") as out:
        return await asyncio.create_subprocess_exec(*args, env=ENV, stdout=out, stderr=asyncio.subprocess.STDOUT,
                                                    stdin=asyncio.subprocess.DEVNULL)


async def _wait_for(what: str, check, timeout: float) -> float:
    """Poll `check` until it is true (assert it is within the timeout); the monotonic time it was seen true."""
    end = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)
    return time.monotonic()


async def _status(http: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    async with http.get(url) as r:
        return r.status, await r.json()


async def _server_stats(http: aiohttp.ClientSession, stats_port: int) -> dict[str, dict[str, str]]:
    """HAProxy's counters of each server of the backend (its stats page as CSV): status UP/DOWN, wredis, ..."""
    async with http.get(f"http://127.0.0.1:{stats_port}/;csv") as r:
        rows = csv.DictReader(io.StringIO((await r.text()).lstrip("# ")))
        return {row["svname"]: row for row in rows if row["pxname"] == "voxgate_nodes"}


async def _turns(http: aiohttp.ClientSession, port: int) -> float:
    async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
        match = re.search(r"(?m)^voxgate_turns_total (\S+)$", await r.text())
        assert match, "no voxgate_turns_total in /metrics"
        return float(match.group(1))


async def _speak_to_the_end(c: VoxgateClient) -> dict:
    """The long turn's context.done, then what ends the session: the drain's `server_shutdown` (close 1001) or
    nothing (the session stays open)."""
    frames, done = 0, None
    while done is None:
        event = await c.recv(60)
        if isinstance(event, AudioFrame):
            frames += 1
        else:
            assert event["type"] != "error", event
            done = event if event["type"] == "context.done" else None
    assert frames > 0 and done["audio_ms"] > 0
    try:
        event = await c.recv(1.5)
    except TimeoutError:
        return {"done": done, "shutdown": False}
    assert isinstance(event, dict) and event["type"] == "error", event
    assert event["code"] == "server_shutdown" and event["fatal"] is True
    with pytest.raises(ConnectionClosed) as closed:
        await c.recv(10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
    return {"done": done, "shutdown": True}


async def _new_session(url: str, i: int) -> float:
    """One short session through the balancer; its audio length."""
    async with await VoxgateClient.connect(url) as c:
        await c.start(output={"format": "pcm_s16le"})
        utt = await c.speak("Hello.", f"n{i}", timeout=30)
        return utt.done["audio_ms"]


async def test_haproxy_spreads_sessions_and_moves_new_ones_off_a_draining_node(tiny_v2_dir, tmp_path):
    assert shutil.which("haproxy"), "haproxy is not installed (scripts/setup.sh test installs it)"
    ports = {"node_a": _free_port(), "node_b": _free_port()}
    front, stats = _free_port(), _free_port()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy_config((ROOT / "deploy" / "haproxy.cfg").read_text(), front, stats, ports))
    procs: dict[str, asyncio.subprocess.Process] = {}
    try:
        node_config = tmp_path / "voxgate.toml"  # the nodes are configured from a file, as deployments are
        node_config.write_text(f'model = "{tiny_v2_dir}"\nhost = "127.0.0.1"\nport = 1\nmax-num-seqs = 16\n'
                               f'max-sessions = {MAX_SESSIONS}\nshutdown-timeout = 30\n')
        for name, port in ports.items():  # each on its own port: the command line overrides the file
            procs[name] = await _start([sys.executable, "-m", "gateway.cli", "serve", "--config", str(node_config),
                                        "--port", str(port), "--data-dir", str(tmp_path / f"{name}-data")],
                                       tmp_path / f"{name}.log")
        procs["haproxy"] = await _start(["haproxy", "-db", "-f", str(cfg)], tmp_path / "haproxy.log")
        async with aiohttp.ClientSession() as http:
            async def both_up() -> bool:
                for name, proc in procs.items():
                    assert proc.returncode is None, f"{name} exited: {(tmp_path / f'{name}.log').read_text()[-2000:]}"
                with contextlib.suppress(aiohttp.ClientError):
                    return {row["status"] for row in (await _server_stats(http, stats)).values()} == {"UP"}
                return False

            await _wait_for("HAProxy to see both nodes up", both_up, 90)
            url = f"ws://127.0.0.1:{front}/v1/stream"

            # four long turns through the balancer: leastconn spreads them over both nodes
            speaking = []
            for _ in range(4):
                c = await VoxgateClient.connect(url)
                await c.start(output={"format": "pcm_s16le"})
                await c.append(LONG_TEXT, "t")
                await c.end("t")
                speaking.append(c)
            loads = {name: (await _status(http, f"http://127.0.0.1:{port}/readyz"))[1] for name, port in ports.items()}
            sessions = {name: load["sessions"] for name, load in loads.items()}
            assert all(load["free_slots"] == MAX_SESSIONS - load["sessions"] for load in loads.values()), loads
            assert sessions["node_a"] >= 1 and sessions["node_b"] >= 1 and sum(sessions.values()) == 4, sessions
            for c in speaking:  # all of them speak when node A is told to stop
                while not isinstance(await c.recv(30), AudioFrame):
                    pass
            finishing = [asyncio.create_task(_speak_to_the_end(c)) for c in speaking]
            turns_b = await _turns(http, ports["node_b"])

            procs["node_a"].send_signal(signal.SIGTERM)
            sigterm = time.monotonic()

            async def a_draining() -> bool:  # still listening, answering 503 (a refused connection fails the test)
                status, body = await _status(http, f"http://127.0.0.1:{ports['node_a']}/readyz")
                return status == 503 and body["status"] == "draining"

            await _wait_for("node A's /readyz to answer 503", a_draining, 2)
            with pytest.raises(InvalidStatus) as refused:  # a handshake straight to node A: the typed refusal
                await VoxgateClient.connect(f"ws://127.0.0.1:{ports['node_a']}/v1/stream")
            assert refused.value.response.status_code == 503 and b"server_shutdown" in refused.value.response.body

            async def a_down() -> bool:
                return (await _server_stats(http, stats))["node_a"]["status"].startswith("DOWN")

            out_of_pool = asyncio.create_task(_wait_for("node A to leave the pool", a_down, 5))
            # a burst while HAProxy still counts node A in (some reach it and are refused), then a steady trickle
            new_sessions = [asyncio.create_task(_new_session(url, i)) for i in range(BURST)]
            for i in range(BURST, NEW_SESSIONS):
                await asyncio.sleep(0.25)
                new_sessions.append(asyncio.create_task(_new_session(url, i)))
            results = await asyncio.gather(*new_sessions, return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            assert not failed, f"{len(failed)} of {NEW_SESSIONS} new sessions failed: {failed[:3]}"
            assert all(ms > 0 for ms in results)
            left_pool_s = await out_of_pool - sigterm
            assert left_pool_s < 3.0, f"node A left HAProxy's pool after {left_pool_s:.1f} s"
            assert await _turns(http, ports["node_b"]) - turns_b == NEW_SESSIONS  # every new session on node B

            # the burst did reach node A during its drain: refused with 503 there, HAProxy replayed it on node B
            assert int((await _server_stats(http, stats))["node_a"]["wredis"]) >= 1
            ended = await asyncio.gather(*finishing)
            assert sum(e["shutdown"] for e in ended) == sessions["node_a"]  # node A's, each heard to the end
            assert await asyncio.wait_for(procs["node_a"].wait(), 40) == 0
        for c in speaking:
            await c.ws.close()
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.terminate()
        for proc in procs.values():
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
