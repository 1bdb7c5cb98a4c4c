"""Out-of-bounds checks for Triton kernels run in its interpreter (the CPU test suite).

On a GPU an out-of-bounds load or store is an illegal address at best, found steps later at some other API call
(s15c: "an illegal memory access" reported by a cuBLAS call at engine start), and at worst silent garbage. The
interpreter reads and writes host memory through raw addresses and checks none of them. `install` makes every
masked-on address of every load and store of an interpreted kernel fall inside the storage of one of that launch's
tensor arguments, else the launch raises `TritonOutOfBounds`. Written by hand: Triton has no such mode.
"""

from __future__ import annotations

import numpy as np
import torch


class TritonOutOfBounds(RuntimeError):
    """An interpreted kernel touched memory outside its tensor arguments."""


_ranges: list[tuple[int, int]] = []  # [start, end) byte ranges of the running launch's tensor arguments' storages
_kernel = [""]


def _check(ptrs, mask, what: str) -> None:
    addresses = ptrs.data.astype(np.uint64)
    if mask is not None:
        addresses = addresses[np.broadcast_to(mask.data.astype(bool), addresses.shape)]
    addresses = addresses.ravel()
    if not addresses.size or not _ranges:
        return
    inside = np.zeros(addresses.shape, dtype=bool)
    for start, end in _ranges:
        inside |= (addresses >= start) & (addresses < end)
    if not inside.all():
        raise TritonOutOfBounds(f"{_kernel[0]}: {what} of {int((~inside).sum())} of {addresses.size} addresses "
                                f"outside every tensor argument")


def install() -> None:
    """Check every interpreted launch from now on (idempotent)."""
    import triton.runtime.interpreter as interpreter

    builder, grid = interpreter.InterpreterBuilder, interpreter.GridExecutor
    if getattr(builder, "_voxgate_bounds", False):
        return
    load, store, call = builder.create_masked_load, builder.create_masked_store, grid.__call__

    def checked_load(self, ptrs, mask, other, *args):
        _check(ptrs, mask, "load")
        return load(self, ptrs, mask, other, *args)

    def checked_store(self, ptrs, value, mask, *args):
        _check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *args)

    def checked_call(self, *args, **kwargs):
        saved, name = list(_ranges), _kernel[0]
        _ranges[:] = [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in
                      (t.untyped_storage() for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))]
        _kernel[0] = getattr(self.fn, "__name__", str(self.fn))
        try:
            return call(self, *args, **kwargs)
        finally:
            _ranges[:], _kernel[0] = saved, name

    builder.create_masked_load, builder.create_masked_store, grid.__call__ = checked_load, checked_store, checked_call
    builder._voxgate_bounds = True
