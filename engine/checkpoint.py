"""Loading VoxCPM checkpoints: a local directory or a Hugging Face repo id, in any of the released file formats.

A model directory holds `config.json`, the main weights (`model.safetensors`, `pytorch_model.bin` or a `.pt`/`.pth`
pickle, optionally under a `state_dict` key), the AudioVAE (`audiovae.safetensors` or `audiovae.pth`, old-style
weight norm folded here) and the tokenizer files. Weights are checked strictly: every missing, unexpected and
misshaped name is reported at once in one `CheckpointError` naming the file, and nothing is left at random init.
"""

from __future__ import annotations

import logging
import pickle
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from engine.config import ConfigError, ModelConfig
from engine.text import Tokenizer, TokenizerError

log = logging.getLogger(__name__)

MAIN_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
VAE_WEIGHT_FILES = ("audiovae.safetensors", "audiovae.pth")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.bin", "*.pth", "*.pt"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_MAX_LISTED = 12  # names listed per kind of mismatch; the count is always complete


class CheckpointError(ValueError):
    """A checkpoint cannot be found, read, or does not match its config."""


@dataclass
class LoadedModel:
    config: ModelConfig
    model: nn.Module  # engine.model.voxcpm.VoxCPMModel, eval mode
    vae: nn.Module  # engine.model.audio_vae.AudioVAE, always float32
    tokenizer: Tokenizer
    path: Path
    name: str

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def resolve_model_dir(model: str | Path) -> Path:
    """A local model directory, or a Hugging Face repo id fetched (or found in the cache) by `snapshot_download`."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path}: not a directory (give the model directory, not a file)")
    text = str(model)
    if not _REPO_ID.match(text):
        raise CheckpointError(f"{text}: no such directory, and not a Hugging Face repo id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text, allow_patterns=HUB_PATTERNS, etag_timeout=10))
    except Exception as e:  # offline, unknown repo, gated repo, network error: all mean "cannot get it"
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{text}: not a local directory and the Hugging Face repo cannot be fetched "
                              f"({type(e).__name__}: {first_line})") from None


def load_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Tensors of a `.safetensors` file or a torch pickle (`.bin`, `.pt`, `.pth`; a `state_dict` key is unwrapped)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # Training checkpoints can pickle optimizer or config objects next to the weights: a trusted local file.
        log.warning("%s: holds objects besides tensors; loading it with full unpickling", path)
        try:
            data = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:
            raise CheckpointError(f"{path}: not a readable torch checkpoint ({e})") from None
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("state_dict"), dict):
        data = data["state_dict"]
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, got {type(data).__name__}")
    bad = [k for k, v in data.items() if not isinstance(k, str) or not isinstance(v, Tensor)]
    if bad:
        raise CheckpointError(f"{path}: {len(bad)} entries are not tensors: {', '.join(map(str, bad[:_MAX_LISTED]))}")
    return data


def check_state_dict(expected: dict[str, Tensor], got: dict[str, Tensor], source: str | Path) -> None:
    """Raise one `CheckpointError` listing every missing, unexpected and misshaped name of `got`."""
    problems = []
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    misshaped = [f"{k} {tuple(got[k].shape)} (expected {tuple(v.shape)})"
                 for k, v in expected.items() if k in got and got[k].shape != v.shape]
    for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped)):
        if names:
            more = f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
            problems.append(f"{len(names)} {label}: {', '.join(names[:_MAX_LISTED])}{more}")
    if problems:
        raise CheckpointError(f"{source}: weights do not match the config: " + "; ".join(problems))


def find_weight_file(model_dir: Path) -> Path:
    """The main weights: `model.safetensors`, `pytorch_model.bin`, or the one other `.pt`/`.pth` pickle."""
    for name in MAIN_WEIGHT_FILES:
        if (model_dir / name).is_file():
            return model_dir / name
    pickles = sorted(p for p in model_dir.iterdir()
                     if p.suffix in (".pt", ".pth") and not p.name.startswith("audiovae") and p.is_file())
    if len(pickles) == 1:
        return pickles[0]
    found = f"several candidates: {', '.join(p.name for p in pickles)}" if pickles else "none found"
    raise CheckpointError(f"{model_dir}: no model weights ({' or '.join(MAIN_WEIGHT_FILES)} or one .pt/.pth; {found})")


def find_vae_file(model_dir: Path) -> Path:
    for name in VAE_WEIGHT_FILES:
        if (model_dir / name).is_file():
            return model_dir / name
    raise CheckpointError(f"{model_dir}: no AudioVAE weights ({' or '.join(VAE_WEIGHT_FILES)})")


def load_vae_state_dict(path: str | Path) -> dict[str, Tensor]:
    """AudioVAE tensors with weight norm folded into plain `weight`s."""
    from engine.model.audio_vae import fold_weight_norm

    try:
        return fold_weight_norm(load_state_dict(path))
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def resolve_dtype(config: ModelConfig, device: torch.device, dtype: str | torch.dtype | None) -> torch.dtype:
    """The requested dtype, else the config's (float32 on CPU, where bf16 matmuls are slow and inexact)."""
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if isinstance(dtype, torch.dtype):
        if dtype not in names.values():
            raise CheckpointError(f"unsupported dtype {dtype} (float32, bfloat16 or float16)")
        return dtype
    if dtype is None:
        return torch.float32 if device.type == "cpu" else names[config.dtype]
    if dtype not in names:
        raise CheckpointError(f"unsupported dtype {dtype!r} (float32, bfloat16 or float16)")
    return names[dtype]


def load_model(model: str | Path, device: str | torch.device = "cpu",
               dtype: str | torch.dtype | None = None) -> LoadedModel:
    """Load a VoxCPM model directory (or hub repo id): weights strictly checked, eval mode, on `device`."""
    from engine.model.audio_vae import AudioVAE
    from engine.model.voxcpm import VoxCPMModel

    start = time.perf_counter()
    path = resolve_model_dir(model)
    device = torch.device(device)
    config = ModelConfig.from_file(path / "config.json")
    try:
        tokenizer = Tokenizer.from_dir(path)
    except TokenizerError as e:
        raise CheckpointError(str(e)) from None
    if tokenizer.vocab_size > config.lm.vocab_size:
        raise CheckpointError(f"{path / 'tokenizer.json'}: {tokenizer.vocab_size} tokens but lm_config.vocab_size "
                              f"is {config.lm.vocab_size}")
    run_dtype = resolve_dtype(config, device, dtype)
    weight_file, vae_file = find_weight_file(path), find_vae_file(path)

    state = load_state_dict(weight_file)
    n_params = sum(t.numel() for t in state.values())
    log.info("loading %s: %s, %.0fM parameters, %s on %s", model, config.architecture, n_params / 1e6,
             str(run_dtype).removeprefix("torch."), device)
    with torch.device(device):
        net = VoxCPMModel(config)
    check_state_dict(net.state_dict(), state, weight_file)
    net.load_state_dict(state, strict=True)
    del state
    net = net.to(dtype=run_dtype).eval()

    vae_state = load_vae_state_dict(vae_file)
    with torch.device(device):
        vae = AudioVAE(config.audio_vae)
    check_state_dict(vae.state_dict(), vae_state, vae_file)
    vae.load_state_dict(vae_state, strict=True)
    vae = vae.float().eval()
    log.info("loaded %s in %.1f s", model, time.perf_counter() - start)
    return LoadedModel(config=config, model=net, vae=vae, tokenizer=tokenizer, path=path, name=str(model))


__all__ = ["CheckpointError", "ConfigError", "LoadedModel", "check_state_dict", "load_model", "load_state_dict",
           "load_vae_state_dict", "resolve_model_dir"]
