"""VoxCPMModel: both families (VoxCPM-0.5B / 1.5 and VoxCPM2) as one module, minus the AudioVAE.

state_dict names and shapes equal the official model's (without `audio_vae.*`), so released weights load with
`load_state_dict(strict=True)`. The serving loop per step is `forward_lms` (prefill chunks and/or one decode token
per sequence, in one flat batch) -> `sample_patches` -> `stop_flags`. Version switches: v2 fuses the residual input
with `fusion_concat_proj` (v1 adds), feeds the LocDiT two mu tokens (v1 one, summed), and may run the residual LM
without RoPE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import ModelConfig
from engine.model.attention import AttentionBackend, AttentionMetadata, KVCache, TorchAttention
from engine.model.euler import RowSteps
from engine.model.layers import FSQ
from engine.model.local import CFM, LocDiT, LocEnc
from engine.model.lora import LoRAState
from engine.model.minicpm import MiniCPM


class VoxCPMModel(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend | None = None):
        super().__init__()
        self.config = config
        lm = config.lm
        hidden, enc_hidden, dit_hidden = lm.hidden_size, config.encoder.hidden_dim, config.dit.hidden_dim
        self.is_v2 = config.is_v2
        self.attention: AttentionBackend = attention or TorchAttention()
        self.text_scale = lm.scale_emb if lm.use_mup else 1.0

        self.base_lm = MiniCPM(lm, vocab_size=lm.vocab_size)
        self.residual_lm = MiniCPM(config.residual_lm)
        self.feat_encoder = LocEnc(config.encoder_lm, config.feat_dim)
        self.feat_decoder = CFM(LocDiT(config.dit_lm, config.feat_dim, mu_tokens=2 if self.is_v2 else 1),
                                mean_mode=config.dit_mean_mode)
        self.fsq_layer = FSQ(hidden, config.fsq_latent_dim, config.fsq_scale)
        self.enc_to_lm_proj = nn.Linear(enc_hidden, hidden)
        self.lm_to_dit_proj = nn.Linear(hidden, dit_hidden)
        self.res_to_dit_proj = nn.Linear(hidden, dit_hidden)
        if self.is_v2:
            self.fusion_concat_proj = nn.Linear(2 * hidden, hidden)
        self.stop_proj = nn.Linear(hidden, hidden)
        self.stop_head = nn.Linear(hidden, 2, bias=False)
        self.lora: LoRAState | None = None  # batched adapter slots, from engine.model.lora.attach_lora

    def fuse_projections(self) -> None:
        """One GEMM for q/k/v and one for gate/up in every stack, wherever those linears are plain (not LoRA- or
        TP-wrapped). Call after loading weights, before CUDA graph capture; memory and state_dict are unchanged."""
        for stack in (self.base_lm, self.residual_lm, self.feat_encoder.encoder, self.feat_decoder.estimator.decoder):
            stack.fuse_projections()

    def quantize_lms_fp8(self) -> None:
        """FP8 copies of both LMs' plain linear weights, for their large (prefill) GEMMs (`engine.model.fp8`); the
        LocDiT has its own switch (`quantize_dit_fp8`), LocEnc none (its rows are the audio positions alone)."""
        for stack in (self.base_lm, self.residual_lm):
            stack.quantize_fp8()

    def quantize_dit_fp8(self) -> None:
        """FP8 copies of the LocDiT's plain linear weights, for its GEMMs of many rows (`engine.model.fp8`)."""
        self.feat_decoder.estimator.decoder.quantize_fp8()

    def set_lora_indices(self, tokens: Tensor | None = None, seqs: Tensor | None = None) -> None:
        """Adapter slot (0: none) of each flat LM position [N] and each sampled sequence [B] for the coming
        `forward_lms` / `sample_patches`; only the given ones change. No-op without LoRA slots."""
        if self.lora is not None:
            if tokens is not None:
                self.lora.tokens = tokens
            if seqs is not None:
                self.lora.seqs = seqs

    def encode_patches(self, patches: Tensor) -> Tensor:
        """LocEnc + enc_to_lm_proj: [N, P, D] -> [N, H_lm]."""
        return self.enc_to_lm_proj(self.feat_encoder(patches.to(self.enc_to_lm_proj.weight.dtype)))

    def forward_lms(self, token_ids: Tensor, patches: Tensor, audio_mask: Tensor, positions: Tensor,
                    meta: AttentionMetadata, caches: tuple[KVCache, KVCache], last_index: Tensor,
                    audio_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Run both LMs over a flat batch of N positions (any mix of prefill chunks and 1-token decodes).

        token_ids [N] (ignored where audio), patches [N, P, D] (ignored where text), audio_mask [N] (bool or 0/1),
        positions [N] absolute within each sequence. Writes both KV caches. Returns (lm_h, res_h) [B, H] at the
        positions `last_index` [B]: the hidden states each sequence predicts its next patch from.

        LocEnc runs on every position (text rows are discarded): one static shape, no host sync, CUDA-graph safe.
        Callers that know the audio positions on the host (eager prefill steps, mostly text) pass them as
        `audio_rows` [A] and LocEnc runs on those rows only: the same result for a fraction of the work (text
        rows then carry enc_to_lm_proj's bias instead of zeros, which every use below masks out)."""
        n = meta.slot_mapping.shape[0]
        if not (token_ids.shape[0] == patches.shape[0] == audio_mask.shape[0] == positions.shape[0] == n):
            raise ValueError(f"forward_lms: token_ids {tuple(token_ids.shape)}, patches {tuple(patches.shape)}, "
                             f"audio_mask {tuple(audio_mask.shape)}, positions {tuple(positions.shape)} and the "
                             f"metadata's {n} slots must all cover the same N positions")
        if patches.shape[1:] != (self.config.patch_size, self.config.feat_dim):
            raise ValueError(f"forward_lms: patches must be [N, {self.config.patch_size}, {self.config.feat_dim}] "
                             f"(got {tuple(patches.shape)})")
        audio = audio_mask.to(torch.bool)[:, None]
        text = self.base_lm.embed_tokens(token_ids.long())
        if audio_rows is None:
            enc = self.encode_patches(patches)
        else:  # LocEnc on the audio rows; the projection on every row, so LoRA's per-position indices still fit
            dtype = self.enc_to_lm_proj.weight.dtype
            hidden = patches.new_zeros(n, self.enc_to_lm_proj.in_features, dtype=dtype)
            if audio_rows.numel():
                hidden[audio_rows] = self.feat_encoder(patches[audio_rows].to(dtype))
            enc = self.enc_to_lm_proj(hidden)
        if self.text_scale != 1.0:
            text = text * self.text_scale
        h = self.base_lm.forward_paged(torch.where(audio, enc, text), positions, meta, caches[0], self.attention)
        h = torch.where(audio, self.fsq_layer(h), h)
        enc_audio = enc * audio.to(enc.dtype)  # text positions feed the residual LM their LM state alone
        if self.is_v2:
            res_in = self.fusion_concat_proj(torch.cat((h, enc_audio), dim=-1))
        else:
            res_in = h + enc_audio
        r = self.residual_lm.forward_paged(res_in, positions, meta, caches[1], self.attention)
        return h[last_index], r[last_index]

    def sample_patches(self, lm_h: Tensor, res_h: Tensor, cond: Tensor, noise: Tensor, timesteps: int | RowSteps,
                       cfg_value: Tensor) -> Tensor:
        """Next patch of each of B sequences: mu from lm_h/res_h [B, H], CFM Euler solve with CFG-Zero* over LocDiT.

        cond [B, P, D] previous patch (zeros at the first zero-shot step); noise [B, D, P] drawn by the caller like
        the official `randn(b, feat_dim, P) * temperature`; timesteps: one value for every row, or each row's own
        schedule (`engine.model.euler.RowSteps`); cfg_value [B]. Returns patches [B, P, D] fp32."""
        b, p, d = lm_h.shape[0], self.config.patch_size, self.config.feat_dim
        if cond.shape != (b, p, d) or noise.shape != (b, d, p) or cfg_value.shape != (b,):
            raise ValueError(f"sample_patches: for {b} sequences need cond [{b}, {p}, {d}], noise [{b}, {d}, {p}] "
                             f"and cfg_value [{b}] (got {tuple(cond.shape)}, {tuple(noise.shape)}, "
                             f"{tuple(cfg_value.shape)})")
        if isinstance(timesteps, int):
            timesteps = self.feat_decoder.uniform_steps(timesteps, b, lm_h.device)
        elif timesteps.index.shape[0] != b or timesteps.dt.shape != timesteps.index.shape:
            raise ValueError(f"sample_patches: for {b} sequences need RowSteps index and dt [{b}, W] (got "
                             f"{tuple(timesteps.index.shape)}, {tuple(timesteps.dt.shape)})")
        return self.continue_patches(lm_h, res_h, cond, noise.transpose(1, 2), timesteps, cfg_value)

    def continue_patches(self, lm_h: Tensor, res_h: Tensor, cond: Tensor, x: Tensor, steps: RowSteps,
                         cfg_value: Tensor) -> Tensor:
        """`sample_patches` from the solver state x [B, P, D] (the noise, or what earlier evaluations of the same
        solve left) through the evaluations `steps` lists: a solve split in two parts gives the patches of one."""
        if self.lora is not None:
            self.lora.begin_sampling()
        lm_mu, res_mu = self.lm_to_dit_proj(lm_h), self.res_to_dit_proj(res_h)
        mu = torch.stack((lm_mu, res_mu), dim=1) if self.is_v2 else (lm_mu + res_mu)[:, None]
        return self.feat_decoder.solve(x, mu, cond, steps, cfg_value)

    def stop_flags(self, lm_h: Tensor) -> Tensor:
        """bool [B]: the stop head's argmax is 1."""
        return self.stop_head(F.silu(self.stop_proj(lm_h))).argmax(dim=-1) == 1
