"""The environment switches: each defined once in a settings module, read nowhere else, and the README agrees."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from engine.settings import EngineSettings, SettingError, switches_of
from gateway.settings import GatewaySettings

ROOT = Path(__file__).resolve().parent.parent
SETTINGS_MODULES = {ROOT / "engine" / "settings.py", ROOT / "gateway" / "settings.py"}
NAME = re.compile(r"VOXGATE_[A-Z0-9_]*[A-Z0-9]")


def defined_names() -> set[str]:
    return {s.env for cls in (EngineSettings, GatewaySettings) for s in switches_of(cls)}


def test_readme_lists_exactly_the_defined_switches() -> None:
    readme = set(NAME.findall((ROOT / "README.md").read_text()))
    assert readme == defined_names(), (
        f"in README only: {sorted(readme - defined_names())}; in the settings only: {sorted(defined_names() - readme)}")


def test_no_switch_read_outside_the_settings_modules() -> None:
    """A `VOXGATE_*` name as a whole string constant outside the settings modules is a second definition."""
    offenders = []
    for path in sorted([*(ROOT / "engine").rglob("*.py"), *(ROOT / "gateway").rglob("*.py")]):
        if path in SETTINGS_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
            if isinstance(node, ast.Attribute) and node.attr == "getenv":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} os.getenv")
    assert not offenders


def test_defaults_when_nothing_is_set() -> None:
    engine = EngineSettings.from_env({})
    assert engine == EngineSettings()
    assert (engine.cuda_graphs, engine.async_mixed, engine.large_lm_graphs, engine.fp8_min_rows) == (
        True, None, "1", 1024)
    assert GatewaySettings.from_env({}) == GatewaySettings(encode_threads=None, opus_batch=True)


def test_values_are_parsed() -> None:
    engine = EngineSettings.from_env({"VOXGATE_CUDA_GRAPHS": "0", "VOXGATE_ASYNC_MIXED": "1",
                                      "VOXGATE_LARGE_LM_GRAPHS": "text", "VOXGATE_FP8_MIN_ROWS": "8",
                                      "VOXGATE_CACHE": "/tmp/x"})
    assert (engine.cuda_graphs, engine.async_mixed, engine.large_lm_graphs, engine.fp8_min_rows, engine.cache) == (
        False, True, "text", 8, Path("/tmp/x"))
    gateway = GatewaySettings.from_env({"VOXGATE_ENCODE_THREADS": "0", "VOXGATE_OPUS_BATCH": "0"})
    assert (gateway.encode_threads, gateway.opus_batch) == (1, False)


@pytest.mark.parametrize(("env", "raw"), [("VOXGATE_LARGE_LM_GRAPHS", "all"), ("VOXGATE_FP8_MIN_ROWS", "many"),
                                          ("VOXGATE_FP8_MIN_ROWS", "-1"), ("VOXGATE_LOG", "LOUD")])
def test_a_bad_value_names_its_variable(env: str, raw: str) -> None:
    with pytest.raises(SettingError, match=env):
        EngineSettings.from_env({env: raw})
