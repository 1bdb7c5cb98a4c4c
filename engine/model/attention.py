"""Attention for the two causal LMs (flat variable-length batches over a paged KV cache) and the local stacks.

The LMs see a flat batch: B sequences, sequence i owning query tokens cu_seqlens_q[i]:cu_seqlens_q[i+1] of N.
Each new token's K/V is written to its paged-cache slot, then every query attends to its sequence's cached K/V,
causally aligned to the end of the sequence. `AttentionBackend` is the seam where a Triton paged-decode kernel or
flash-attn can replace `TorchAttention`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
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
        batch, local = _token_coords(self)
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


class AttentionBackend(Protocol):
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                 rope: Rope | None = None) -> Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D] of one layer; rope:
        (cos, sin) [N, D] still to apply to q and k (None: applied already, or no RoPE). Rotates q and k (maybe in
        place), stores k/v at meta.slot_mapping and returns the attention output [N, Hq, D]."""
        ...


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
    """Write the new tokens' K/V [N, Hkv, D] at their paged-cache slots; the caches as flat [slots, Hkv, D] views."""
    kv_heads, head_dim = k_cache.shape[2:]
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    flat_k.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    flat_v.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    return flat_k, flat_v


def rope_and_store_kv(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                      rope: Rope | None) -> Tensor:
    """q rotated by `rope` (None: as it is), after k rotated and v were stored at their paged-cache slots. On CUDA
    one Triton kernel, in place on q and k (`rope_store_kv_`: two or three kernels -> one); elsewhere `apply_rope`
    and `store_kv`."""
    if layers.fused(q):
        from engine.model.attention_triton import rope_store_fits, rope_store_kv_

        if rope_store_fits(q, k, v, k_cache, v_cache):
            rope_store_kv_(q, k, v, k_cache, v_cache, meta.slot_mapping, rope)
            return q
    q, k = rotate(q, k, rope)
    store_kv(k, v, k_cache, v_cache, meta)
    return q


def rotate(q: Tensor, k: Tensor, rope: Rope | None) -> tuple[Tensor, Tensor]:
    """q and k through `apply_rope` (unchanged without rope)."""
    if rope is None:
        return q, k
    return layers.apply_rope(q, *rope), layers.apply_rope(k, *rope)


def _token_coords(meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
    """(sequence index, index within the sequence's new tokens) of each flat query token."""
    cu = meta.cu_seqlens_q.long()
    n = meta.slot_mapping.shape[0]
    batch = torch.repeat_interleave(torch.arange(cu.shape[0] - 1, device=cu.device), cu.diff(), output_size=n)
    return batch, torch.arange(n, device=cu.device) - cu[batch]


class TorchAttention:
    """Reference backend: scatter new K/V into the paged cache, gather each sequence's K/V into a padded batch,
    one SDPA call with a causal mask aligned to the end of every sequence."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                 rope: Rope | None = None) -> Tensor:
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        q, k = rotate(q, k, rope)
        flat_k, flat_v = store_kv(k, v, k_cache, v_cache, meta)

        b, max_q, max_k = meta.block_tables.shape[0], meta.max_seqlen_q, meta.max_seqlen_k
        key_pos = torch.arange(max_k, device=q.device)
        blocks = meta.block_tables.long().clamp_min(0)[:, key_pos // block_size]  # [B, max_k]
        slots = blocks * block_size + key_pos % block_size
        keys, values = flat_k[slots], flat_v[slots]  # [B, max_k, Hkv, D]

        seq_lens = meta.seq_lens.long()
        cached = seq_lens - meta.cu_seqlens_q.diff().long()
        query_pos = cached[:, None] + torch.arange(max_q, device=q.device)  # [B, max_q] absolute positions
        mask = (key_pos <= query_pos[:, :, None]) & (key_pos < seq_lens[:, None, None])  # [B, max_q, max_k]

        if max_q == 1 and q.shape[0] == b:  # pure decode: the flat batch is already one token per sequence
            padded_q = q[:, None]
        else:
            batch, local = _token_coords(meta)
            padded_q = q.new_zeros(b, max_q, *q.shape[1:])
            padded_q[batch, local] = q
        out = F.scaled_dot_product_attention(
            padded_q.transpose(1, 2), keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
            attn_mask=mask[:, None], enable_gqa=True).transpose(1, 2)  # [B, max_q, Hq, D]
        if max_q == 1 and q.shape[0] == b:
            return out[:, 0]
        return out[batch, local]


def dense_attention(q: Tensor, k: Tensor, v: Tensor, rope: Rope | None = None, last: int | None = None) -> Tensor:
    """Bidirectional attention without cache for LocEnc/LocDiT: q [B, L, Hq, D], k/v [B, L, Hkv, D]; rope: (cos, sin)
    [L, D] still to apply to q and k (None: applied already, or no RoPE); `last`: only the last `last` tokens'
    outputs, [B, last, Hq, D]. On CUDA one Triton kernel for these few-token sequences (`short_attention`, which
    also does the rotation), else `apply_rope` and torch's SDPA."""
    if layers.fused(q):
        from engine.model.attention_triton import short_attention, short_attention_fits

        if short_attention_fits(q, k) and min(t.stride(-1) for t in (q, k, v)) == 1:
            return short_attention(q, k, v, rope, last)
    q, k = rotate(q, k, rope)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
    out = out.transpose(1, 2)
    return out if last is None else out[:, -last:]


class FlashAttention:
    """flash-attn 2 over the paged cache (its paged kernels need pages of a multiple of 256 positions)."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                 rope: Rope | None = None) -> Tensor:
        from flash_attn import flash_attn_varlen_func

        q = rope_and_store_kv(q, k, v, k_cache, v_cache, meta, rope)
        cu_seqlens_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return flash_attn_varlen_func(q, k_cache, v_cache, meta.cu_seqlens_q, cu_seqlens_k, meta.max_seqlen_q,
                                      meta.max_seqlen_k, causal=True, block_table=meta.block_tables)


def make_attention_backend(device: torch.device | str, block_size: int | None = None) -> AttentionBackend:
    """The fastest backend for `device`: flash-attn when importable and the page size suits it, else the Triton
    kernels on CUDA, else `TorchAttention`."""
    if torch.device(device).type != "cuda":
        return TorchAttention()
    if block_size is not None and block_size % 256 == 0 and importlib.util.find_spec("flash_attn") is not None:
        return FlashAttention()
    from engine.model.attention_triton import TritonAttention

    return TritonAttention()
