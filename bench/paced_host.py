"""BENCHMARK-ONLY: the paced stand-in engine (bench/paced_engine.py) behind the real `EngineHost` (`gateway.link`), in
a process of its own, ticked by hand: each SIGUSR1 is one engine step (one patch to every running request). A
front (`gateway.link.connect`) then runs the real `RemoteEngine`, link and audio ring against it, with no model;
its requests are checked, tokenized and built into specs as in a real front, from the tiny VoxCPM2 config and
tokenizer this process writes into the model directory it is given.

    python bench/paced_host.py SOCKET MODEL_DIR

It prints "ready" once it listens, and exits when its stdin closes (the parent went away) or on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loop_cost import tick_now  # noqa: E402
from paced_engine import PacedEngine, _Request  # noqa: E402

from engine import guards  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.engine_config import EngineConfig  # noqa: E402
from engine.generation import ChunkSink  # noqa: E402
from engine.model_configs import tiny  # noqa: E402
from engine.random_checkpoint import write_tokenizer  # noqa: E402

CHARS_PER_TOKEN = 2.5  # the tiny tokenizer's (512 tokens): a spec's audio length from its text's token count


class _Admitted:
    """What `EngineHost` keeps of an admitted request (`Engine.submit_spec`'s stream): its id, for `release`."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: str):
        self.request_id = request_id


class PacedHostEngine(PacedEngine):
    """`PacedEngine` with the part of `engine.Engine` an `EngineHost` uses: `submit_spec` / `release` and the
    state it pushes to its fronts (no stored voices, no adapters)."""

    def __init__(self, model_dir: Path, **kwargs: Any):
        super().__init__(**kwargs)
        self.path = model_dir
        self.name = "paced-stand-in"
        self.config = ModelConfig.from_file(model_dir / "config.json")
        self.max_num_seqs = 1024
        serving = EngineConfig()
        self.default_timesteps = serving.inference_timesteps
        self.sampling_ranges = guards.SamplingRanges(max_timesteps=serving.served_timesteps)
        self.revision = 0

    def submit_spec(self, spec: Any, sink: ChunkSink) -> _Admitted:
        """One patch per tick, as many as the spec's text would speak (at most its max_length), to `sink`."""
        chars = (len(spec.audio_mask) - sum(spec.audio_mask)) * CHARS_PER_TOKEN  # the text's positions
        patches = max(1, min(spec.params.max_length, math.ceil(chars * self.ms_per_char / self.patch_ms)))
        request = _Request(spec.request_id, patches, spec.n_context > 0)
        request.queue = sink  # type: ignore[assignment]  # the host's relay takes the chunks
        self._submit(request)
        return _Admitted(spec.request_id)

    def release(self, stream: _Admitted) -> None:
        self._drop(stream.request_id)

    def stored_voices(self) -> dict[str, Any]:
        return {}

    def kv_positions(self) -> int:
        return 1 << 20



def write_model_dir(model_dir: Path) -> None:
    """The tiny VoxCPM2's config.json and tokenizer: all a front loads from the host's model path."""
    model_dir.mkdir(parents=True, exist_ok=True)
    config = tiny("voxcpm2")
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(model_dir, config["lm_config"]["vocab_size"])


async def serve(socket_path: str, model_dir: Path) -> None:
    from gateway.link import EngineHost
    from gateway.store import LocalStore

    write_model_dir(model_dir)
    engine = PacedHostEngine(model_dir, tick_ms=1e9)
    host = EngineHost(engine, LocalStore(), socket_path)
    await host.start()
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, tick_now, engine)
    loop.add_signal_handler(signal.SIGTERM, done.set)
    loop.add_reader(sys.stdin.fileno(), done.set)  # readable only at end of file: nothing is written to it
    print("ready", flush=True)
    await done.wait()
    await host.close()
    await engine.stop()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], Path(sys.argv[2])))
