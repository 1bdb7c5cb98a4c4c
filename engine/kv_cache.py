"""Paged KV blocks: which block ids are free and how many owners each used block has.

Both LMs (base and residual) cache the same positions, so one block table indexes both caches. Blocks are
reference counted so a stored voice's prefix blocks can be shared by every request that starts with it; a block
returns to the free list when its last owner lets go.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one position (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} KV blocks requested, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.refcount[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> list[int]:
        """Add an owner to blocks that are already in use; returns a new table holding them."""
        for b in blocks:
            assert self.refcount[b] > 0, f"block {b} is free"
            self.refcount[b] += 1
        return list(blocks)

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self.refcount[b] > 0, f"block {b} released twice"
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._free.append(b)

    def grow(self, table: list[int], num_positions: int) -> bool:
        """Extend `table` in place to cover `num_positions`; False (table unchanged) when blocks run out."""
        need = self.blocks_for(num_positions) - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        table.extend(self.allocate(need))
        return True
