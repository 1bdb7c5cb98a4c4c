"""The engine's environment switches, each defined once: its variable, default, allowed values and meaning.

Product code reads `VOXGATE_*` variables only through `EngineSettings.from_env()` (and `gateway.settings`). A switch
that specialises kernels at import (`FUSED_KERNELS`, `FP8_MIN_ROWS`, the LoRA variant, the large LM graphs) is read
when its module is imported; the others when the object that uses them is built, so a test may set the variable
first. Worker processes inherit the environment, so they see the values their parent sees.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Switch:
    """One environment variable: its name, the default's text, the values it takes, what it does."""

    env: str
    default: str
    allowed: str
    doc: str
    parse: Callable[[str], Any]

    def read(self, environ: Mapping[str, str]) -> Any:
        """The parsed value, or `SettingError` naming the variable when it cannot be parsed."""
        raw = environ.get(self.env, self.default)
        try:
            return self.parse(raw)
        except ValueError as e:
            raise SettingError(f"{self.env}={raw!r}: {e} (allowed: {self.allowed})") from None


class SettingError(ValueError):
    """An environment switch holds a value it does not take."""


def on_unless_zero(raw: str) -> bool:
    """`0` turns a switch off; anything else leaves it on."""
    return raw != "0"


def tri_state(raw: str) -> bool | None:
    """`1` forces on, `0` forces off, unset or anything else: None (the engine decides)."""
    return {"1": True, "0": False}.get(raw)


def one_of(*choices: str) -> Callable[[str], str]:
    """A parser that accepts only `choices`."""
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(f"not one of {list(choices)}")
        return raw
    return parse


def non_negative_int(raw: str) -> int:
    """An integer of at least 0."""
    value = int(raw)
    if value < 0:
        raise ValueError("must be at least 0")
    return value


def switch(env: str, default: str, allowed: str, doc: str, parse: Callable[[str], Any]) -> Any:
    """A dataclass field whose value `from_env` reads from `env` (the field's default is the parsed default)."""
    spec = Switch(env, default, allowed, doc, parse)
    return field(default=parse(default), metadata={"switch": spec})


def switches_of(cls: type) -> tuple[Switch, ...]:
    """Every switch of a settings dataclass, in field order."""
    return tuple(f.metadata["switch"] for f in fields(cls))


def read_env(cls: type, environ: Mapping[str, str] | None = None) -> Any:
    """An instance of settings dataclass `cls` with every field read from `environ` (default: the process's)."""
    env = os.environ if environ is None else environ
    return cls(**{f.name: f.metadata["switch"].read(env) for f in fields(cls)})


@dataclass(frozen=True)
class EngineSettings:
    """The engine's environment switches (A/B timing, debugging, tests; the engine's options are `EngineConfig`)."""

    cuda_graphs: bool = switch(
        "VOXGATE_CUDA_GRAPHS", "1", "0 | 1", "capture decode steps in CUDA graphs; 0: every step eager",
        on_unless_zero)
    fused_kernels: bool = switch(
        "VOXGATE_FUSED_KERNELS", "1", "0 | 1", "the fused Triton kernels on CUDA; 0: plain torch ops (read at import)",
        on_unless_zero)
    large_lm_graphs: str = switch(
        "VOXGATE_LARGE_LM_GRAPHS", "1", "1 | text | 0",
        "graphs for LM steps past the small graphs: 1 all, text only prompts alone, 0 none (read at import)",
        one_of("1", "text", "0"))
    async_scheduling: bool = switch(
        "VOXGATE_ASYNC_SCHEDULING", "1", "0 | 1", "launch a steady decode step before the previous one ends; 0: one "
        "step at a time", on_unless_zero)
    async_mixed: bool | None = switch(
        "VOXGATE_ASYNC_MIXED", "", "unset | 0 | 1", "a step launched ahead may admit waiting prompts: unset on CUDA "
        "only, 1 always, 0 never", tri_state)
    vae_stream: bool = switch(
        "VOXGATE_VAE_STREAM", "1", "0 | 1", "each step's VAE decode as a graph of its own on a second stream; 0: "
        "inside the step's graph", on_unless_zero)
    fp8_min_rows: int = switch(
        "VOXGATE_FP8_MIN_ROWS", "1024", "integer >= 0", "rows of a GEMM's input from which it runs in FP8 when FP8 is "
        "on (tests lower it; read at import)", non_negative_int)
    lora_large_variant: str = switch(
        "VOXGATE_LORA_LARGE_VARIANT", "two_pdl", "a name in engine.model.lora_triton.VARIANTS", "the LoRA kernel "
        "variant for sizes past one launch, for an end-to-end A/B (read at import)", str)
    lean_steps_ms: int = switch(
        "VOXGATE_LEAN_STEPS", "0", "integer ms >= 0", "N > 0: a step that feeds a prompt whose listener has at most N "
        "ms queued (a new turn) leaves out the streams whose listeners reported more (engine.lean_steps); 0: off",
        non_negative_int)
    log: str = switch(
        "VOXGATE_LOG", "WARNING", "a logging level name (DEBUG, INFO, WARNING, ...)",
        "the worker processes' log level; DEBUG logs every engine step", one_of(*logging.getLevelNamesMapping()))
    cache: Path = switch(
        "VOXGATE_CACHE", str(Path.home() / ".cache" / "voxgate"), "a directory", "where the demo model is written",
        Path)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EngineSettings:
        """The switches as the environment sets them now."""
        settings: EngineSettings = read_env(cls, environ)
        return settings
