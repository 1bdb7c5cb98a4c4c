"""Shared test setup: the official package's torchaudio stand-in, CPU thread limits, and tiny model directories."""

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

# With no GPU, Triton kernels can only run in its interpreter, and triton must see this before anything (torch
# included) imports it: set it before torch, for the whole session.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import pytest_asyncio  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `pytest` (not only `python -m pytest`) must import the engine from the checkout
    sys.path.insert(0, str(ROOT))

# The official voxcpm package (the oracle) imports torchaudio at module level; use the stub when none is installed.
if importlib.util.find_spec("torchaudio") is None:
    sys.path.insert(0, str(Path(__file__).parent / "_stubs"))

# Interpreted kernels: every load and store inside the launch's tensors (a GPU would fault, or read garbage).
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_bounds import install as _check_triton_bounds

    _check_triton_bounds()

# CI has 2 cores; tiny models gain nothing from more threads and worker processes must not oversubscribe.
torch.set_num_threads(int(os.environ.get("VOXGATE_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_v2_dir(tmp_path_factory) -> Path:
    """A tiny random VoxCPM2 checkpoint in the release layout (model.safetensors, audiovae.pth, tokenizer files)."""
    from engine.model_configs import tiny
    from engine.random_checkpoint import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("tiny-v2"), tiny("voxcpm2"), seed=0, progress=False)


@pytest.fixture(scope="session")
def tiny_v1_dir(tmp_path_factory) -> Path:
    """A tiny random VoxCPM (v1) checkpoint in the VoxCPM1.5 layout (model.safetensors)."""
    from engine.model_configs import tiny
    from engine.random_checkpoint import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("tiny-v1"), tiny("voxcpm"), seed=0, progress=False)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_v2_dir):
    """The real engine (one worker process) on the tiny VoxCPM2 checkpoint, shared by one test module.
    Modules that need other engine settings define their own `engine` fixture."""
    from engine import Engine

    eng = Engine.from_pretrained(str(tiny_v2_dir), max_num_seqs=8)
    await eng.wait_for_ready()
    yield eng
    await eng.stop()


@pytest.fixture(scope="session")
def synth(tiny_v2_dir):
    """The single-request reference path on the tiny VoxCPM2: what batched engine output must equal."""
    from engine.checkpoint import load_model
    from engine.offline import Synthesizer

    return Synthesizer(load_model(tiny_v2_dir))


@contextlib.contextmanager
def interpreted(*names: str) -> Iterator[list]:
    """The named kernel modules, (re)imported with TRITON_INTERPRET=1 (triton reads the flag when kernels are
    decorated); the flag is restored afterwards. For module fixtures of the interpreter tests."""
    import importlib

    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield [importlib.reload(sys.modules[n]) if n in sys.modules else importlib.import_module(n) for n in names]
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
