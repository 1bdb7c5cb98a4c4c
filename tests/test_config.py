"""ModelConfig parsing: release and tiny configs round-trip; each bad input is one ConfigError naming the field."""

import copy
import json
from pathlib import Path

import pytest

from engine import model_configs
from engine.config import ConfigError, ModelConfig

ALL_CONFIGS = {**{name: make() for name, make in model_configs.RELEASES.items()},
               "tiny-v2": model_configs.tiny("voxcpm2"), "tiny-v1": model_configs.tiny("voxcpm")}


@pytest.mark.parametrize("name", list(ALL_CONFIGS))
def test_round_trip(name, tmp_path):
    data = ALL_CONFIGS[name]
    file = tmp_path / "config.json"
    file.write_text(json.dumps(data))
    cfg = ModelConfig.from_file(file)
    again = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert cfg.is_v2 == (data["architecture"] == "voxcpm2")
    assert cfg.patch_size == data["patch_size"]
    assert cfg.lm.hidden_size == data["lm_config"]["hidden_size"]


def test_release_facts():
    v2, v15, v05 = (ModelConfig.from_dict(make()) for make in model_configs.RELEASES.values())
    assert (v2.sample_rate, v2.samples_per_patch, v2.patch_ms) == (48000, 7680, 160.0)
    assert (v15.sample_rate, v15.samples_per_patch, v15.patch_ms) == (44100, 7056, 160.0)
    assert (v05.sample_rate, v05.samples_per_patch, v05.patch_ms) == (16000, 1280, 80.0)
    assert v2.lm.head_dim == v2.residual_lm.head_dim == v2.dit_lm.head_dim == 128
    assert v2.residual_lm.no_rope and not v15.residual_lm.no_rope
    assert v2.residual_lm.num_key_value_heads == 2  # inherited from lm_config


def test_official_release_file_parses():
    """The published VoxCPM2 config.json shape (kept in tests/data), including its ignored extra keys."""
    cfg = ModelConfig.from_file(Path(__file__).parent / "data" / "voxcpm2_config.json")
    assert cfg.is_v2 and cfg.lm.vocab_size == 73448
    assert cfg == ModelConfig.from_dict(model_configs.voxcpm2())


def _one_error(data, *fragments):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(data, source="cfg.json")
    message = str(info.value)
    assert message.startswith("cfg.json: ")
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_bad_value_names_field():
    data = copy.deepcopy(ALL_CONFIGS["tiny-v2"])
    data["lm_config"]["num_attention_heads"] = -4
    _one_error(data, "lm_config.num_attention_heads", "positive")
    data = copy.deepcopy(ALL_CONFIGS["tiny-v2"])
    data["patch_size"] = "four"
    _one_error(data, "patch_size", "'four'")
    data = copy.deepcopy(ALL_CONFIGS["tiny-v1"])
    data["dtype"] = "float64"
    _one_error(data, "dtype", "float64")
    data = copy.deepcopy(ALL_CONFIGS["tiny-v2"])
    data["audio_vae_config"]["decoder_rates"] = [8, 6, 5, 2, 2]  # 48 kHz no longer matches the 16 kHz encoder
    _one_error(data, "audio_vae_config.decoder_rates")


def test_missing_key_names_field():
    data = copy.deepcopy(ALL_CONFIGS["voxcpm2"])
    del data["lm_config"]["hidden_size"]
    _one_error(data, "lm_config.hidden_size", "missing")
    data = copy.deepcopy(ALL_CONFIGS["voxcpm2"])
    del data["lm_config"]
    _one_error(data, "lm_config", "missing")


def test_unknown_architecture():
    data = copy.deepcopy(ALL_CONFIGS["voxcpm2"])
    data["architecture"] = "voxcpm3"
    _one_error(data, "architecture", "voxcpm3")


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        ModelConfig.from_file(tmp_path / "config.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(bad)
