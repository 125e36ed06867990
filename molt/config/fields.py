"""What a field's annotation allows: the type check of the values a recipe assigns, the conversion of
`--set` strings, and the one rule for a field that takes a word from a fixed set (`Literal[...]`,
or a tuple of them): the value must be one of the words, and the error names them and the closest."""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing

from molt.config.schema import ConfigError, closest


def word_errors(key: str, value, hint) -> list[str]:
    """The Literal rule: `value` (or each item of a tuple of words) is one of the words `hint` allows."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal and value not in args:
        words, close = ", ".join(str(word) or "''" for word in args), closest(str(value), list(args), cutoff=0)
        return [f"{key}={value!r}: use one of {words}; did you mean {close!r}?"]
    if origin is tuple and isinstance(value, tuple):
        hints = [args[0]] * len(value) if args[-1:] == (Ellipsis,) else args
        return [error for index, (item, item_hint) in enumerate(zip(value, hints))
                for error in word_errors(f"{key}[{index}]", item, item_hint)]
    return []


def field_type_errors(section, prefix: str = "") -> list[str]:
    """One message per field whose value does not match its annotation (recipes assign plain Python,
    which nothing converts; `--set` converts, so its values always match)."""
    errors, hints = [], typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        key, value, hint = prefix + f.name, getattr(section, f.name), hints[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(value, hint):
            errors += field_type_errors(value, f"{key}.")
        elif not _has_type(value, hint):
            got = (f"({', '.join(type(item).__name__ for item in value)})" if isinstance(value, tuple)
                   else type(value).__name__)
            errors.append(f"{key}={value!r}: expected {type_name(hint)}, got {got}")
        else:
            errors += word_errors(key, value, hint)
    return errors


def _base_type(hint):
    """A Literal's words' type (str for every Literal of the config); any other hint as it is."""
    return type(typing.get_args(hint)[0]) if typing.get_origin(hint) is typing.Literal else hint


def _has_type(value, hint) -> bool:
    """isinstance against an annotation: an int is not a bool, a float field takes an int, and a tuple
    is checked item by item (tuple[float, float] also by length). A Literal's words are word_errors'."""
    hint = _base_type(hint)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_has_type(item, args[0]) for item in value)
        return len(value) == len(args) and all(map(_has_type, value, args))
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, arg) for arg in args)
    return isinstance(value, origin or hint)


def type_name(hint) -> str:
    """How an error names a type: as annotated, a Literal as the type of its words (`tuple[str, ...]`)."""
    name = str(hint) if typing.get_origin(hint) else getattr(hint, "__name__", str(hint))
    return re.sub(r"typing\.Literal\[[^\]]*\]", "str", name)


def convert(raw: str, hint, key: str):
    """A `--set key=raw` string as a value of the field's type `hint` (a Literal field's words are
    checked by word_errors after)."""
    hint = _base_type(hint)
    origin = typing.get_origin(hint)
    try:
        if hint is bool:
            lowered = raw.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return lowered in ("true", "1", "yes")
        if hint in (int, float, str):
            return hint(raw)
        if origin in (tuple, list):
            args = typing.get_args(hint)
            item_type = _base_type(args[0]) if args else str
            try:
                values = json.loads(raw if raw.startswith("[") else f"[{raw}]")
            except json.JSONDecodeError:
                if item_type is not str:
                    raise
                values = [v.strip() for v in raw.strip("[]").split(",") if v.strip()]  # norms,biases
            return origin(item_type(v) for v in values)
        if origin in (typing.Union, types.UnionType):
            members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
            if len(members) == 1:  # X | None: none/null, or an X (rollout.capture_routes=False)
                return None if raw.lower() in ("none", "null") else convert(raw, members[0], key)
            return json.loads(raw)
        if origin is dict:  # a JSON object: rollout.engine_args='{"max_num_seqs": 64}'
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError(raw)
            return value
    except (ValueError, json.JSONDecodeError) as error:
        raise ConfigError(f"--set {key}={raw!r}: expected {type_name(hint)}") from error
    raise ConfigError(f"--set {key}: fields of type {type_name(hint)} cannot be set from the command line")
