"""The official `voxcpm` package as a test oracle: build its models from our config dicts, share weights, inject noise.

Everything here runs the official code in-process on CPU in float32; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn


def tiny_tokenizer(vocab_size: int = 512) -> Any:
    """A word-level PreTrainedTokenizerFast ("w3" .. "wN") the official model accepts; our model never tokenizes.

    Imports are local so this module (and `randomize_`) also loads where the oracle's dependencies are absent."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def official_model(cfg: dict[str, Any], seed: int = 0) -> nn.Module:
    """The official VoxCPM2Model / VoxCPMModel built from a release-layout config dict, float32 on CPU."""
    from voxcpm.model.voxcpm import VoxCPMConfig as V1Config
    from voxcpm.model.voxcpm import VoxCPMModel as V1Model
    from voxcpm.model.voxcpm2 import VoxCPM2Model
    from voxcpm.model.voxcpm2 import VoxCPMConfig as V2Config
    from voxcpm.modules.audiovae import AudioVAE, AudioVAEConfig, AudioVAEConfigV2, AudioVAEV2

    v2 = cfg.get("architecture", "voxcpm") == "voxcpm2"
    cfg = {**cfg, "dtype": "float32"}
    torch.manual_seed(seed)
    with contextlib.redirect_stderr(io.StringIO()):  # it prints the device and dtype it picked
        if v2:
            vae = AudioVAEV2(AudioVAEConfigV2.model_validate(cfg["audio_vae_config"]))
            model = VoxCPM2Model(V2Config.model_validate(cfg), tiny_tokenizer(cfg["lm_config"]["vocab_size"]),
                                 vae, device="cpu")
        else:
            vae = AudioVAE(AudioVAEConfig.model_validate(cfg["audio_vae_config"]))
            model = V1Model(V1Config.model_validate(cfg), tiny_tokenizer(cfg["lm_config"]["vocab_size"]),
                            vae, device="cpu")
    randomize_(model, seed)
    return model.eval()


def randomize_(model: nn.Module, seed: int) -> None:
    """Random weights at a scale that keeps activations O(1): RMSNorm weights near 1, everything else small.

    Freshly built modules have ones for norms and PyTorch's default init elsewhere; perturbing all of them makes
    every weight matter, so a wrong name or layout cannot pass unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("audio_vae."):
                continue
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() >= 2 and "embed_tokens" not in name and name != "feat_encoder.special_token":
                p.copy_(noise / p.shape[-1] ** 0.5)
            else:
                p.copy_(0.5 * noise)


def main_state_dict(official: nn.Module) -> dict[str, Tensor]:
    """The official state_dict without the AudioVAE (the part our VoxCPMModel holds)."""
    return {k: v for k, v in official.state_dict().items() if not k.startswith("audio_vae.")}


def copy_weights(official: nn.Module, ours: nn.Module) -> None:
    """Official -> ours with a strict load: every name and shape must match exactly."""
    ours.load_state_dict(main_state_dict(official), strict=True)


@contextlib.contextmanager
def injected_noise(official: nn.Module, noises: list[Tensor]) -> Iterator[None]:
    """Make the official CFM take its initial noise z from `noises` (in order) instead of torch.randn.

    Mirrors UnifiedCFM.forward exactly except for the random draw; each z is [b, feat_dim, P]."""
    cfm = official.feat_decoder
    queue = list(noises)

    def forward(mu: Tensor, n_timesteps: int, patch_size: int, cond: Tensor, temperature: float = 1.0,
                cfg_value: float = 1.0, sway_sampling_coef: float = 1.0, use_cfg_zero_star: bool = True) -> Tensor:
        z = queue.pop(0).to(mu.device, mu.dtype) * temperature
        t_span = torch.linspace(1, 0, n_timesteps + 1, device=mu.device, dtype=mu.dtype)
        t_span = t_span + sway_sampling_coef * (torch.cos(torch.pi / 2 * t_span) - 1 + t_span)
        return cfm.solve_euler(x=z, t_span=t_span, mu=mu, cond=cond, cfg_value=cfg_value,
                               use_cfg_zero_star=use_cfg_zero_star)

    cfm.forward = forward
    try:
        yield
    finally:
        del cfm.forward


def official_inference(official: nn.Module, text_ids: list[int], feats: Tensor, audio_mask: list[int],
                       noises: list[Tensor], *, min_len: int, max_len: int, timesteps: int,
                       cfg_value: float) -> tuple[Tensor, list[int]]:
    """Run the official `inference` on one prompt; returns (generated patches [T,P,D], stop flag per step).

    `feats` [L,P,D] holds a patch for every prompt position (zeros at text positions)."""
    text = torch.tensor([text_ids], dtype=torch.int32)
    amask = torch.tensor([audio_mask], dtype=torch.float32)
    stops: list[int] = []
    head = official.stop_head

    def record(module: nn.Module, args: tuple, out: Tensor) -> None:
        stops.append(int(out.argmax(dim=-1)[0]))

    hook = head.register_forward_hook(record)
    try:
        with injected_noise(official, noises), contextlib.redirect_stderr(io.StringIO()):
            pred, _ = official.inference(text, 1.0 - amask, feats.unsqueeze(0), amask, min_len=min_len,
                                         max_len=max_len, inference_timesteps=timesteps, cfg_value=cfg_value)
    finally:
        hook.remove()
    patches = pred[0].transpose(0, 1).unflatten(0, (-1, feats.shape[1]))  # [D, T*P] -> [T, P, D]
    # The official result starts with prompt patches kept as context for its streaming VAE: v1 keeps the last 2
    # whenever the prompt holds audio, v2 the last 3 only when the prompt ends in audio (continuation).
    n_audio = sum(audio_mask)
    if hasattr(official, "fusion_concat_proj"):
        context = min(3, n_audio) if audio_mask[-1] else 0
    else:
        context = min(2, n_audio)
    return patches[context:], stops
