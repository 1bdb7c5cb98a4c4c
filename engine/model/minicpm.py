"""The MiniCPM transformer stack: the one block behind the base LM, residual LM, LocEnc and LocDiT.

Pre-RMSNorm, GQA attention with LongRoPE (optional), SwiGLU MLP, no biases, final norm, no LM head. How attention
is done is the caller's: the LMs run a flat batch over the paged KV cache, the local stacks dense bidirectional.
Every residual add runs together with the norm that follows it (the post-attention norm, the next layer's input
norm or the final norm): one Triton kernel per add on CUDA; elsewhere the official code's eager ops, in its order.
RoPE: the layers apply it before attention; on CUDA attention gets the cos/sin tables instead and its Triton
kernels rotate q and k themselves (dense: as the short attention kernel loads them; paged: in the kernel that stores
K/V), one launch less per layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import Tensor, nn

from engine.config import StackConfig
from engine.model import fp8, fusion
from engine.model.attention import AttentionBackend, AttentionMetadata, KVCache, dense_attention
from engine.model.layers import LongRoPE, RMSNorm, SwiGLU, apply_rope, fuse_linears, fused_linear, fused_weight

# Dense stacks with fewer sequences than this rotate q|k with the rope_ kernel first: at a few sequences the rotation
# inside the short attention kernel costs more than the launch it saves; at hundreds it saves more
# (bench/kernels_bench.py). Break-even not
# measured between; the batch is a host int, so each CUDA graph bucket takes one path.
DENSE_ROPE_IN_ATTENTION_MIN_SEQS = 64

# attend(layer_index, q [..., Hq, D], k [..., Hkv, D], v) -> [..., Hq, D] (dense stacks: of the kept tokens)
Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]


class Attention(nn.Module):
    def __init__(self, stack: StackConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = stack.num_attention_heads, stack.num_key_value_heads, stack.head_dim
        self.q_proj = nn.Linear(stack.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(stack.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(stack.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, stack.hidden_size, bias=False)
        self.qkv: Tensor | None = None  # from `fuse`
        self.qkv8: fp8.Fp8Weight | None = None  # from `quantize_fp8`
        self.o8: fp8.Fp8Weight | None = None

    def fuse(self) -> None:
        """Run q/k/v as one GEMM (and rotate q and k together) from now on, when they are plain linears."""
        self.qkv = fuse_linears((self.q_proj, self.k_proj, self.v_proj))

    def quantize_fp8(self) -> None:
        """Keep FP8 copies of the weights for large GEMMs (`engine.model.fp8`)."""
        self.qkv8 = fp8.quantized((self.q_proj, self.k_proj, self.v_proj))
        self.o8 = fp8.quantized((self.o_proj,))

    def forward(self, x: Tensor | fp8.Fp8Rows, rope: tuple[Tensor, Tensor] | None, attend: Attend,
                layer: int) -> Tensor:
        """x [..., H], or rows already quantized for `qkv8` (from the norm before, `RMSNorm.add_and_norm`)."""
        shape = x.shape[:-1]
        qkv_out = fp8.linear(x, self.qkv8)
        qkv = None if qkv_out is not None else fused_weight(self.qkv, (self.q_proj, self.k_proj, self.v_proj))
        if qkv_out is None and qkv is None:
            q = self.q_proj(x).view(*shape, self.heads, self.head_dim)
            k = self.k_proj(x).view(*shape, self.kv_heads, self.head_dim)
            v = self.v_proj(x).view(*shape, self.kv_heads, self.head_dim)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        else:
            heads = self.heads + self.kv_heads
            if qkv_out is None:
                qkv_out = fused_linear(x, qkv, (self.q_proj, self.k_proj, self.v_proj))
            qkv_out = qkv_out.view(*shape, heads + self.kv_heads, self.head_dim)
            qk, v = qkv_out[..., :heads, :], qkv_out[..., heads:, :]
            if rope is not None:
                qk = apply_rope(qk, *rope)
            q, k = qk[..., :self.heads, :], qk[..., self.heads:, :]
        attended = attend(layer, q, k, v)
        attended = attended.reshape(*attended.shape[:-2], self.heads * self.head_dim)
        out = fp8.linear(attended, self.o8)
        return self.o_proj(attended) if out is None else out


class DecoderLayer(nn.Module):
    def __init__(self, stack: StackConfig):
        super().__init__()
        self.self_attn = Attention(stack)
        self.mlp = SwiGLU(stack.hidden_size, stack.intermediate_size)
        self.input_layernorm = RMSNorm(stack.hidden_size, stack.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(stack.hidden_size, stack.rms_norm_eps)
        # muP scales each residual branch by scale_depth / sqrt(this stack's own layer count)
        self.branch_scale = stack.scale_depth / math.sqrt(stack.num_hidden_layers) if stack.use_mup else None

    def forward(self, x: Tensor, branch: Tensor | None, rope: tuple[Tensor, Tensor] | None, attend: Attend,
                layer: int, keep_last: int | None = None) -> tuple[Tensor, Tensor]:
        """The residual stream x, with the previous layer's MLP `branch` still to be added (None in the first layer),
        through this layer -> (x, this layer's MLP branch, still to be added). Each add is done with the norm after
        it (`RMSNorm.add_and_norm`: one kernel on CUDA); the stack adds the last branch with its final norm.
        `keep_last` (dense [B, L, H] only, with an `attend` that returns those tokens): every token is a key, but
        only the last `keep_last` go on through o_proj and the MLP, and out."""
        x, normed = self.input_layernorm.add_and_norm(x, branch, self.branch_scale, fp8_for=self.self_attn.qkv8)
        h = self.self_attn(normed, rope, attend, layer)
        if keep_last is not None:
            x = x[:, -keep_last:]
        x, normed = self.post_attention_layernorm.add_and_norm(x, h, self.branch_scale, fp8_for=self.mlp.gate_up8)
        return x, self.mlp(normed)


class MiniCPM(nn.Module):
    """One stack. `embed_tokens` exists only when the stack has a vocabulary (the base LM)."""

    def __init__(self, stack: StackConfig, vocab_size: int = 0):
        super().__init__()
        if vocab_size:
            self.embed_tokens = nn.Embedding(vocab_size, stack.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(stack) for _ in range(stack.num_hidden_layers))
        self.norm = RMSNorm(stack.hidden_size, stack.rms_norm_eps)
        self.rope = None if stack.no_rope else LongRoPE(stack)

    def fuse_projections(self) -> None:
        """One GEMM for q/k/v and one for gate/up in every layer whose linears are plain (see `fuse_linears`)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def quantize_fp8(self) -> None:
        """FP8 copies of every layer's plain linears, used by GEMMs of many rows (`engine.model.fp8`)."""
        for layer in self.layers:
            layer.self_attn.quantize_fp8()
            layer.mlp.quantize_fp8()

    def run(self, x: Tensor, rope: tuple[Tensor, Tensor] | None, attend: Attend, keep_last: int | None = None
            ) -> Tensor:
        """x through every layer; `rope` (cos, sin) computed once for the whole stack (or None without RoPE);
        `keep_last`: the last layer carries only the last tokens on (`DecoderLayer.forward`)."""
        branch = None  # a layer's MLP output: the next layer adds it together with its input norm
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, branch = layer(x, branch, rope, attend, i, keep_last if i == last else None)
        return self.norm.add_and_norm(x, branch, self.layers[-1].branch_scale)[1]

    def forward_paged(self, x: Tensor, positions: Tensor, meta: AttentionMetadata, cache: KVCache,
                      backend: AttentionBackend) -> Tensor:
        """Causal flat batch: x [N, H], positions [N] absolute; writes this step's K/V into `cache`.
        On CUDA the backend rotates q and k in the kernel that stores K/V (no RoPE launch of its own)."""
        rope = None if self.rope is None else self.rope(positions)
        if fusion.fused(x):
            return self.run(x, None, lambda i, q, k, v: backend(q, k, v, cache.k[i], cache.v[i], meta, rope))
        return self.run(x, rope, lambda i, q, k, v: backend(q, k, v, cache.k[i], cache.v[i], meta))

    def forward_dense(self, x: Tensor, keep_last: int | None = None) -> Tensor:
        """Bidirectional, no cache: x [B, L, H] at positions 0..L-1 (the RoPE table is cached per L) -> [B, L, H], or
        with `keep_last` the last keep_last tokens' outputs, [B, keep_last, H]: the last layer's attention then
        queries for those only, and its o_proj and MLP run on them only. The LocDiT reads its last P tokens: 7 of
        VoxCPM2's 11 rows skipped in the last layer, ~4.5% of its GEMM work.
        On CUDA the attention kernel rotates q and k as it loads them (no RoPE launch of its own),
        from `DENSE_ROPE_IN_ATTENTION_MIN_SEQS` sequences on."""
        rope = None if self.rope is None else self.rope.prefix(x.shape[1], x.device)
        last_layer = len(self.layers) - 1
        in_kernel = fusion.fused(x) and x.shape[0] >= DENSE_ROPE_IN_ATTENTION_MIN_SEQS

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return dense_attention(q, k, v, rope if in_kernel else None, keep_last if i == last_layer else None)

        return self.run(x, None if in_kernel else rope, attend, keep_last)
