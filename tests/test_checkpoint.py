"""Checkpoint loading: every released file format, strict checks with one clear error, hub resolution, the random
writer (loaded unchanged by the official package), the demo model."""

import argparse
import contextlib
import io
import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint import CheckpointError, load_model, load_state_dict, load_vae_state_dict, resolve_model_dir
from engine.config import ConfigError
from engine.model.audio_vae import fold_weight_norm
from engine.model_configs import tiny
from engine.random_checkpoint import (
    DEMO_DIR_NAME,
    demo_model_dir,
    random_model_state_dict,
    write_random_checkpoint,
)

SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "audiovae.pth")


def _variant(src, dst, weights: dict | None = None, name: str | None = None, payload=None, vae: str = "audiovae.pth"):
    """A copy of model dir `src` whose main weights are saved as `name` (format from the suffix)."""
    dst.mkdir()
    for f in SIDE_FILES:
        shutil.copy(src / f, dst / f)
    if weights is not None:
        if name.endswith(".safetensors"):
            save_file(weights, str(dst / name))
        else:
            torch.save(weights if payload is None else payload, dst / name)
    if vae != "audiovae.pth":
        (dst / "audiovae.pth").unlink()
    return dst


@pytest.fixture(scope="module")
def reference(tiny_v2_dir):
    return load_file(str(tiny_v2_dir / "model.safetensors")), fold_weight_norm(
        torch.load(tiny_v2_dir / "audiovae.pth", weights_only=True)["state_dict"])


def _assert_loaded(model_dir, reference):
    weights, vae = reference
    loaded = load_model(model_dir)
    assert all(torch.equal(loaded.model.state_dict()[k], v) for k, v in weights.items())
    assert all(torch.equal(loaded.vae.state_dict()[k], v) for k, v in vae.items())
    assert not loaded.model.training and loaded.dtype == torch.float32
    return loaded


@pytest.mark.parametrize("name,wrap", [("pytorch_model.bin", False), ("model.pt", True), ("model.pth", False),
                                       ("voxcpm_finetune.pt", True)])
def test_pickle_formats(tiny_v2_dir, reference, tmp_path, name, wrap):
    weights = reference[0]
    payload = {"state_dict": weights, "step": 1000} if wrap else None
    _assert_loaded(_variant(tiny_v2_dir, tmp_path / "m", weights, name, payload), reference)


def test_safetensors_and_release_layout(tiny_v2_dir, reference):
    loaded = _assert_loaded(tiny_v2_dir, reference)
    assert loaded.path == tiny_v2_dir and loaded.name == str(tiny_v2_dir)
    assert loaded.tokenizer.encode("hello") and loaded.config.is_v2


def test_training_pickle_with_objects(tiny_v2_dir, reference, tmp_path):
    payload = {"state_dict": reference[0], "args": argparse.Namespace(lr=1e-4)}  # not loadable weights-only
    _assert_loaded(_variant(tiny_v2_dir, tmp_path / "m", reference[0], "model.pt", payload), reference)


@pytest.mark.parametrize("folded", [False, True])
def test_audiovae_safetensors(tiny_v2_dir, reference, tmp_path, folded):
    raw = torch.load(tiny_v2_dir / "audiovae.pth", weights_only=True)["state_dict"]
    assert any(k.endswith("weight_g") for k in raw)  # the writer uses the releases' old-style weight norm
    d = _variant(tiny_v2_dir, tmp_path / "m", reference[0], "model.safetensors", vae="audiovae.safetensors")
    save_file(fold_weight_norm(raw) if folded else raw, str(d / "audiovae.safetensors"))
    _assert_loaded(d, reference)


def test_dtype_override(tiny_v2_dir):
    loaded = load_model(tiny_v2_dir, dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    assert next(loaded.vae.parameters()).dtype == torch.float32
    with pytest.raises(CheckpointError, match="unsupported dtype"):
        load_model(tiny_v2_dir, dtype="int8")


def test_mismatches_reported_together(tiny_v2_dir, reference, tmp_path):
    weights = dict(reference[0])
    del weights["stop_head.weight"]
    del weights["base_lm.layers.0.mlp.up_proj.weight"]
    weights["fsq_layer.in_proj.weight"] = torch.zeros(3, 3)
    weights["base_lm.extra.weight"] = torch.zeros(1)
    d = _variant(tiny_v2_dir, tmp_path / "m", weights, "model.safetensors")
    with pytest.raises(CheckpointError) as info:
        load_model(d)
    msg = str(info.value)
    assert msg.startswith(str(d / "model.safetensors"))
    for part in ("2 missing", "stop_head.weight", "up_proj.weight", "1 unexpected", "base_lm.extra.weight",
                 "1 wrong shape", "fsq_layer.in_proj.weight (3, 3)"):
        assert part in msg, msg


@pytest.mark.parametrize("problem", ["missing", "unexpected", "misshaped"])
def test_vae_mismatch(tiny_v2_dir, reference, tmp_path, problem):
    raw = dict(torch.load(tiny_v2_dir / "audiovae.pth", weights_only=True)["state_dict"])
    if problem == "missing":
        del raw["decoder.model.0.bias"]
    elif problem == "unexpected":
        raw["decoder.noise.weight"] = torch.zeros(2)
    else:
        raw["decoder.model.0.bias"] = torch.zeros(7)
    d = _variant(tiny_v2_dir, tmp_path / "m", reference[0], "model.safetensors")
    torch.save({"state_dict": raw}, d / "audiovae.pth")
    with pytest.raises(CheckpointError, match=r"audiovae.pth: .*(missing|unexpected|wrong shape).*decoder"):
        load_model(d)


def test_missing_files(tiny_v2_dir, reference, tmp_path):
    with pytest.raises(CheckpointError, match="no model weights"):
        load_model(_variant(tiny_v2_dir, tmp_path / "a"))
    d = _variant(tiny_v2_dir, tmp_path / "b", reference[0], "model.safetensors")
    (d / "audiovae.pth").unlink()
    with pytest.raises(CheckpointError, match="no AudioVAE weights"):
        load_model(d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json: file not found"):
        load_model(d)
    with pytest.raises(CheckpointError, match="file not found"):
        load_state_dict(tmp_path / "nothing.safetensors")
    (tmp_path / "junk.bin").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="junk.bin: not a readable torch checkpoint"):
        load_state_dict(tmp_path / "junk.bin")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="junk.safetensors: not a readable safetensors"):
        load_state_dict(tmp_path / "junk.safetensors")
    torch.save({"weight_g": torch.ones(2, 1, 1)}, tmp_path / "vae.pth")
    with pytest.raises(CheckpointError, match="vae.pth: weight norm"):
        load_vae_state_dict(tmp_path / "vae.pth")


@pytest.mark.parametrize("change,field", [({"architecture": "voxcpm3"}, "architecture"),
                                          ({"patch_size": 0}, "patch_size")])
def test_bad_config(tiny_v2_dir, reference, tmp_path, change, field):
    d = _variant(tiny_v2_dir, tmp_path / "m", reference[0], "model.safetensors")
    (d / "config.json").write_text(json.dumps({**tiny("voxcpm2"), **change}))
    with pytest.raises(ConfigError, match=rf"{d / 'config.json'}: {field}"):
        load_model(d)


def test_unreachable_hub_id_fails_fast(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="bogus-org/no-such-voxcpm: .*cannot be fetched"):
        resolve_model_dir("bogus-org/no-such-voxcpm")
    assert time.perf_counter() - start < 5
    with pytest.raises(CheckpointError, match="not a Hugging Face repo id"):
        resolve_model_dir("./no/such/dir")


def test_local_file_is_not_a_model_dir(tiny_v2_dir):
    with pytest.raises(CheckpointError, match="not a directory"):
        resolve_model_dir(tiny_v2_dir / "config.json")


@pytest.mark.parametrize("arch,weights_format", [("voxcpm2", "safetensors"), ("voxcpm", "safetensors"),
                                                  ("voxcpm", "bin")])
def test_official_loads_our_checkpoints(tmp_path, arch, weights_format):
    """Loader parity: the official from_local and our load_model read the same directory to the same weights."""
    from voxcpm.model.voxcpm import VoxCPMModel
    from voxcpm.model.voxcpm2 import VoxCPM2Model

    d = write_random_checkpoint(tmp_path / "m", tiny(arch), seed=3, progress=False, weights_format=weights_format)
    assert (d / ("model.safetensors" if weights_format == "safetensors" else "pytorch_model.bin")).is_file()
    with contextlib.redirect_stderr(io.StringIO()):
        official = (VoxCPM2Model if arch == "voxcpm2" else VoxCPMModel).from_local(str(d), optimize=False,
                                                                                  device="cpu")
    ours = load_model(d)
    theirs = official.state_dict()
    main = {k: v for k, v in theirs.items() if not k.startswith("audio_vae.")}
    vae = fold_weight_norm({k.removeprefix("audio_vae."): v for k, v in theirs.items() if k.startswith("audio_vae.")})
    # The official load is strict=False: equal name sets prove that nothing was left at its random init.
    assert set(main) == set(ours.model.state_dict()) and set(vae) == set(ours.vae.state_dict())
    assert all(torch.equal(main[k], v) for k, v in ours.model.state_dict().items())
    assert all(torch.allclose(vae[k], v, rtol=1e-6, atol=1e-7) for k, v in ours.vae.state_dict().items())


def test_writer_is_deterministic_and_stop_never(tmp_path):
    cfg = load_model(write_random_checkpoint(tmp_path / "a", tiny("voxcpm2"), seed=5, progress=False)).config
    a, b = random_model_state_dict(cfg, seed=5), random_model_state_dict(cfg, seed=5)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["stop_head.weight"], random_model_state_dict(cfg, seed=6)["stop_head.weight"])
    never = load_model(write_random_checkpoint(tmp_path / "b", tiny("voxcpm2"), stop_never=True, progress=False))
    hidden = torch.randn(4096, cfg.lm.hidden_size, generator=torch.Generator().manual_seed(0))
    for scale in (0.01, 1.0, 100.0):
        assert not never.model.stop_flags(hidden * scale).any()
    normal = load_model(tmp_path / "a")
    assert normal.model.stop_flags(hidden).any()  # the random stop head does fire somewhere


def test_demo_model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VOXGATE_CACHE", str(tmp_path))
    d = demo_model_dir()
    assert d == tmp_path / DEMO_DIR_NAME
    assert json.loads((d / "config.json").read_text())["voxgate_demo"] is True
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert demo_model_dir() == d and (d / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_DIR_NAME]  # no temporary dirs left behind
    assert load_model(d).config.is_v2
