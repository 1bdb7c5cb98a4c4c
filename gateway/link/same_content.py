"""Whether a voice or an adapter added again at the engine host is what the engine already holds: then the add is a
no-op (`gateway.link.host`: fronts that load one stored item at once neither fail nor load it twice)."""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import numpy as np
import torch

from engine.registries import Voice


def same_voice(v: Voice, kwargs: dict[str, Any]) -> bool:
    """Whether `add_voice(**kwargs)` (no audio) would store what `v` already is."""
    latents = kwargs.get("latents")
    if (latents is None) != (v.latents is None):
        return False
    if latents is not None and not np.array_equal(np.asarray(latents, dtype=np.float32), v.latents):
        return False
    return v.text == kwargs.get("text") and v.info.lora == kwargs.get("lora")


def content_digest(content: Any) -> bytes:
    """A digest of a voice's or an adapter's content (arrays and tensors by their bytes)."""
    h = hashlib.blake2b(digest_size=16)

    def feed(x: Any) -> None:
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(repr(k).encode())
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(b"[%d" % len(x))
            for item in x:
                feed(item)
        elif isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, np.ndarray):
            h.update(f"{x.dtype}{x.shape}".encode())
            h.update(np.ascontiguousarray(x).tobytes())
        elif isinstance(x, (bytes, bytearray, memoryview)):
            h.update(bytes(x))
        else:
            h.update(pickle.dumps(x, protocol=5))

    feed(content)
    return h.digest()
