"""Loading a run's config: a Python recipe (`--config PATH[:FUNCTION]`, default function `config`)
returns a fresh MoltConfig, and repeatable `--set section.field=value` overrides change it, each
converted to the field's type, an unknown key refused with the closest valid one. Also the command
line the ways in share, and `python -m molt.config`, which prints the resolved config."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import typing
from pathlib import Path

from molt.config.fields import convert, word_errors
from molt.config.schema import ConfigError, MoltConfig, closest
from molt.config.validate import validate_config


def load_config(spec: str, overrides: list[str] = ()) -> MoltConfig:
    """Build the config named by `PATH[:FUNCTION]` and apply `a.b=value` overrides."""
    path, _, function_name = spec.partition(":")
    function_name = function_name or "config"
    if not Path(path).is_file():
        raise ConfigError(f"--config {spec!r}: no file {path!r}; pass a recipe such as configs/demo.py")
    module_spec = importlib.util.spec_from_file_location(f"molt_recipe_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    function = getattr(module, function_name, None)
    if not callable(function):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise ConfigError(f"--config {spec!r}: {path} has no function {function_name!r}; it has {names}")
    try:
        cfg = function()
    except ConfigError as error:
        raise ConfigError(f"--config {spec!r}: {error}") from error
    if not isinstance(cfg, MoltConfig):
        raise ConfigError(f"--config {spec!r}: {function_name}() returned {type(cfg).__name__}, not MoltConfig")
    for item in overrides:
        apply_override(cfg, item)
    return cfg


def apply_override(cfg: MoltConfig, item: str) -> None:
    """Set one `a.b=value` on `cfg`, converting the value to the field's declared type."""
    key, sep, raw = item.partition("=")
    if not sep:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.learning_rate=1e-5")
    target = cfg
    parts = key.strip().split(".")
    for depth, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(target)}
        if part not in fields:
            close = closest(key, _all_keys(cfg)) or ".".join([*parts[:depth], next(iter(fields))])
            raise ConfigError(f"--set {item!r}: unknown key {key!r}; did you mean {close!r}?")
        if depth == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(target, part)):
                raise ConfigError(f"--set {item!r}: {key!r} is a section; set one of its fields")
            hint = typing.get_type_hints(type(target))[part]
            value = convert(raw.strip(), hint, key)
            if errors := word_errors(key, value, hint):  # a word from a fixed set: one of its words
                raise ConfigError(f"--set {errors[0]}")
            setattr(target, part, value)
        else:
            target = getattr(target, part)
            if not dataclasses.is_dataclass(target):
                raise ConfigError(f"--set {item!r}: {'.'.join(parts[:depth + 1])!r} is not a section")


def _all_keys(cfg, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            keys += _all_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def build_arg_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="recipe file, PATH[:FUNCTION] (default function: config)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the layout, start nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser("Print the resolved Molt config.").parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        validate_config(cfg)
    except ConfigError as error:
        sys.stderr.write(f"error: {error}\n")
        return 2
    sys.stdout.write(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return 0
