"""How long a step's audio takes from the engine host to its fronts (`gateway.link`), through each link's shared
audio ring or inline in the frame, and what the host's event loop spends per step.

A real `EngineHost` (its engine replaced by a stand-in: no model, the steps are synthetic) serves N front processes
over its unix socket. Every `--step-ms` the host's relay gets `--chunks` chunks of `--samples` float32 samples for
each front, as the pool hands a worker step over; each front stamps when it has each chunk's audio (copied out of
the ring, or unpickled from the frame). Printed per mode and front count: host-got-chunk -> front-has-chunk latency
p50/p90 over every chunk, the host process's CPU per step, and how many steps travelled inline.

    python bench/link_relay.py --fronts 2 4 8 --steps 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

SAMPLE_RATE = 48000


class StandInEngine:
    """What `EngineHost` reads of an engine before any front says hello: its sizes and an unchanging state."""

    def __init__(self, max_num_seqs: int):
        self.config = SimpleNamespace(sample_rate=SAMPLE_RATE)
        self.max_num_seqs = max_num_seqs
        self.revision = 0

    def stored_voices(self) -> dict[str, Any]:
        return {}

    def model_info(self) -> None:
        return None

    def stats(self) -> None:
        return None

    def health(self) -> dict[str, Any]:
        return {}

    def list_loras(self) -> list[Any]:
        return []

    def kv_positions(self) -> int:
        return 0


async def front(path: str) -> None:
    """A front process: link, stamp when each chunk's audio is here, print the latencies (ms) when the host goes."""
    from gateway.link import front as front_link
    from gateway.link import wire

    loop = asyncio.get_running_loop()
    conn = await front_link._open(loop, path, time.monotonic() + 30)
    latencies: list[float] = []
    inline = 0

    def dispatch(msg: Any) -> None:
        nonlocal inline
        if type(msg) is not wire.Chunks:
            return
        inline += type(msg.audio) is not tuple
        rows = list(wire.unpack_chunks(wire.with_audio(msg, conn.ring)))
        now = time.monotonic()
        latencies.extend((now - row[7][1]) * 1000.0 for row in rows)

    conn.dispatch = dispatch  # type: ignore[method-assign]
    conn.closing = True  # the host closing is the end of the run here, not a lost link
    conn.welcome.cancel()  # no hello, so no welcome
    print("linked", flush=True)
    await conn.closed
    print(json.dumps({"latencies": latencies, "inline": inline}), flush=True)


async def host(fronts: int, ring_s: float, args: argparse.Namespace) -> dict[str, float]:
    """One run: start the host and `fronts` front processes, relay `args.steps` steps, collect the fronts' stamps."""
    from engine.api import AudioChunk
    from gateway.link import EngineHost
    from gateway.link.host import _Relay
    from gateway.store import LocalStore

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "link.sock")
        engine: Any = StandInEngine(args.chunks * fronts)
        link_host = EngineHost(engine, LocalStore(), path, fronts=fronts, ring_s=ring_s)
        await link_host.start()
        procs = [subprocess.Popen([sys.executable, __file__, "--front", path], stdout=subprocess.PIPE,
                                  env=dict(os.environ)) for _ in range(fronts)]
        for p in procs:
            assert p.stdout is not None
            assert (await asyncio.to_thread(p.stdout.readline)).strip() == b"linked"
        while len(link_host._links) < fronts:
            await asyncio.sleep(0.01)
        rng = np.random.default_rng(0)
        audio = [rng.standard_normal(args.samples).astype(np.float32) for _ in range(args.chunks)]
        latents = np.zeros((4, 64), np.float32)
        relays = [[_Relay(conn, f"r{i}", 0.0) for i in range(args.chunks)] for conn in link_host._links.values()]
        cpu = wall = 0.0
        for step in range(args.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            for per_front in relays:  # as the pool's callback hands the relays one worker step
                for i, relay in enumerate(per_front):
                    relay.got_at = time.monotonic()  # every chunk stamped, as a request's first chunk is
                    relay.put_nowait(AudioChunk(audio[i], SAMPLE_RATE, step, latents, False, None, f"r{i}", step))
            await asyncio.sleep(args.step_ms / 1000.0)
            cpu += time.process_time() - c0
            wall += time.perf_counter() - t0
        await link_host.close()
        got = []
        inline = 0
        for p in procs:
            out, _ = await asyncio.to_thread(p.communicate, timeout=60)
            result = json.loads(out.decode().strip().splitlines()[-1])
            got += result["latencies"]
            inline += result["inline"]
        q = statistics.quantiles(got, n=10)
        return {"chunks": len(got), "p50_ms": statistics.median(got), "p90_ms": q[8], "max_ms": max(got),
                "host_cpu_ms_per_step": cpu / args.steps * 1000.0, "host_busy": cpu / wall,
                "inline_steps": inline, "steps_per_front": args.steps}


async def main(args: argparse.Namespace) -> None:
    from gateway.link import ring

    for fronts in args.fronts:
        for mode, ring_s in (("inline", 0.0), ("ring", ring.RING_S)):
            r = await host(fronts, ring_s, args)
            print(f"{fronts} fronts, {mode:6s}: host-got-chunk -> front-has-chunk p50 {r['p50_ms']:.2f} ms, "
                  f"p90 {r['p90_ms']:.2f} ms, max {r['max_ms']:.2f} ms over {r['chunks']} chunks; host CPU "
                  f"{r['host_cpu_ms_per_step']:.2f} ms/step; {r['inline_steps']} of "
                  f"{r['steps_per_front'] * fronts} steps inline", flush=True)
            if args.json:
                print(json.dumps({"fronts": fronts, "mode": mode, **r}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fronts", type=int, nargs="+", default=[2, 4, 8], help="front counts to run")
    parser.add_argument("--steps", type=int, default=100, help="steps relayed per run")
    parser.add_argument("--step-ms", type=float, default=40.0, help="time between steps")
    parser.add_argument("--chunks", type=int, default=32, help="chunks per front per step")
    parser.add_argument("--samples", type=int, default=7680, help="float32 samples per chunk")
    parser.add_argument("--json", action="store_true", help="also print each run as a JSON line")
    parser.add_argument("--front", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    asyncio.run(front(cli.front) if cli.front else main(cli))
