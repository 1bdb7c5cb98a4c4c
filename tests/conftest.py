"""Shared test setup: the official package's torchaudio stand-in, and CPU thread limits."""

import importlib.util
import os
import sys
from pathlib import Path

import torch

# The official voxcpm package (the oracle) imports torchaudio at module level; use the stub when none is installed.
if importlib.util.find_spec("torchaudio") is None:
    sys.path.insert(0, str(Path(__file__).parent / "_stubs"))

# CI has 2 cores; tiny models gain nothing from more threads and worker processes must not oversubscribe.
torch.set_num_threads(int(os.environ.get("VOXGATE_TEST_THREADS", "1")))
