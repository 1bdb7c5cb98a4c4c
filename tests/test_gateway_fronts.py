"""`voxgate serve --fronts 2`: two gateway processes on one port over one engine, as a real subprocess on the tiny
model. Sessions land on both fronts and speak whole turns; the per-key and the node's session limits hold across
fronts; /metrics counts the whole node; a voice stored through one front speaks on the other; a killed front comes
back; SIGTERM drains a turn in progress and leaves no process; the host restores stored voices once at start, and a
SIGKILLed host takes every process below it along."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
import soundfile
from fronts_support import ENV, Node, descendants, fronts_by_pid, start_node, still_running_after, stop_node

from gateway.client import VoxgateClient
from gateway.fronts import FRONT_HEADER

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEYS = ("alpha", "beta", "gamma", "delta")
PER_KEY, NODE_LIMIT = 2, 3


async def _start(model: Path, tmp: Path, *extra: str) -> Node:
    keys = tmp / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    return await start_node(model, tmp, "--api-keys-file", str(keys), "--max-sessions-per-key", str(PER_KEY),
                            "--max-sessions", str(NODE_LIMIT), *extra)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def node(tiny_v2_dir, tmp_path_factory) -> AsyncIterator[Node]:
    started = await _start(tiny_v2_dir, tmp_path_factory.mktemp("fronts"), "--shutdown-timeout", "20")
    try:
        yield started
    finally:
        await stop_node(started)


async def _session(node: Node, key: str) -> tuple[VoxgateClient, int]:
    client = await VoxgateClient.connect(node.url, api_key=key)
    return client, int(client.ws.response.headers[FRONT_HEADER])


async def _session_on(node: Node, key: str, front: int, tries: int = 32, fmt: str = "pcm_s16le",
                      voice: str | None = None) -> VoxgateClient:
    """A started session of `key` on `front` (new connections until one lands there; the others are closed)."""
    for _ in range(tries):
        client, landed = await _session(node, key)
        if landed == front:
            await client.start(output={"format": fmt}, voice=voice)
            return client
        await client.close()
        await asyncio.sleep(0.2)  # its place is given back in the background
    raise AssertionError(f"no session of {key} landed on front {front} in {tries} connections")


async def _refusal(node: Node, key: str) -> dict:
    async with await VoxgateClient.connect(node.url, api_key=key) as client:
        return await client.expect("error", timeout=20)


async def test_sessions_land_on_both_fronts_and_each_speaks_a_whole_turn(node):
    fronts = await fronts_by_pid(node.port)
    assert sorted(fronts) == [0, 1]
    for pid in fronts.values():  # a front holds no model: no torch either
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text()
    clients = [await _session_on(node, "alpha", front, fmt="opus") for front in (0, 1)]  # each front's encoders
    try:
        turns = await asyncio.gather(*(c.speak(f"Spoken on front {i}.", f"t{i}") for i, c in enumerate(clients)))
        for utt in turns:
            assert utt.done["audio_ms"] > 0 and sum(len(p) for p in utt.payloads) > 0
    finally:
        for c in clients:
            await c.close()


async def _metrics_of_both(node: Node, path: str = "/metrics") -> dict[int, str]:
    """front -> its answer to GET `path` (/metrics: 200), for both fronts."""
    texts: dict[int, str] = {}
    for _ in range(64):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http, \
                http.get(f"http://127.0.0.1:{node.port}{path}") as r:
            assert r.status == 200 or path != "/metrics"
            texts[int(r.headers[FRONT_HEADER])] = await r.text()
        if len(texts) == 2:
            break
    assert sorted(texts) == [0, 1]
    return texts


async def test_metrics_count_the_whole_node_from_either_front(node):
    texts = await _metrics_of_both(node)
    turns = {front: float(re.search(r"^voxgate_turns_total (\S+)$", text, re.M).group(1))
             for front, text in texts.items()}
    assert turns[0] == turns[1] >= 2  # the turn each front spoke, counted once, whichever front answers
    assert all("voxgate_engine_" in text for text in texts.values())  # the engine's gauges, from the host


async def test_the_per_key_and_the_node_session_limits_hold_across_fronts(node):
    first = await _session_on(node, "gamma", 0)
    second = await _session_on(node, "gamma", 1)
    opened = [first, second]
    try:
        error = await _refusal(node, "gamma")  # a third of the key's sessions, whichever front it reaches
        assert error["code"] == "rate_limited" and error["fatal"] is True
        third, _ = await _session(node, "delta")
        opened.append(third)
        await third.start(output={"format": "pcm_s16le"})  # the node's third session: at its limit now
        for _ in range(4):  # each front holds at most two: only the node's count refuses these
            error = await _refusal(node, "beta")
            assert error["code"] == "overloaded" and error["fatal"] is True
        for text in (await _metrics_of_both(node)).values():  # the node's open sessions, whichever front answers
            assert re.search(r"^voxgate_sessions (\S+)$", text, re.M).group(1) == f"{NODE_LIMIT:.1f}"
        for text in (await _metrics_of_both(node, "/readyz")).values():  # and balancers see the node full
            ready = json.loads(text)
            assert (ready["status"], ready["sessions"], ready["free_slots"]) == ("full", NODE_LIMIT, 0)
    finally:
        for c in opened:
            await c.close()
    await asyncio.sleep(0.5)  # the places are given back in the background
    client, _ = await _session(node, "beta")
    async with client:
        await client.start(output={"format": "pcm_s16le"})
        assert (await client.speak("Room again.", "r")).done["audio_ms"] > 0


def _wav(seconds: float = 1.0, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


async def test_a_voice_stored_through_one_front_speaks_on_the_other(node):
    headers = {"Authorization": "Bearer alpha"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), headers=headers) as http, \
            http.post(f"http://127.0.0.1:{node.port}/v1/voices", data=_wav(), params={"text": "A voice."}) as r:
        assert r.status == 201, await r.text()
        voice, stored_on = (await r.json())["voice_id"], int(r.headers[FRONT_HEADER])
    client = await _session_on(node, "alpha", 1 - stored_on, voice=voice)
    async with client:
        assert (await client.speak("In the stored voice.", "v")).done["audio_ms"] > 0


async def test_a_killed_front_comes_back_and_serves(node):
    before = await fronts_by_pid(node.port)
    os.kill(before[1], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        await asyncio.sleep(0.5)
        now = await fronts_by_pid(node.port, tries=16)
        if now.get(1) not in (None, before[1]):
            break
        assert time.monotonic() < deadline, "front 1 did not come back"
    assert now[0] == before[0]  # the other front served on
    assert any(f"front 1 (pid {before[1]}) exited with code -9; restarting it" in line for line in node.log)
    client = await _session_on(node, "alpha", 1)
    async with client:
        assert (await client.speak("Back again.", "b")).done["audio_ms"] > 0


async def test_sigterm_drains_a_turn_in_progress_and_leaves_no_process(node):
    processes = descendants(node.proc.pid)
    assert set((await fronts_by_pid(node.port)).values()) <= processes
    async with await VoxgateClient.connect(node.url, api_key="alpha") as client:
        await client.start(output={"format": "pcm_s16le"})
        await client.append("A longer turn that is still being spoken when the node is told to stop. " * 3, "last")
        await client.end("last")
        await client.recv(timeout=30)  # the turn is under way
        node.proc.send_signal(signal.SIGTERM)
        utt = await client.collect("last", timeout=30)
        assert utt.done["audio_ms"] > 0  # the turn in progress finished
        error = await client.expect("error", timeout=30)
        assert error["code"] == "server_shutdown"
    assert await asyncio.wait_for(node.proc.wait(), 60) == 0
    assert not await still_running_after(processes, 10)
    await asyncio.sleep(0.1)  # the last log lines read
    assert not [line for line in node.log if "did not exit in time" in line or "Traceback" in line]


async def test_a_port_in_use_is_a_clear_error(tiny_v2_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "serve", "--model", str(tiny_v2_dir), "--host", "127.0.0.1",
            "--port", str(port), "--fronts", "2", "--data-dir", str(tmp_path), env=ENV,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 2
    assert f"cannot serve on 127.0.0.1:{port}" in err.decode() and "Traceback" not in err.decode()


async def test_the_host_restores_stored_voices_and_its_fronts_exit_when_it_is_killed(node, tiny_v2_dir):
    assert node.proc.returncode is not None  # the module's node has stopped: its data directory is free
    other = await _start(tiny_v2_dir, node.data_dir)
    try:
        assert "restoring 1 voice(s)" in other.banner  # once, by the host, before any front serves
        fronts = set((await fronts_by_pid(other.port)).values())
        assert len(fronts) == 2
        processes = descendants(other.proc.pid)  # the fronts, the engine's worker, encoder processes
        assert fronts <= processes
        other.proc.kill()
        await other.proc.wait()
        assert not await still_running_after(processes, 10)
    finally:
        await stop_node(other)
