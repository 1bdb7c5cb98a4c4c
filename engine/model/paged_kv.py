"""The LMs' flat batches over a paged KV cache: each batch's metadata, the cache, and writing new K/V to it.

Shared by every attention backend (`engine.model.attention`, `engine.model.attention_triton`) and the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.config import StackConfig
from engine.model import layers

# the query tiles (query heads x tokens) a Triton prefill program takes, largest first (`TritonAttention.rows_for`)
PREFILL_ROWS = (256, 128, 64)


@dataclass
class AttentionMetadata:
    """A flat batch of B sequences; sequence i owns query tokens cu_seqlens_q[i]:cu_seqlens_q[i+1]."""

    cu_seqlens_q: Tensor  # int32 [B+1]
    seq_lens: Tensor  # int32 [B]  KV length of each sequence after this step (cached + new tokens)
    slot_mapping: Tensor  # int64 [N]  paged-cache slot (block * block_size + offset) of each new token
    block_tables: Tensor  # int32 [B, max_blocks] (padded with 0)
    max_seqlen_q: int
    max_seqlen_k: int
    # the query tile (query heads x tokens) of a Triton prefill program, when the caller knows better than the
    # batch's shape: a large LM graph, whose bucket is mostly empty sequences (`TritonAttention.rows_for`)
    query_rows: int | None = None

    @classmethod
    def build(cls, query_lens: list[int], cached_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str) -> AttentionMetadata:
        """Metadata for sequences that already hold cached_lens[i] tokens and add query_lens[i] new ones."""
        if not (len(query_lens) == len(cached_lens) == len(block_tables)) or not query_lens:
            raise ValueError("query_lens, cached_lens and block_tables need one entry per sequence (at least one)")
        slots: list[int] = []
        for q, c, table in zip(query_lens, cached_lens, block_tables, strict=True):
            if q < 0 or c < 0:
                raise ValueError(f"negative length (query {q}, cached {c})")
            if c + q > len(table) * block_size:
                raise ValueError(f"{c + q} tokens do not fit {len(table)} blocks of {block_size}")
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(c, c + q))
        width = max(1, max(len(t) for t in block_tables))
        tables = [list(t) + [0] * (width - len(t)) for t in block_tables]
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        seq_lens = [q + c for q, c in zip(query_lens, cached_lens, strict=True)]
        return cls(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            max_seqlen_q=max(query_lens), max_seqlen_k=max(seq_lens),
        )

    def positions(self) -> Tensor:
        """Absolute position (within its sequence) of each of the N query tokens."""
        batch, local = token_coords(self)
        return (self.seq_lens - self.cu_seqlens_q.diff())[batch] + local


@dataclass
class KVCache:
    """Paged K/V of one LM stack: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]."""

    k: Tensor
    v: Tensor

    @classmethod
    def allocate(cls, stack: StackConfig, num_blocks: int, block_size: int, device: torch.device | str,
                 dtype: torch.dtype) -> KVCache:
        shape = (stack.num_hidden_layers, num_blocks, block_size, stack.num_key_value_heads, stack.head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    @property
    def block_size(self) -> int:
        return self.k.shape[2]


Rope = tuple[Tensor, Tensor]  # (cos, sin) fp32 [..., D]


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
    """Write the new tokens' K/V [N, Hkv, D] at their paged-cache slots; the caches as flat [slots, Hkv, D] views."""
    kv_heads, head_dim = k_cache.shape[2:]
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    flat_k.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    flat_v.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    return flat_k, flat_v


def rotate(q: Tensor, k: Tensor, rope: Rope | None) -> tuple[Tensor, Tensor]:
    """q and k through `apply_rope` (unchanged without rope)."""
    if rope is None:
        return q, k
    return layers.apply_rope(q, *rope), layers.apply_rope(k, *rope)


def token_coords(meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
    """(sequence index, index within the sequence's new tokens) of each flat query token."""
    cu = meta.cu_seqlens_q.long()
    n = meta.slot_mapping.shape[0]
    batch = torch.repeat_interleave(torch.arange(cu.shape[0] - 1, device=cu.device), cu.diff(), output_size=n)
    return batch, torch.arange(n, device=cu.device) - cu[batch]
