"""`voxgate serve --fronts 2` whose fronts keep dying, as a real subprocess on the tiny model: below the crash limit
(VOXGATE_FRONT_CRASHES, lowered here to 2 within 60 s) every SIGKILLed front is restarted and serves; the crash past
it stops the node with exit status 1 and a log line that says why, and no process of the node is left: the engine
worker, the fronts, the fronts' encoder processes (those of the killed fronts too)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest
from fronts_support import ENV, Node, descendants, fronts_by_pid, start_node, still_running_after, stop_node

from engine.settings import SettingError
from gateway.client import VoxgateClient
from gateway.settings import GatewaySettings

LIMIT, WINDOW_S = 2, 60


def test_the_crash_limit_is_n_crashes_within_s_seconds():
    assert GatewaySettings.from_env({}).front_crashes == (5, 60.0)
    assert GatewaySettings.from_env({"VOXGATE_FRONT_CRASHES": "0/2.5"}).front_crashes == (0, 2.5)


@pytest.mark.parametrize("raw", ["5", "", "-1/60", "2/0", "2/-1", "2/inf", "2/nan", "many/60", "2/soon"])
def test_a_bad_crash_limit_names_the_setting(raw):
    with pytest.raises(SettingError, match="VOXGATE_FRONT_CRASHES"):
        GatewaySettings.from_env({"VOXGATE_FRONT_CRASHES": raw})


async def _replaced(node: Node, before: dict[int, int], within_s: float = 120) -> dict[int, int]:
    """front -> pid once every front of `before` serves again under a new pid (the others as they are)."""
    deadline = time.monotonic() + within_s
    while True:
        await asyncio.sleep(0.3)
        try:
            now = await fronts_by_pid(node.port, tries=16)
        except aiohttp.ClientConnectionError:  # no front listens for the moment
            now = {}
        if all(now.get(i, pid) != pid for i, pid in before.items()):
            return now
        assert time.monotonic() < deadline, f"fronts not back: {before} -> {now}"


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.asyncio(loop_scope="module")
async def test_fronts_are_restarted_below_the_crash_limit_and_past_it_the_node_stops(tiny_v2_dir, tmp_path):
    env = {**ENV, "VOXGATE_FRONT_CRASHES": f"{LIMIT}/{WINDOW_S}"}
    node = await start_node(tiny_v2_dir, tmp_path, "--shutdown-timeout", "5", env=env)
    try:
        processes = descendants(node.proc.pid)  # the engine worker, the fronts, their encoder processes
        first = await fronts_by_pid(node.port)
        assert sorted(first) == [0, 1] and set(first.values()) <= processes
        for pid in first.values():  # LIMIT crashes: each front is restarted
            os.kill(pid, signal.SIGKILL)
        second = await _replaced(node, first)
        processes |= descendants(node.proc.pid)  # the new fronts and their encoders
        for front, pid in first.items():
            assert any(f"front {front} (pid {pid}) exited with code -9; restarting it" in line for line in node.log)
        async with await VoxgateClient.connect(node.url) as client:  # a restarted front speaks
            await client.start(output={"format": "pcm_s16le"})
            assert (await client.speak("Back again.", "b")).done["audio_ms"] > 0

        os.kill(second[1], signal.SIGKILL)  # one crash past the limit, well within the window
        assert await asyncio.wait_for(node.proc.wait(), 60) == 1
        assert not await still_running_after(processes, 10)
        await asyncio.sleep(0.1)  # the last log lines read
        why = f"fronts died {LIMIT + 1} times within {WINDOW_S} s"
        assert any(f"front 1 (pid {second[1]}) exited with code -9; not restarting it: {why}" in line
                   for line in node.log), node.log
        assert any(f"stopping: {why}" in line for line in node.log), node.log
        assert not [line for line in node.log if f"(pid {second[1]}) exited with code -9; restarting it" in line]
        assert not [line for line in node.log if "Traceback" in line or "did not exit in time" in line]
    finally:
        await stop_node(node)


@pytest.mark.asyncio(loop_scope="module")
async def test_crashes_older_than_the_window_no_longer_count(tiny_v2_dir, tmp_path):
    """One crash allowed within 3 s: a front killed, then the other once that crash is over 3 s old, is restarted
    too (two crashes in all, never two within the window), and the node goes on serving."""
    env = {**ENV, "VOXGATE_FRONT_CRASHES": "1/3"}
    node = await start_node(tiny_v2_dir, tmp_path, "--shutdown-timeout", "5", env=env)
    try:
        first = await fronts_by_pid(node.port)
        t0 = time.monotonic()
        os.kill(first[0], signal.SIGKILL)
        await _replaced(node, {0: first[0]}, within_s=60)
        await asyncio.sleep(max(0.0, t0 + 4.0 - time.monotonic()))  # the first crash ages out of the 3 s window
        os.kill(first[1], signal.SIGKILL)
        await _replaced(node, {1: first[1]}, within_s=60)
        assert node.proc.returncode is None
        restarted = [line for line in node.log if "exited with code -9; restarting it" in line]
        assert len(restarted) == 2, node.log
        async with await VoxgateClient.connect(node.url) as client:
            await client.start(output={"format": "pcm_s16le"})
            assert (await client.speak("Still here.", "s")).done["audio_ms"] > 0
    finally:
        await stop_node(node)
