"""Triton attention: paged-KV causal attention for the two LMs (a flat varlen batch, prefill chunks and decodes
mixed), and dense bidirectional attention over the few tokens of one patch for LocEnc and the LocDiT.

One program owns (sequence, kv head, block of BLOCK_Q query tokens, KV split). It stacks the GROUP query heads that
share the kv head as rows of one tile, so each cached K/V byte is read once per kv head (decode is memory-bound).
Online softmax with fp32 accumulation. For decode at small batch the KV range is split across programs
(flash-decoding) and a second kernel merges the partial results by their log-sum-exp.

CUDA-graph capturable: the grid and all shapes come from host ints (batch size, max_seqlen_q, max_seqlen_k), which
the caller keeps fixed per graph bucket; sequence lengths and block tables are read in-kernel.

RoPE is fused on this path: `rope_store_kv_` rotates the new tokens' q and k in place and writes K/V to their cache
slots in one launch before the paged kernel reads the cache (the paged kernel cannot store: its programs for one
sequence would race), and `short_attention` rotates q and k as it loads them. Both use engine.kernels' `rope_f32`,
so they round exactly as `rope_` followed by the unfused calls.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels import dot_precision, rope_f32, rope_heads_
from engine.model import fusion
from engine.model.paged_kv import PREFILL_ROWS, AttentionMetadata, Rope, rotate, store_kv

LOG2E = 1.4426950408889634
MAX_SPLITS = 16  # a run-time argument below this bound, so a new split count never recompiles


@triton.jit(do_not_specialize=["stride_bt", "batch"])  # both vary step to step
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
    stride_qn, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_on, stride_oh, stride_os, stride_ln, stride_lh, stride_bt,
    scale_log2e, num_splits, batch,
    PAGE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    TOKEN_GRID: tl.constexpr, BLOCK_S: tl.constexpr,
):
    kv_head = tl.program_id(1)
    split = tl.program_id(2) % num_splits
    if TOKEN_GRID:
        # program p takes the p-th query block of the whole batch, the blocks of each sequence in turn (see
        # `TritonAttention.__call__`): its sequence is the number of sequences whose blocks all come before p
        block = tl.program_id(2) // num_splits
        seqs = tl.arange(0, BLOCK_S)
        bounds = tl.load(cu_seqlens_q_ptr + seqs, mask=seqs <= batch, other=0)
        lens = tl.where(seqs < batch, tl.load(cu_seqlens_q_ptr + seqs + 1, mask=seqs < batch, other=0) - bounds, 0)
        blocks = (lens + BLOCK_Q - 1) // BLOCK_Q
        seq = tl.sum((tl.cumsum(blocks, 0) <= block).to(tl.int32), 0)
        if seq >= batch:  # beyond the batch's blocks (the grid is an upper bound)
            return
        q_block = block - tl.sum(tl.where(seqs < seq, blocks, 0), 0)
    else:
        seq = tl.program_id(0)
        q_block = tl.program_id(2) // num_splits

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:  # an empty sequence's program (decode grid: one program per sequence)
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - q_len

    rows = tl.arange(0, BLOCK_R)  # row r = query token r // GROUP, query head kv_head * GROUP + r % GROUP
    token = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
    query_pos = cached + token  # causal alignment to the end of the sequence
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qn + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # Keys this block can see, cut into num_splits ranges of whole BLOCK_N tiles.
    kv_end = tl.minimum(seq_len, cached + (q_block + 1) * BLOCK_Q)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), num_splits)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(kv_end, lo + tiles_per_split * BLOCK_N)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        key = start + tl.arange(0, BLOCK_N)
        key_ok = key < hi
        page = tl.load(block_tables_ptr + seq * stride_bt + key // PAGE, mask=key_ok, other=0).to(tl.int64)
        in_page = key % PAGE
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + (page * stride_kb + in_page * stride_ks + kv_head * stride_kh)[:, None]
                    + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + (page * stride_vb + in_page * stride_vs + kv_head * stride_vh)[:, None]
                    + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale_log2e
        visible = key_ok[None, :] & (key[None, :] <= query_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet stay at zero
        p = tl.exp2(s - m_safe[:, None])
        rescale = tl.exp2(m_i - m_safe)
        l_i = l_i * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    out_ptrs = out_ptr + q_rows[:, None] * stride_on + head[:, None] * stride_oh + split * stride_os + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    if num_splits > 1:  # log2-sum-exp of this split's scores; -inf marks an empty split
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(lse_ptr + q_rows * stride_ln + head * stride_lh + split, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, stride_pn, stride_ph, stride_ps, stride_ln, stride_lh, stride_on, stride_oh,
    num_splits, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + token * stride_ln + head * stride_lh + splits, mask=splits < num_splits,
                  other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # every token has at least one non-empty split
    mask = (splits < num_splits)[:, None] & (dims < HEAD_DIM)[None, :]
    part = tl.load(part_ptr + token * stride_pn + head * stride_ph + splits[:, None] * stride_ps + dims[None, :],
                   mask=mask, other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + token * stride_on + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@triton.jit
def _short_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cos_ptr, sin_ptr, length, first,
    stride_qb, stride_ql, stride_qh, stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
    stride_ob, stride_ol, stride_oh, stride_c, scale_log2e,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
    HAS_ROPE: tl.constexpr, PRECISION: tl.constexpr,
):
    # One program per (sequence, kv head): all of its GROUP query heads x L tokens are the rows of one tile, its
    # L keys one tile, so softmax needs no online rescaling and every byte is read once.
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, GROUP * BLOCK_L)  # row r: query head kv_head * GROUP + r // BLOCK_L, token r % BLOCK_L
    token = rows % BLOCK_L
    head = kv_head * GROUP + rows // BLOCK_L
    dims = tl.arange(0, BLOCK_D)
    row_mask = (token < length)[:, None] & (dims < HEAD_DIM)[None, :]
    q_rows = q_ptr + b * stride_qb + token[:, None] * stride_ql + head[:, None] * stride_qh
    q = tl.load(q_rows + dims[None, :], mask=row_mask, other=0.0)
    keys = tl.arange(0, BLOCK_L)
    key_ok = keys < length
    key_mask = key_ok[:, None] & (dims < HEAD_DIM)[None, :]
    k_rows = k_ptr + b * stride_kb + keys[:, None] * stride_kl + kv_head * stride_kh
    k = tl.load(k_rows + dims[None, :], mask=key_mask, other=0.0)
    if HAS_ROPE:  # token t at position t: the values `rope_` would have stored, in registers
        q = _rotated(q, q_rows, token, dims, row_mask, cos_ptr, sin_ptr, stride_c, HEAD_DIM)
        k = _rotated(k, k_rows, keys, dims, key_mask, cos_ptr, sin_ptr, stride_c, HEAD_DIM)
    v = tl.load(v_ptr + b * stride_vb + keys[:, None] * stride_vl + kv_head * stride_vh + dims[None, :],
                mask=key_mask, other=0.0)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale_log2e
    s = tl.where(key_ok[None, :], s, float("-inf"))
    p = tl.exp2(s - tl.max(s, 1)[:, None])
    out = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION) / tl.sum(p, 1)[:, None]
    # only the queries from token `first` on are kept, at out rows token - first (the others are keys only)
    tl.store(out_ptr + b * stride_ob + (token - first)[:, None] * stride_ol + head[:, None] * stride_oh
             + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask & (token >= first)[:, None])


@triton.jit
def _rotated(x, row_ptrs, token, dims, mask, cos_ptr, sin_ptr, stride_c, HEAD_DIM: tl.constexpr):
    """Tile x (loaded from row_ptrs + dims; row r holds a head of token token[r]) rotated by RoPE as `rope_`
    rotates it: fp32, rounded back to x's dtype. rotate_half's operand is the other half of the same row, loaded
    again (the dot needs whole rows in one tile; the second load hits the cache)."""
    first = dims < HEAD_DIM // 2
    other_half = tl.where(first, dims + HEAD_DIM // 2, dims - HEAD_DIM // 2)
    partner = tl.load(row_ptrs + other_half[None, :], mask=mask, other=0.0).to(tl.float32)
    table = token[:, None] * stride_c + dims[None, :]
    cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
    return rope_f32(x.to(tl.float32), tl.where(first[None, :], -partner, partner), cos, sin).to(x.dtype)


MAX_SHORT_ROWS = 256  # query heads per kv head x padded tokens in one tile (registers bound it)


def short_attention_fits(q: Tensor, k: Tensor) -> bool:
    """Whether `short_attention` takes these shapes: q [B, L, Hq, D], k [B, L, Hkv, D] with few tokens."""
    group = q.shape[2] // k.shape[2]
    return q.shape[2] % k.shape[2] == 0 and group * max(16, _next_pow2(q.shape[1])) <= MAX_SHORT_ROWS


def short_attention(q: Tensor, k: Tensor, v: Tensor, rope: tuple[Tensor, Tensor] | None = None,
                    last: int | None = None) -> Tensor:
    """Bidirectional attention (GQA, scale 1/sqrt(D)) over sequences of a few tokens, one launch: q [B, L, Hq, D],
    k/v [B, L, Hkv, D], any strides with unit stride in D (views of a fused qkv output work). Returns [B, L, Hq, D],
    or with `last` the last `last` tokens' outputs only, [B, last, Hq, D] (every token is still a key).
    rope: (cos, sin) fp32 [L, D] to rotate q and k by as they are loaded (rotate-half, token t at row t; q and k
    are not written): the same result, bit for bit, as `rope_` on q and k before a call without it.

    torch's SDPA pads such short sequences into 64-128-row tiles: nearly all of its work there is padding."""
    b, length, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    if not short_attention_fits(q, k) or min(t.stride(-1) for t in (q, k, v)) != 1:
        raise ValueError(f"short_attention: unsupported shapes q {tuple(q.shape)}, k {tuple(k.shape)}")
    if rope is not None and (rope[0].shape != (length, head_dim) or rope[1].shape != rope[0].shape or head_dim % 2):
        raise ValueError(f"short_attention: rope needs cos/sin [L, D] with D even (got {tuple(rope[0].shape)} "
                         f"for q {tuple(q.shape)})")
    kept = length if last is None else last
    if not 1 <= kept <= length:
        raise ValueError(f"short_attention: last={last} outside 1..{length}")
    cos, sin = (q, q) if rope is None else (t.float().contiguous() for t in rope)  # unused pointers without rope
    out = torch.empty(b, kept, q_heads, head_dim, device=q.device, dtype=q.dtype)
    if out.numel():
        block_l = max(16, _next_pow2(length))  # tl.dot needs 16 rows/columns
        group = q_heads // kv_heads
        _short_attention_kernel[(b, kv_heads)](
            q, k, v, out, cos, sin, length, length - kept, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *out.stride()[:3], cos.stride(0), LOG2E / math.sqrt(head_dim), GROUP=group, HEAD_DIM=head_dim,
            BLOCK_D=_next_pow2(max(16, head_dim)), BLOCK_L=block_l, HAS_ROPE=rope is not None,
            PRECISION=dot_precision(q), num_warps=4 if group * block_l <= 64 else 8)
    return out


@triton.jit
def _rope_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_c,
    stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch, q_heads, kv_heads,
    PAGE: tl.constexpr, HALF: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, HAS_ROPE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if HAS_ROPE:  # q and k in place, as `rope_` rotates them
        rope_heads_(q_ptr + token * stride_qn, stride_qh, q_heads, cos_ptr + token * stride_c,
                    sin_ptr + token * stride_c, HALF, BLOCK_Q)
        k1, k2 = rope_heads_(k_ptr + token * stride_kn, stride_kh, kv_heads, cos_ptr + token * stride_c,
                             sin_ptr + token * stride_c, HALF, BLOCK_KV)
    else:
        k1, k2 = _load_halves(k_ptr + token * stride_kn, stride_kh, kv_heads, HALF, BLOCK_KV)
    v1, v2 = _load_halves(v_ptr + token * stride_vn, stride_vh, kv_heads, HALF, BLOCK_KV)
    slot = tl.load(slot_ptr + token)
    h = tl.arange(0, BLOCK_KV)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < kv_heads
    k_dst = k_cache_ptr + (slot // PAGE) * stride_kb + (slot % PAGE) * stride_ks + h * stride_kch + d
    v_dst = v_cache_ptr + (slot // PAGE) * stride_vb + (slot % PAGE) * stride_vs + h * stride_vch + d
    tl.store(k_dst, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)  # cast from k's dtype, as store_kv does
    tl.store(k_dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_halves(x_ptr, stride_h, heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """The two halves ([BLOCK_H, HALF] each) of the `heads` heads of one token at x_ptr."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    first = x_ptr + h * stride_h + d
    return tl.load(first, mask=h < heads, other=0.0), tl.load(first + HALF, mask=h < heads, other=0.0)


def rope_store_fits(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether `rope_store_kv_` takes these: q [N, Hq, D], k/v [N, Hkv, D], caches [blocks, page, Hkv, D], D a power
    of two, every tensor with unit stride in D."""
    n, _, d = q.shape
    return (k.shape == v.shape == (n, *k_cache.shape[2:]) and k_cache.shape == v_cache.shape and k.shape[2] == d
            and d >= 2 and not d & (d - 1) and all(t.stride(-1) == 1 for t in (q, k, v, k_cache, v_cache)))


def rope_store_kv_(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                   rope: tuple[Tensor, Tensor] | None) -> None:
    """One launch for one layer's N new tokens: rotate q and k in place by `rope` ((cos, sin) fp32 [N, D], a row per
    token; None: no RoPE, as in VoxCPM2's residual LM), then write k and v at their paged-cache slots
    (slot_mapping [N]), cast to the caches' dtype: the values of `rope_` on q and k followed by `store_kv`.
    CUDA-graph capturable: the grid is N, the slots are read in-kernel. Shapes: see `rope_store_fits`."""
    n, q_heads, head_dim = q.shape
    if not rope_store_fits(q, k, v, k_cache, v_cache) or slot_mapping.shape != (n,):
        raise ValueError(f"rope_store_kv_: unsupported shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"caches {tuple(k_cache.shape)}, slots {tuple(slot_mapping.shape)}")
    if rope is not None and (rope[0].shape != (n, head_dim) or rope[1].shape != rope[0].shape):
        raise ValueError(f"rope_store_kv_: rope needs cos/sin [N, D] (got {tuple(rope[0].shape)} for q "
                         f"{tuple(q.shape)})")
    cos, sin = (q, q) if rope is None else (t.float().contiguous() for t in rope)  # unused pointers without rope
    if n:
        kv_heads = k.shape[1]
        _rope_store_kv_kernel[(n,)](
            q, k, v, cos, sin, slot_mapping, k_cache, v_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), cos.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3], q_heads,
            kv_heads, PAGE=k_cache.shape[1], HALF=head_dim // 2, BLOCK_Q=_next_pow2(q_heads),
            BLOCK_KV=_next_pow2(kv_heads), HAS_ROPE=rope is not None, num_warps=4)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TritonAttention:
    """`AttentionBackend` over the paged cache with Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1).

    A call (or a captured graph) is right for any sequence lengths and block tables, as long as no sequence has more
    new tokens than meta.max_seqlen_q: that sets the grid. max_seqlen_k only tunes the KV split count.
    num_splits: KV splits for pure-decode batches; None picks them from the batch size and the GPU's SM count.
    """

    def __init__(self, num_splits: int | None = None, block_n: int = 64, rows_per_program: int | None = None):
        if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in 1..{MAX_SPLITS} (got {num_splits})")
        self.num_splits, self.block_n, self.rows_per_program = num_splits, block_n, rows_per_program

    def rows_for(self, tokens: int, batch: int, kv_heads: int, group: int, meta: AttentionMetadata,
                 device: torch.device) -> int:
        """Query rows (query heads x tokens) per program of a step with prefill chunks: rows_per_program if set,
        else the largest tile that the sequences' mean length fills and that still gives every SM a program. Each
        program reads its keys once, so larger tiles read the cache fewer times (a burst of 64 prompts runs fastest
        at 256 rows: bench/kernels_bench.py --only-prefill). Decode
        rows beside prompts keep small tiles: a program computes its whole tile, filled or not. From host ints only
        (`tokens` is the flat batch's length), so a graph bucket always gets the same tile."""
        if self.rows_per_program is not None:
            return self.rows_per_program
        if meta.query_rows is not None:
            return meta.query_rows
        # CPU tensors (the interpreter tests) plan as an H200's 132 SMs
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        for rows in PREFILL_ROWS[:-1]:
            per_program = rows // group
            if (per_program and batch * per_program <= tokens
                    and batch * kv_heads * triton.cdiv(meta.max_seqlen_q, per_program) >= sms):
                return rows
        return PREFILL_ROWS[-1]

    def splits_for(self, batch: int, kv_heads: int, meta: AttentionMetadata, device: torch.device) -> int:
        """KV splits for this call; host ints only, so the choice is fixed per CUDA-graph bucket."""
        if meta.max_seqlen_q != 1:
            return 1
        if self.num_splits is not None:
            return self.num_splits
        if device.type != "cuda":
            return 1
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        by_occupancy = (2 * sms) // max(1, batch * kv_heads)
        by_length = math.ceil(meta.max_seqlen_k / 128)  # keep at least ~128 keys per split
        return max(1, min(MAX_SPLITS, by_occupancy, by_length))

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                 rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        num_blocks, page, kv_heads, head_dim = k_cache.shape
        q = rope_and_store_kv(q, k, v, k_cache, v_cache, meta, rope)

        n, q_heads, _ = q.shape
        if q.stride(-1) != 1:
            q = q.contiguous()
        group = q_heads // kv_heads
        batch = meta.block_tables.shape[0]
        block_q = 1
        if meta.max_seqlen_q > 1:
            block_q = max(1, self.rows_for(n, batch, kv_heads, group, meta, q.device) // group)
        block_r = _next_pow2(max(16, block_q * group))  # tl.dot needs at least 16 rows
        block_d = _next_pow2(max(16, head_dim))
        splits = self.splits_for(batch, kv_heads, meta, q.device)
        # Prefill chunks: a program per query block of the batch (at most n / block_q + batch of them), each finding
        # its sequence in-kernel, so the grid follows the tokens, not sequences x the longest chunk (a graph bucket
        # of many sequences, most of them empty or short, would launch mostly idle programs). Decode: a program per
        # sequence and KV split.
        token_grid = meta.max_seqlen_q > 1
        blocks = triton.cdiv(n, block_q) + batch if token_grid else triton.cdiv(meta.max_seqlen_q, block_q)
        grid = (1 if token_grid else batch, kv_heads, blocks * splits)

        out = torch.empty_like(q)
        if splits == 1:
            part, lse, part_strides, lse_strides = out, out, (out.stride(0), out.stride(1), 0), (0, 0)
        else:
            part = torch.empty(n, q_heads, splits, head_dim, device=q.device, dtype=torch.float32)
            lse = torch.empty(n, q_heads, splits, device=q.device, dtype=torch.float32)
            part_strides, lse_strides = part.stride()[:3], lse.stride()[:2]
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, part, lse, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
            q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            *part_strides, *lse_strides, meta.block_tables.stride(0),
            LOG2E / math.sqrt(head_dim), splits, batch,
            PAGE=page, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_Q=block_q, BLOCK_R=block_r,
            BLOCK_N=self.block_n, num_warps=4 if block_r * block_d <= 64 * 64 else 8,
            PRECISION=dot_precision(q),  # fp32 stays a reference; tf32 is ~1e-3
            # one width for every batch up to 1,023 sequences, so a new batch size never recompiles
            TOKEN_GRID=token_grid, BLOCK_S=max(1024, _next_pow2(batch + 1)) if token_grid else 1,
        )
        if splits > 1:
            _merge_splits_kernel[(n, q_heads)](
                part, lse, out, *part.stride()[:3], *lse.stride()[:2], out.stride(0), out.stride(1),
                splits, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=MAX_SPLITS,
            )
        return out


def rope_and_store_kv(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                      rope: Rope | None) -> Tensor:
    """q rotated by `rope` (None: as it is), after k rotated and v were stored at their paged-cache slots. On CUDA
    one Triton kernel, in place on q and k (`rope_store_kv_`: two or three kernels -> one); elsewhere `apply_rope`
    and `store_kv`."""
    if fusion.fused(q) and rope_store_fits(q, k, v, k_cache, v_cache):
        rope_store_kv_(q, k, v, k_cache, v_cache, meta.slot_mapping, rope)
        return q
    q, k = rotate(q, k, rope)
    store_kv(k, v, k_cache, v_cache, meta)
    return q
