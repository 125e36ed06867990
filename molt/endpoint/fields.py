"""Reading request bodies: the JSON object, and typed optional fields whose errors name the field."""

from __future__ import annotations

import json
import math

from aiohttp import web

from molt.endpoint.errors import RequestError

_JSON_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object"}


async def read_json_object(request: web.Request) -> dict:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise RequestError(400, f"the request body is not valid JSON ({error}); send a JSON object") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {json_type(body)}")
    return body


def optional(body: dict, name: str, kind: type, *, where: str = ""):
    """body[name] when present and not null, checked to be of JSON type `kind` (a float for float)."""
    value = body.get(name)
    if value is None:
        return None
    if not _is_json_type(value, kind):
        raise RequestError(400, f"'{where}{name}' must be {_JSON_NAMES[kind]}, got {json_type(value)} "
                                f"{json.dumps(value)[:200]}", param=where + name)
    return float(value) if kind is float else value


def required(body: dict, name: str, kind: type, *, where: str = ""):
    if body.get(name) is None:
        raise RequestError(400, f"'{where}{name}' is required ({_JSON_NAMES[kind]})", param=where + name)
    return optional(body, name, kind, where=where)


def number_in(body: dict, name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    """An optional finite number in [low, high] ((low, high] with `low_open`)."""
    value = optional(body, name, float)
    if value is None:
        return None
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise RequestError(400, f"{name}={value:g} must be a number in {interval}", param=name)
    return value


def positive_int(body: dict, name: str) -> int | None:
    value = optional(body, name, int)
    if value is not None and value < 1:
        raise RequestError(400, f"{name}={value} must be at least 1", param=name)
    return value


def check(condition, message: str, param: str | None = None) -> None:
    if not condition:
        raise RequestError(400, message, param=param)


def json_type(value) -> str:
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _is_json_type(value, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):  # an int in Python, not in JSON
        return False
    if kind is float:  # an integer is a fine number
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def sampling_temperature(body: dict) -> float | None:
    """The request's temperature under Molt's sampling contract, after refusing what the trainer
    cannot reproduce: greedy decoding (temperature 0: no sample of the policy, and no log-prob to
    recompute) and truncated sampling (top_p below 1, top_k above 0), since the trainer recomputes
    log-probs over the full vocabulary at the recorded temperature."""
    temperature = number_in(body, "temperature", 0.0, 100.0)
    if temperature == 0:
        raise RequestError(400, "temperature=0 (greedy decoding) is not supported: a rollout must sample the "
                                "policy at a temperature > 0; leave temperature unset for rollout.temperature",
                           param="temperature")
    top_p = number_in(body, "top_p", 0.0, 1.0, low_open=True)
    if top_p is not None and top_p < 1:
        raise RequestError(400, f"top_p={top_p:g} is not supported: the trainer recomputes log-probs over the "
                                f"full vocabulary, so nucleus sampling would mismatch them; send top_p=1 or leave "
                                f"it unset", param="top_p")
    top_k = optional(body, "top_k", int)
    if top_k is not None and top_k > 0:
        raise RequestError(400, f"top_k={top_k} is not supported: the trainer recomputes log-probs over the full "
                                f"vocabulary, so top-k sampling would mismatch them; leave top_k unset (or -1)",
                           param="top_k")
    return temperature
