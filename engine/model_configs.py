"""Release-size and tiny model configs for the VoxCPM family, as `config.json` dicts.

Release sizes follow the official configs (VoxCPM2's is the published file). The tiny configs keep every
structural feature of their family (GQA, LongRoPE, v2's asymmetric VAE, no-RoPE residual LM) at sizes that run in
milliseconds on a CPU; tests and the demo server use them.
"""

from __future__ import annotations

import copy
from typing import Any

# LongRoPE short factors of the releases (head dim 128 -> 64 factors); VoxCPM2's published config.
_V2_FACTORS = [
    0.9977997200264581, 1.014658295992452, 1.0349680404997148, 1.059429246056193, 1.0888815016813513,
    1.1243301355211495, 1.166977103606075, 1.2182568066927284, 1.2798772354275727, 1.3538666751582975,
    1.4426259039919596, 1.5489853358570191, 1.6762658237220625, 1.8283407612492941, 2.0096956085876183,
    2.225478927469756, 2.481536379650452, 2.784415934557119, 3.1413289096347365, 3.560047844772632,
    4.048719380066383, 4.615569542115128, 5.2684819496549835, 6.014438591970396, 6.858830049237097,
    7.804668263503327, 8.851768731513417, 9.99600492938444, 11.228766118181639, 12.536757560834843,
    13.902257701387796, 15.303885189125953, 16.717837610115794, 18.119465097853947, 19.484965238406907,
    20.792956681060105, 22.02571786985731, 23.16995406772833, 24.217054535738416, 25.16289275000465,
    26.007284207271347, 26.753240849586767, 27.40615325712662, 27.973003419175363, 28.461674954469114,
    28.880393889607006, 29.237306864684626, 29.540186419591297, 29.79624387177199, 30.01202719065413,
    30.193382037992453, 30.34545697551969, 30.47273746338473, 30.579096895249787, 30.66785612408345,
    30.741845563814174, 30.80346599254902, 30.85474569563567, 30.897392663720595, 30.932841297560394,
    30.962293553185553, 30.986754758742034, 31.007064503249293, 31.02392307921529,
]


def _factors(n: int) -> list[float]:
    """n LongRoPE-like factors rising from ~1 to ~31 (the release curve, resampled)."""
    return [_V2_FACTORS[min(len(_V2_FACTORS) - 1, round(i * (len(_V2_FACTORS) - 1) / max(1, n - 1)))]
            for i in range(n)]


def _lm(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, vocab: int, head_dim: int,
        kv_channels: int | None = None) -> dict[str, Any]:
    f = _factors(head_dim // 2)
    lm = {
        "bos_token_id": 1, "eos_token_id": 2, "hidden_size": hidden, "intermediate_size": ffn,
        "max_position_embeddings": 32768, "num_attention_heads": heads, "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5, "rope_theta": 10000,
        "rope_scaling": {"type": "longrope", "original_max_position_embeddings": 32768,
                         "short_factor": f, "long_factor": list(f)},
        "vocab_size": vocab, "use_mup": False, "scale_emb": 12, "dim_model_base": 256, "scale_depth": 1.4,
    }
    if kv_channels is not None:
        lm["kv_channels"] = kv_channels
    return lm


def _cfm() -> dict[str, Any]:
    return {"sigma_min": 1e-6, "solver": "euler", "t_scheduler": "log-norm", "inference_cfg_rate": 2.0}


def voxcpm2() -> dict[str, Any]:
    """VoxCPM2 (2.29B + 94M VAE), as published."""
    return {
        "architecture": "voxcpm2",
        "lm_config": _lm(2048, 6144, 28, 16, 2, 73448, 128, kv_channels=128),
        "patch_size": 4, "feat_dim": 64, "scalar_quantization_latent_dim": 512, "scalar_quantization_scale": 9,
        "residual_lm_num_layers": 8, "residual_lm_no_rope": True,
        "encoder_config": {"hidden_dim": 1024, "ffn_dim": 4096, "num_heads": 16, "num_layers": 12, "kv_channels": 128},
        "dit_config": {"hidden_dim": 1024, "ffn_dim": 4096, "num_heads": 16, "num_layers": 12, "kv_channels": 128,
                       "dit_mean_mode": False, "cfm_config": _cfm()},
        "audio_vae_config": {"encoder_dim": 128, "encoder_rates": [2, 5, 8, 8], "latent_dim": 64,
                             "decoder_dim": 2048, "decoder_rates": [8, 6, 5, 2, 2, 2],
                             "sr_bin_boundaries": [20000, 30000, 40000], "sample_rate": 16000,
                             "out_sample_rate": 48000},
        "max_length": 8192, "dtype": "bfloat16",
    }


def voxcpm15() -> dict[str, Any]:
    """VoxCPM1.5 (802M + 87M VAE, 44.1 kHz)."""
    return {
        "architecture": "voxcpm",
        "lm_config": _lm(1024, 4096, 24, 16, 2, 73448, 64),
        "patch_size": 4, "feat_dim": 64, "scalar_quantization_latent_dim": 256, "scalar_quantization_scale": 9,
        "residual_lm_num_layers": 8,
        "encoder_config": {"hidden_dim": 1024, "ffn_dim": 4096, "num_heads": 16, "num_layers": 8},
        "dit_config": {"hidden_dim": 1024, "ffn_dim": 4096, "num_heads": 16, "num_layers": 8,
                       "cfm_config": _cfm()},
        "audio_vae_config": {"encoder_dim": 64, "encoder_rates": [2, 3, 6, 7, 7], "latent_dim": 64,
                             "decoder_dim": 2048, "decoder_rates": [7, 7, 6, 3, 2], "sample_rate": 44100},
        "max_length": 4096, "dtype": "bfloat16",
    }


def voxcpm05b() -> dict[str, Any]:
    """VoxCPM-0.5B (652M + 75M VAE, 16 kHz)."""
    return {
        "architecture": "voxcpm",
        "lm_config": _lm(1024, 4096, 24, 16, 2, 73448, 64),
        "patch_size": 2, "feat_dim": 64, "scalar_quantization_latent_dim": 256, "scalar_quantization_scale": 9,
        "residual_lm_num_layers": 6,
        "encoder_config": {"hidden_dim": 1024, "ffn_dim": 4096, "num_heads": 16, "num_layers": 4},
        "dit_config": {"hidden_dim": 1024, "ffn_dim": 4096, "num_heads": 16, "num_layers": 4,
                       "cfm_config": _cfm()},
        "audio_vae_config": {"encoder_dim": 128, "encoder_rates": [2, 5, 8, 8], "latent_dim": 64,
                             "decoder_dim": 1536, "decoder_rates": [8, 8, 5, 2], "sample_rate": 16000},
        "max_length": 4096, "dtype": "bfloat16",
    }


def tiny(architecture: str = "voxcpm2", vocab_size: int = 512) -> dict[str, Any]:
    """A ~1 MB model of either family with every structural feature of the release.

    The VAE keeps the release rates (so audio timing is real: 160 ms / 80 ms per patch) at tiny widths."""
    v2 = architecture == "voxcpm2"
    kv = 16 if v2 else None  # v2 sets kv_channels explicitly, v1 derives head dim from hidden/heads
    local = {"hidden_dim": 64, "ffn_dim": 128, "num_heads": 4, "num_layers": 2}
    if kv:
        local["kv_channels"] = kv
    cfg: dict[str, Any] = {
        "architecture": architecture,
        "lm_config": _lm(64, 128, 2, 4, 2, vocab_size, 16, kv_channels=kv),
        "patch_size": 4 if v2 else 2, "feat_dim": 64,
        "scalar_quantization_latent_dim": 16, "scalar_quantization_scale": 9,
        "residual_lm_num_layers": 2,
        "encoder_config": dict(local),
        "dit_config": {**local, "cfm_config": _cfm()},
        "max_length": 512, "dtype": "float32",
    }
    if v2:
        cfg["residual_lm_no_rope"] = True
        cfg["dit_config"]["dit_mean_mode"] = False
        cfg["audio_vae_config"] = {"encoder_dim": 4, "encoder_rates": [2, 5, 8, 8], "latent_dim": 64,
                                   "decoder_dim": 64, "decoder_rates": [8, 6, 5, 2, 2, 2],
                                   "sr_bin_boundaries": [20000, 30000, 40000], "sample_rate": 16000,
                                   "out_sample_rate": 48000}
    else:
        cfg["audio_vae_config"] = {"encoder_dim": 4, "encoder_rates": [2, 5, 8, 8], "latent_dim": 64,
                                   "decoder_dim": 32, "decoder_rates": [8, 8, 5, 2], "sample_rate": 16000}
    return copy.deepcopy(cfg)


RELEASES = {"voxcpm2": voxcpm2, "voxcpm1.5": voxcpm15, "voxcpm-0.5b": voxcpm05b}
