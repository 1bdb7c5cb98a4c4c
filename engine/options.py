"""Options: the fields of a config dataclass, each with its default, its range check and its command-line flag.

`engine.engine_config.EngineConfig` and `gateway.gateway_config.GatewayConfig` declare every field with `option(...)`
(the value's one definition); the `voxgate` CLI builds its flags from that metadata (`gateway.flags`), a TOML config
file maps onto the same flags (`gateway.config_file`), and the dataclass's `__post_init__` runs every field's check
(`check_options`), so the CLI, a config file and a Python caller meet the same ranges and words. Environment switches
are the other kind of setting: `engine.settings` / `gateway.settings`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from engine.errors import InvalidParameter

Check = Callable[[str, Any], None]


@dataclass(frozen=True)
class Option:
    """How one config field is set from outside: its flag, help text and check (a flag's text is parsed as the
    field's int or float, else kept as text: `gateway.flags`)."""

    flag: str  # the long command-line flag; a bool field's flag sets the opposite of its default
    help: str  # what it does; the CLI adds "(default ...)" from the field's default or `default_text`
    check: Check | None = None  # raises InvalidParameter naming the field; None values skip it (see `optional`)
    choices: tuple[str, ...] | None = None
    # the parsed flag value -> the field's value (ValueError: a bad value, shown with the flag), e.g. "0,1" -> [0, 1]
    from_flag: Callable[[Any], Any] | None = None
    default_text: str | None = None  # the default in words, where the value alone does not say it
    optional: bool = False  # None is a valid value (it means "not set": the check does not see it)
    metavar: str | None = None  # the flag's value in help (default: argparse's, the flag in capitals)


def option(default: Any, *, flag: str, help: str, check: Check | None = None, choices: tuple[str, ...] | None = None,
           from_flag: Callable[[Any], Any] | None = None, default_text: str | None = None,
           optional: bool | None = None, metavar: str | None = None) -> Any:
    """A dataclass field with `default` and its `Option` metadata (`optional` defaults to "the default is None")."""
    meta = Option(flag=flag, help=help, check=check, choices=choices, from_flag=from_flag,
                  default_text=default_text, optional=default is None if optional is None else optional,
                  metavar=metavar)
    return field(default=default, metadata={"option": meta})


def options_of(cls: type) -> dict[str, Option]:
    """Field name -> its `Option`, for every option field of config dataclass `cls`, in field order."""
    return {f.name: f.metadata["option"] for f in fields(cls) if "option" in f.metadata}


def check_options(config: Any) -> None:
    """Run every option field's check on `config` (InvalidParameter naming the first bad field)."""
    for name, opt in options_of(type(config)).items():
        value = getattr(config, name)
        if value is None and opt.optional:
            continue
        if opt.choices is not None and value not in opt.choices:
            raise InvalidParameter(f"{name}: {value!r} is not one of {', '.join(opt.choices)}")
        if opt.check is not None:
            opt.check(name, value)


def default_text(cls: type, name: str) -> str:
    """The default of option field `name` of `cls` in words (for help texts and the README's flag table)."""
    f = next(f for f in fields(cls) if f.name == name)
    opt: Option = f.metadata["option"]
    if opt.default_text is not None:
        return opt.default_text
    return "none" if f.default is None else f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


# ---- checks (the request guards, `engine.guards`, use the same functions: one wording everywhere)
def check_int(name: str, value: Any, lo: int, hi: float = math.inf) -> None:
    """`value` is an int (not a bool) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidParameter(f"{name} must be an integer in [{lo}, {hi}] (got {value!r})")


def check_float(name: str, value: Any, lo: float, hi: float) -> None:
    """`value` is a finite real number (not a bool) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise InvalidParameter(f"{name} must be a finite number in [{lo}, {hi}] (got {value!r})")


def int_in(lo: int, hi: float = math.inf) -> Check:
    """A check: an int (not a bool) in [lo, hi]."""
    return lambda name, value: check_int(name, value, lo, hi)


def float_in(lo: float, hi: float = math.inf) -> Check:
    """A check: a finite real number (not a bool) in [lo, hi]."""
    return lambda name, value: check_float(name, value, lo, hi)


def fraction(name: str, value: Any) -> None:
    """A real number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise InvalidParameter(f"{name} must be in (0, 1] (got {value!r})")
