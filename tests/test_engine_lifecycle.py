"""An engine's end frees what it holds: `async with Engine(...)` and `with SyncEngine` stop the worker processes and
unmap their shared audio rings, and a program that never stops its engine still exits quietly (no thread
traceback, no leaked shared memory) with its workers stopped. The real engine on the tiny VoxCPM2 checkpoint."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine import Engine, EngineStopped, SyncEngine

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]


def assert_freed(workers: list) -> None:
    assert workers
    for w in workers:
        assert not w.process.is_alive()
        assert w.ring.shared is None  # unmapped: with the worker gone, the anonymous ring is freed


async def test_async_with_stops_the_workers_and_frees_their_rings(tiny_v2_dir):
    async with Engine(str(tiny_v2_dir), max_num_seqs=2, inference_timesteps=2) as engine:
        chunks = [c async for c in engine.generate("Hello there.", max_length=2, min_length=2)]
        workers = list(engine._workers)
    assert len(chunks) == 2
    assert_freed(workers)
    with pytest.raises(EngineStopped):
        engine.generate("Anyone there?")


def test_with_stops_the_sync_engine(tiny_v2_dir):
    with Engine.from_pretrained(str(tiny_v2_dir), max_num_seqs=2, inference_timesteps=2) as engine:
        assert isinstance(engine, SyncEngine)
        assert len(list(engine.generate("Hello there.", max_length=2, min_length=2))) == 2
        workers = list(engine.engine._workers)
    assert_freed(workers)


def test_a_program_that_never_stops_its_engine_exits_quietly(tiny_v2_dir, tmp_path):
    script = textwrap.dedent(f"""
        import asyncio
        from engine import Engine

        async def main():
            engine = Engine({str(tiny_v2_dir)!r}, max_num_seqs=2, inference_timesteps=2)
            async for _ in engine.generate("Hello there.", max_length=2, min_length=2):
                pass
            w = engine._workers[0]
            print(w.process.pid)

        if __name__ == "__main__":
            asyncio.run(main())  # the loop closes with the engine still running
    """)
    path = tmp_path / "forgetful.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    for noise in ("Traceback", "Exception in thread", "leaked shared_memory", "terminate called"):
        assert noise not in done.stderr, done.stderr
    pid = done.stdout.strip()
    with pytest.raises(ProcessLookupError):  # the worker is gone (reaped by its parent before it exited)
        os.kill(int(pid), 0)


def test_a_lora_shared_with_the_worker_leaves_no_tracker_warnings(tiny_v2_dir, tmp_path):
    """The adapter's named segment is attached by the worker on the pool's resource tracker: the worker's exit
    neither unlinks it behind the pool's back nor reports it leaked."""
    script = textwrap.dedent(f"""
        import torch
        from engine import Engine
        from engine.config import ModelConfig
        from engine.lora import lora_layout
        from engine.model_configs import tiny

        path = "base_lm.layers.0.self_attn.q_proj"
        fan_in, fan_out = lora_layout(ModelConfig.from_dict(tiny("voxcpm2")))[path]
        tensors = {{f"{{path}}.lora_A": torch.randn(4, fan_in), f"{{path}}.lora_B": torch.randn(fan_out, 4)}}
        with Engine.from_pretrained({str(tiny_v2_dir)!r}, max_num_seqs=2, inference_timesteps=2, max_loras=1) as e:
            e.register_lora("a", tensors, config={{"r": 4, "alpha": 8}})
            assert len(list(e.generate("Hello there.", max_length=2, min_length=2, lora="a"))) == 2
            e.unregister_lora("a")
    """)
    path = tmp_path / "adapter.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    for noise in ("Traceback", "resource_tracker", "leaked"):
        assert noise not in done.stderr, done.stderr
