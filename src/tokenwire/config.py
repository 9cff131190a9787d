"""`tokenwire serve` settings from a TOML file (--config) and the environment ($TOKENWIRE_<FLAG>).

Precedence: a flag on the command line > $TOKENWIRE_<FLAG> > the --config file > the default.
Each long flag `--kv-cache-mb` is the file key `kv-cache-mb` (or `kv_cache_mb`) and the
variable TOKENWIRE_KV_CACHE_MB. Values from the file and the environment become the parser's
defaults, so argparse converts and the command line still wins. Booleans read 1/true/yes/on or
0/false/no/off; a repeatable flag takes a TOML list, or a comma-separated variable.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ENV_PREFIX = "TOKENWIRE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """long flag without dashes (kv-cache-mb) -> its action, for every optional argument"""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and not isinstance(action, argparse._HelpAction):
                out[option[2:]] = action
    return out


def _config_path(argv: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return os.environ.get(env_name("config")) or None


def _value(action: argparse.Action, raw: Any, where: str) -> Any:
    """A file or environment value as the parser's default for `action`."""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        text = str(raw).strip().lower()
        if text not in _TRUE | _FALSE:
            raise ValueError(f"{where}: expected true or false, got {raw!r}")
        on = text in _TRUE  # the flag is given
        return on if isinstance(action, argparse._StoreTrueAction) else not on
    if isinstance(action, argparse._AppendAction):
        items = raw if isinstance(raw, list) else [s for s in str(raw).split(",") if s]
        return [action.type(str(i)) if action.type is not None else str(i) for i in items]  # type: ignore[misc]
    if isinstance(raw, list | dict):
        raise ValueError(f"{where}: expected a single value, got {raw!r}")
    value = str(raw)  # argparse converts string defaults with the flag's type
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def config_defaults(
    parser: argparse.ArgumentParser, argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """dest -> default, from the --config file and then the environment (which wins)."""
    environ = os.environ if environ is None else environ
    flags = _flags(parser)
    defaults: dict[str, Any] = {}
    path = _config_path(argv)
    if path is not None:
        try:
            table = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"--config {path}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--config {path}: not valid TOML: {exc}") from None
        for key, raw in table.items():
            action = flags.get(key.replace("_", "-"))
            if action is None or key == "config":
                raise ValueError(f"--config {path}: unknown setting {key!r} (use a serve flag's name)")
            defaults[action.dest] = _value(action, raw, f"--config {path}: {key}")
    for flag, action in flags.items():
        name = env_name(flag)
        if name in environ and flag != "config":
            defaults[action.dest] = _value(action, environ[name], f"${name}")
    return defaults


def apply_config_defaults(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    parser.set_defaults(**config_defaults(parser, argv))
