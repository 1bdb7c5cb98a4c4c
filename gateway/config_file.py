"""`voxgate serve --config voxgate.toml`: a TOML file that sets serve flags, for deployments configured from files.

The file's keys are the flags' long names without the dashes (`max-sessions = 500`; `max_sessions` works too). It is
read into command-line tokens that go before the real command line, so the flags' own argparse definitions (made
from the `EngineConfig` and `GatewayConfig` fields by `gateway.flags`) parse every value, the configs check it (one
definition per setting), and a flag given on the command line overrides the file."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any


class ConfigFileError(ValueError):
    """The config file cannot be used: unreadable, not TOML, an unknown key or a value of the wrong kind."""


def with_config_file(parser: argparse.ArgumentParser, argv: list[str], path: str | Path) -> list[str]:
    """`argv` (a subcommand's command line, e.g. `serve ...`) with the config file's settings put right after the
    subcommand, so the flags on the command line come later and win."""
    return [argv[0], *config_tokens(path, subparser(parser, argv[0])), *argv[1:]]


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of one subcommand (`serve`) of the top-level parser."""
    for action in parser._actions:  # argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    raise KeyError(command)


def settable_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Config-file key -> the flag's action, for every long flag of `parser` but --help and --config."""
    flags: dict[str, argparse.Action] = {}
    for action in parser._actions:
        long = next((o for o in action.option_strings if o.startswith("--")), None)
        if long is None or action.dest in ("help", "config"):
            continue
        flags[long[2:]] = action
    return flags


def config_tokens(path: str | Path, parser: argparse.ArgumentParser) -> list[str]:
    """The settings of the TOML file at `path` as command-line tokens for `parser` (ConfigFileError if unusable)."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise ConfigFileError(f"cannot read {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigFileError(f"{path}: not valid TOML: {e}") from None
    flags = settable_flags(parser)
    tokens: list[str] = []
    for key, value in table.items():
        action = flags.get(key.replace("_", "-"))
        if action is None:
            raise ConfigFileError(f"{path}: unknown setting {key!r}; the settings are the serve flags: "
                                  + ", ".join(sorted(flags)))
        tokens += _tokens(str(path), key, value, action)
    return tokens


def _tokens(path: str, key: str, value: Any, action: argparse.Action) -> list[str]:
    flag = next(o for o in action.option_strings if o.startswith("--"))
    if action.nargs == 0:  # a switch (store_true): true sets it, false leaves the default
        if not isinstance(value, bool):
            raise ConfigFileError(f"{path}: {key} is a switch: true or false, not {value!r}")
        return [flag] if value else []
    if isinstance(value, bool | dict | list):
        raise ConfigFileError(f"{path}: {key} takes one value (a number or a string), not {value!r}")
    return [f"{flag}={value}"]  # one token: a value that starts with "-" stays a value
