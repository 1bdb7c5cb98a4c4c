"""Random-weight checkpoints in the exact release layout, for tests, demos and benchmarks.

Real weights cannot be downloaded where voxgate is built and tested, so every test and benchmark runs on a model
directory written here: `config.json`, `model.safetensors` (or `pytorch_model.bin` like VoxCPM-0.5B),
`audiovae.pth` (`{"state_dict": ...}` with old-style weight norm, as released) and the three tokenizer files.
The official package loads these directories unchanged, which is what the oracle tests rely on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, decoders, normalizers
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.models import BPE
from torch import Tensor, nn
from tqdm import tqdm

from engine import model_configs
from engine.config import ModelConfig
from engine.settings import EngineSettings
from engine.text import SPACE_MARK

SPECIAL_TOKENS = {0: "<unk>", 1: "<s>", 2: "</s>", 101: "<|audio_start|>", 102: "<|audio_end|>",
                  103: "<|ref_audio_start|>", 104: "<|ref_audio_end|>"}
FIRST_BYTE_ID = 105  # ids 0..104 are special or reserved, then the 256 byte-fallback tokens
FIRST_LEARNED_ID = FIRST_BYTE_ID + 256
# The decoder's O(1) activations times this gain give a waveform RMS of about 0.1 (-20 dBFS), well inside tanh's
# linear range: random weights sound like honest noise, not clipped full-scale noise.
VAE_OUTPUT_GAIN = 0.065
DEMO_DIR_NAME = "demo-tiny-voxcpm2-v2"  # a new name whenever the demo's weights change: an old cache is not reused

# Training text for the built-in tokenizer: English and Chinese so that multi-character CJK tokens exist.
CORPUS = """\
The quick brown fox jumps over the lazy dog. Hello world, this is a voice gateway speaking to you.
Streaming speech should start quickly and never stop in the middle of a sentence.
Please call me back tomorrow at three o'clock; the meeting was moved to the second floor.
It is a truth universally acknowledged that a good voice needs a good microphone.
Numbers like 3.14, 42 and 2026 appear in text, and so do names such as Alice, Bob and Charlie.
你好，世界！今天天气很好，我们一起去公园散步吧。
语音合成技术可以把文字转换成自然流畅的声音。
实时语音网关需要低延迟和高并发，每一个用户都希望马上听到声音。
我们的中国朋友说，学习中文很有意思，但是汉字不容易写。
这个模型可以说中文，也可以说英文，还可以模仿不同的声音。
"""


def _learn_bpe(budget: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Deterministic BPE on `CORPUS`: an alphabet of the most frequent characters, then greedy merges.

    Ties break on the pair itself, so the same budget always gives the same tokenizer (the `tokenizers` trainer
    breaks ties by hash order)."""
    words: Counter[tuple[str, ...]] = Counter()
    for word in CORPUS.split():
        words[tuple(SPACE_MARK + word)] += 1
    chars: Counter[str] = Counter()
    for word, n in words.items():
        for c in word:
            chars[c] += n
    alphabet = [c for c, _ in sorted(chars.items(), key=lambda kv: (-kv[1], kv[0]))][: budget // 2]
    known = set(alphabet)
    tokens, merges = list(alphabet), []
    while len(tokens) < budget:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, n in words.items():
            for a, b in zip(word, word[1:], strict=False):
                if a in known and b in known:
                    pairs[a, b] += n
        if not pairs:
            break
        (a, b), count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if count < 2:
            break
        merged = a + b
        merges.append((a, b))
        if merged not in known:
            known.add(merged)
            tokens.append(merged)
        words = Counter({_merge(word, a, b, merged): n for word, n in words.items()})
    return tokens, merges


def _merge(word: tuple[str, ...], a: str, b: str, merged: str) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(merged)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def tokenizer_json(vocab_size: int) -> dict[str, Any]:
    """A SentencePiece-style byte-fallback BPE (the Llama layout) as a `tokenizer.json` dict of `vocab_size`."""
    budget = vocab_size - FIRST_LEARNED_ID
    if budget < 64:
        raise ValueError(f"vocab_size {vocab_size} is too small for the tokenizer (needs >= {FIRST_LEARNED_ID + 64})")
    learned, merges = _learn_bpe(budget)
    vocab: dict[str, int] = {}
    for i in range(FIRST_BYTE_ID):
        vocab[SPECIAL_TOKENS.get(i, f"<|reserved_{i}|>")] = i
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = FIRST_BYTE_ID + b
    for token in learned:
        vocab.setdefault(token, len(vocab))
    while len(vocab) < vocab_size:  # real-size vocabularies: unused entries keep the id space of the release
        vocab[f"<|unused_{len(vocab)}|>"] = len(vocab)

    tok = _HFTokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # The release layout (MiniCPM's legacy Llama conversion): a normalizer that prepends "▁" and turns every space into
    # "▁", no pre-tokenizer. Text that begins with a space therefore starts "▁▁" (transformers 4.x and `tokenizers`
    # run the file as written; transformers 5.x's LlamaTokenizer swaps in its own Metaspace and loses one).
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARK), normalizers.Replace(" ", SPACE_MARK)])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(SPECIAL_TOKENS[i], special=True, normalized=False) for i in (0, 1, 2)])
    return json.loads(tok.to_str())


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Writes `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json`."""
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json(vocab_size), ensure_ascii=False))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "legacy": True,
              "model_max_length": 1000000000000000019884624838656, "clean_up_tokenization_spaces": False, **special}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def _random_tensor(name: str, shape: torch.Size, gen: torch.Generator, device: torch.device) -> Tensor:
    """Init by role: RMSNorm weights 1, biases and learned tokens small, matrices std 1/sqrt(fan_in)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    noise = torch.randn(shape, generator=gen, device=device)
    if len(shape) < 2 or name.endswith("embed_tokens.weight"):
        return noise * 0.02 if len(shape) < 2 else noise
    return noise * math.prod(shape[1:]) ** -0.5


def random_model_state_dict(config: ModelConfig, seed: int = 0, stop_never: bool = False,
                            device: str | torch.device = "cpu", progress: bool = False) -> dict[str, Tensor]:
    """Random main-model weights (names and shapes of `VoxCPMModel`), in the config's dtype, on CPU."""
    from engine.model.voxcpm import VoxCPMModel

    device = torch.device(device)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in VoxCPMModel(config).state_dict().items()}
    dtype = getattr(torch, config.dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, Tensor] = {}
    for name in tqdm(sorted(shapes), desc="random weights", unit="tensor", disable=not progress):
        out[name] = _random_tensor(name, shapes[name], gen, device).to(dtype).cpu()
    if stop_never:
        # stop logits = stop_head(silu(stop_proj(h))): a zero stop_proj makes the input the constant silu(1) > 0, so
        # row 0 (positive) always beats row 1 (negative) whatever the hidden state.
        out["stop_proj.weight"].zero_()
        out["stop_proj.bias"].fill_(1.0)
        row = out["stop_head.weight"][0].float().abs() + 1e-3
        out["stop_head.weight"].copy_(torch.stack([row, -row]).to(dtype))
    return out


def random_vae_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, Tensor]:
    """Random AudioVAE weights in the release form: float32, convs as old-style weight norm (`weight_g`, `weight_v`).

    Convs keep unit gain (std 1/sqrt(fan_in)) and residual branches end small, so activations stay O(1) through
    the deep decoder; the decoder's last conv then scales them by `VAE_OUTPUT_GAIN`, so the waveform is noise at a
    comfortable level (about -20 dBFS) in the final tanh's linear range, never clipped."""
    from engine.model.audio_vae import AudioVAE, ResidualUnit

    vae = AudioVAE(config.audio_vae)
    std: dict[str, float] = {}
    for name, module in vae.named_modules():
        if isinstance(module, nn.ConvTranspose1d):  # each output sample sums in_channels x kernel/stride taps
            std[name] = (module.in_channels * module.kernel_size[0] / module.stride[0]) ** -0.5
        elif isinstance(module, nn.Conv1d):
            std[name] = (module.in_channels // module.groups * module.kernel_size[0]) ** -0.5
    for name, module in vae.named_modules():
        if isinstance(module, ResidualUnit):
            std[f"{name}.block.3"] *= 0.1
    output_conv = f"decoder.model.{len(vae.decoder.model) - 1}"
    std[output_conv] *= VAE_OUTPUT_GAIN
    gen = torch.Generator().manual_seed(seed + 1)
    out: dict[str, Tensor] = {}
    for name, value in vae.state_dict().items():  # buffers (sr_bin_boundaries) stay as built
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and value.ndim == 3:
            v = torch.randn(value.shape, generator=gen) * std[module]
            out[name + "_g"] = v.norm(dim=(1, 2), keepdim=True)
            out[name + "_v"] = v
        elif name.endswith(".bias"):
            out[name] = torch.randn(value.shape, generator=gen) * 0.02 * (VAE_OUTPUT_GAIN if module == output_conv
                                                                           else 1.0)
        else:
            out[name] = value.clone()
    return out


def write_random_checkpoint(out_dir: str | Path, config_dict: dict[str, Any], seed: int = 0, stop_never: bool = False,
                            progress: bool = True, weights_format: str = "safetensors",
                            device: str | torch.device = "cpu") -> Path:
    """Write a random-weight model directory in the release layout; deterministic from `seed` (per device type).

    weights_format: "safetensors" (VoxCPM2, VoxCPM1.5: `model.safetensors`) or "bin" (VoxCPM-0.5B:
    `pytorch_model.bin`). stop_never makes the stop head never fire (fixed-length benchmarks)."""
    if weights_format not in ("safetensors", "bin"):
        raise ValueError(f"weights_format must be 'safetensors' or 'bin' (got {weights_format!r})")
    config = ModelConfig.from_dict(config_dict)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2))
    write_tokenizer(out, config.lm.vocab_size)
    weights = random_model_state_dict(config, seed, stop_never, device, progress)
    if weights_format == "safetensors":
        from safetensors.torch import save_file

        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(weights, out / "pytorch_model.bin")
    del weights
    torch.save({"state_dict": random_vae_state_dict(config, seed)}, out / "audiovae.pth")
    return out


def demo_model_dir() -> Path:
    """The tiny built-in VoxCPM2 demo model (written once, atomically, under ~/.cache/voxgate)."""
    cache = EngineSettings.from_env().cache
    final = cache / DEMO_DIR_NAME
    if (final / "audiovae.pth").is_file():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=cache))
    try:
        write_random_checkpoint(tmp, {**model_configs.tiny("voxcpm2"), "voxgate_demo": True}, progress=False)
        os.replace(tmp, final)  # atomic; fails if another process got there first, which is fine
    except OSError:
        if not (final / "audiovae.pth").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


SIZES = {"tiny": lambda: model_configs.tiny("voxcpm2"), "tiny-v1": lambda: model_configs.tiny("voxcpm"),
         "voxcpm2": model_configs.voxcpm2, "voxcpm1.5": model_configs.voxcpm15, "voxcpm-0.5b": model_configs.voxcpm05b}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a random-weight VoxCPM checkpoint in the release layout.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-never", action="store_true", help="the stop head never fires (fixed-length runs)")
    parser.add_argument("--device", default="cpu", help="where to generate the weights (cuda is much faster)")
    args = parser.parse_args(argv)
    weights_format = "bin" if args.size == "voxcpm-0.5b" else "safetensors"
    start = time.perf_counter()
    write_random_checkpoint(args.out_dir, SIZES[args.size](), seed=args.seed, stop_never=args.stop_never,
                            weights_format=weights_format, device=args.device)
    print(f"wrote {args.size} to {args.out_dir} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
