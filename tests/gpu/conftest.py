"""Fixtures of the GPU tests: the CUDA device and a real-size random VoxCPM2 checkpoint (stop head never fires).

`bench/gpu_run.sh` writes the checkpoint once and points VOXGATE_VOXCPM2_DIR at it; without it the fixture writes
one under pytest's temporary directory (about 15 s on the GPU).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def cuda() -> str:
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    return "cuda"


@pytest.fixture(scope="session")
def voxcpm2_dir(cuda, tmp_path_factory) -> Path:
    given = os.environ.get("VOXGATE_VOXCPM2_DIR")
    if given and (Path(given) / "config.json").is_file():
        return Path(given)
    from engine import model_configs
    from engine.random_checkpoint import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("voxcpm2"), model_configs.voxcpm2(), seed=0,
                                   stop_never=True, progress=False, device=cuda)


def pytest_collection_modifyitems(config, items):
    """Everything under tests/gpu/ needs CUDA: mark it `gpu`, so the CPU suite (-m 'not gpu') never collects it."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
