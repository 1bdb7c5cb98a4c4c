"""Command-line flags generated from config dataclasses (`EngineConfig`, `GatewayConfig`): a new field is a new flag.

Each flag's name, help and choices come from the field's `engine.options.Option` and its value's parsing from the
field's type; argparse's default is None (a bool field's flag is a switch), so only the flags given on the command
line (or in a config file) reach the config, and everything else keeps the config's own default.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Collection
from dataclasses import fields
from typing import Any

from engine.options import Option, default_text, options_of


class FlagError(ValueError):
    """A flag's value cannot be turned into its field's value (the message names the flag)."""


def dest(opt: Option) -> str:
    """The argparse attribute a flag's value lands in."""
    return opt.flag.lstrip("-").replace("-", "_")


def scalar_type(hint: Any) -> type:
    """What a flag's text is parsed as: the field's int, float or str (`int | None` -> int); str otherwise."""
    kinds = typing.get_args(hint) or (hint,)
    return next((k for k in (int, float) if k in kinds), str)


def _selected(cls: type, skip: Collection[str], only: Collection[str] | None) -> dict[str, Option]:
    return {name: opt for name, opt in options_of(cls).items()
            if name not in skip and (only is None or name in only)}


def add_flags(parser: argparse.ArgumentParser, cls: type, *, skip: Collection[str] = (),
              only: Collection[str] | None = None) -> None:
    """Add a flag for every option field of `cls` (but `skip`; `only` these, when given) to `parser`."""
    defaults = {f.name: f.default for f in fields(cls)}
    hints = typing.get_type_hints(cls)
    for name, opt in _selected(cls, skip, only).items():
        if isinstance(defaults[name], bool):
            parser.add_argument(opt.flag, action="store_true", help=opt.help.replace("%", "%%"))
            continue
        text = f"{opt.help} (default: {default_text(cls, name)})".replace("%", "%%")  # argparse formats help with %
        parser.add_argument(opt.flag, type=scalar_type(hints[name]), choices=opt.choices, default=None,
                            metavar=opt.metavar, help=text)


def given(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """Field -> value for every option field of `cls` whose flag `args` holds (FlagError for a bad value)."""
    defaults = {f.name: f.default for f in fields(cls)}
    values: dict[str, Any] = {}
    for name, opt in options_of(cls).items():
        value = getattr(args, dest(opt), None)  # None: not given, or not a flag of this command
        if value is None or value is False:  # not given (a switch not given is False)
            continue
        if isinstance(defaults[name], bool):
            value = not defaults[name]  # a switch sets the opposite of the default (--no-merge-lora: False)
        if opt.from_flag is not None:
            try:
                value = opt.from_flag(value)
            except ValueError as e:
                raise FlagError(f"{opt.flag} {e}") from None
        values[name] = value
    return values


def flag_table(*classes: type) -> str:
    """A Markdown table of the flags of `classes`: flag, default, the config field it sets (the README's)."""
    rows = ["| flag | default | sets |", "| --- | --- | --- |"]
    for cls in classes:
        defaults = {f.name: f.default for f in fields(cls)}
        for name, opt in options_of(cls).items():
            shown = "off" if isinstance(defaults[name], bool) else default_text(cls, name)
            rows.append(f"| `{opt.flag}` | {shown} | `{cls.__name__}.{name}` |")
    return "\n".join(rows)


if __name__ == "__main__":  # `python -m gateway.flags`: the README's flag table, regenerated
    from engine.engine_config import EngineConfig
    from gateway.gateway_config import GatewayConfig

    print(flag_table(EngineConfig, GatewayConfig))
