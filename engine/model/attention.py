"""Attention for the two causal LMs (flat variable-length batches over a paged KV cache) and the local stacks.

The LMs see a flat batch: B sequences, sequence i owning query tokens cu_seqlens_q[i]:cu_seqlens_q[i+1] of N.
Each new token's K/V is written to its paged-cache slot, then every query attends to its sequence's cached K/V,
causally aligned to the end of the sequence. `AttentionBackend` is the seam where a Triton paged-decode kernel or
flash-attn can replace `TorchAttention`.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.model import fusion
from engine.model.paged_kv import PREFILL_ROWS as PREFILL_ROWS
from engine.model.paged_kv import AttentionMetadata as AttentionMetadata
from engine.model.paged_kv import KVCache as KVCache
from engine.model.paged_kv import Rope as Rope
from engine.model.paged_kv import rotate as rotate
from engine.model.paged_kv import store_kv as store_kv
from engine.model.paged_kv import token_coords


class AttentionBackend(Protocol):
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                 rope: Rope | None = None) -> Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D] of one layer; rope:
        (cos, sin) [N, D] still to apply to q and k (None: applied already, or no RoPE). Rotates q and k (maybe in
        place), stores k/v at meta.slot_mapping and returns the attention output [N, Hq, D]."""
        ...


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
            batch, local = token_coords(meta)
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
    if fusion.fused(q):
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

        from engine.model.attention_triton import rope_and_store_kv

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
