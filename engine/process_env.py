"""The environment of the engine's processes: what every child process inherits, and NVLink multicast kept off.

NVLink multicast stays off in every process (`disable_nvls`): on shared hosts it can take the GPUs out of service.
"""

from __future__ import annotations

import os
from pathlib import Path

ENGINE_ROOT = str(Path(__file__).resolve().parent.parent)
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def child_env() -> dict[str, str]:
    """The environment of an engine subprocess: this one's, with this checkout's `engine` first on the path."""
    path = os.pathsep.join(p for p in (ENGINE_ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def disable_nvls() -> None:
    """Keep NVLink multicast off in this process and every process it starts."""
    os.environ.update(NVLS_OFF)
