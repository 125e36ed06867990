"""The Anthropic Messages API on the session endpoint: `POST /s/<id>/v1/messages`.

A request's Anthropic-shaped conversation (content blocks, `tool_use` / `tool_result`, a
top-level `system`) is converted to the OpenAI-style chat messages the Session renders; the
Session's Reply is returned as a `message` object, or streamed as the server-sent events that
the Anthropic SDK's `stream=True` and `messages.stream()` consume.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from molt.endpoint.server import anthropic_error
from molt.endpoint.session import Reply, RequestError, Sampling, Session
from molt.endpoint.tool_calls import ToolCall

logger = logging.getLogger("molt")

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
TOOL_CHOICES = ("auto", "none")  # forcing a tool ('any', 'tool') needs constrained decoding


@dataclass(kw_only=True)
class MessagesRequest:
    """A Messages API request, converted for the Session."""

    messages: list[dict]  # OpenAI-style chat messages
    tools: list[dict] | None  # OpenAI-style function tools
    sampling: Sampling
    stream: bool


async def handle_messages(request: web.Request, session: Session) -> web.StreamResponse:
    try:
        parsed = parse_messages_request(await read_json_body(request))
    except RequestError as error:
        return anthropic_error(error.status, error.message, error.kind)
    if parsed.stream:
        return await stream_message(request, session, parsed)
    try:
        reply = await session.complete(parsed.messages, parsed.tools, parsed.sampling)
    except RequestError as error:
        return anthropic_error(error.status, error.message, error.kind)
    return web.json_response(build_message(reply, model=session.model_name))


async def read_json_body(request: web.Request) -> dict:
    body = await request.read()
    try:
        data = json.loads(body)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise RequestError(400, f"request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data


# -- request: Anthropic -> OpenAI-style chat --------------------------------------------------


def parse_messages_request(body: dict) -> MessagesRequest:
    """Validate a Messages request body and convert it; raises RequestError(400) naming the field."""
    _check(isinstance(body.get("model"), str), "'model' is required and must be a string")
    _check("max_tokens" in body, "'max_tokens' is required")
    max_tokens = body["max_tokens"]
    _check(_is_int(max_tokens) and max_tokens >= 1, f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    _check(body.get("top_k") is None, "'top_k' is not supported by this endpoint; leave it unset")
    stop = _optional(body, "stop_sequences", list)
    _check(stop is None or all(isinstance(s, str) and s for s in stop),
           "'stop_sequences' must be a list of non-empty strings")
    _check(isinstance(body.get("stream", False), bool), "'stream' must be a boolean")
    _optional(body, "metadata", dict)
    seed = body.get("seed")  # not in the Anthropic API; accepted (via extra_body) for reproducible rollouts
    _check(seed is None or _is_int(seed), f"'seed' must be an integer, got {seed!r}")
    tools = convert_tools(_optional(body, "tools", list) or [])
    if _tool_choice(body.get("tool_choice")) == "none":
        tools = []  # the model is not to call tools, so they are not offered in the prompt
    top_p = _number(body, "top_p", 0.0, 1.0)
    _check(top_p != 0.0, "'top_p' must be in (0, 1], got 0")
    messages = convert_messages(body.get("messages"), body.get("system"))
    sampling = Sampling(max_tokens=max_tokens, temperature=_number(body, "temperature", 0.0, 2.0),
                        top_p=top_p, stop=stop or None, seed=seed)
    return MessagesRequest(messages=messages, tools=tools or None, sampling=sampling,
                           stream=body.get("stream", False))


def convert_messages(messages, system) -> list[dict]:
    """Anthropic `system` + `messages` -> OpenAI-style chat messages, in order.

    A user turn's `tool_result` blocks become one `tool` message each, placed before the turn's
    text; an assistant turn's `tool_use` blocks become its `tool_calls`.
    """
    _check(isinstance(messages, list) and messages, "'messages' must be a non-empty list")
    converted = []
    system_text = _system_text(system)
    if system_text:
        converted.append({"role": "system", "content": system_text})
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        _check(isinstance(message, dict), f"{where} must be an object, got {type(message).__name__}")
        role = message.get("role")
        _check(role in ("user", "assistant"), f"{where}.role must be 'user' or 'assistant', got {role!r}")
        blocks = _blocks(message.get("content"), f"{where}.content")
        if role == "user":
            converted += _convert_user_turn(blocks, where)
        else:
            converted.append(_convert_assistant_turn(blocks, where))
    return converted


def _convert_user_turn(blocks: list[dict], where: str) -> list[dict]:
    tool_messages, texts = [], []
    for position, block in enumerate(blocks):
        block_where = f"{where}.content[{position}]"
        if block["type"] == "text":
            texts.append(block["text"])
        elif block["type"] == "tool_result":
            tool_messages.append(_convert_tool_result(block, block_where))
        else:
            _unsupported_block(block["type"], block_where)
    if texts or not tool_messages:
        return tool_messages + [{"role": "user", "content": "\n".join(texts)}]
    return tool_messages


def _convert_tool_result(block: dict, where: str) -> dict:
    tool_use_id = block.get("tool_use_id")
    _check(isinstance(tool_use_id, str) and tool_use_id, f"{where}.tool_use_id must be a non-empty string")
    is_error = block.get("is_error", False)
    _check(isinstance(is_error, bool), f"{where}.is_error must be a boolean")
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for position, part in enumerate(_blocks(content, f"{where}.content")):
            if part["type"] != "text":
                _unsupported_block(part["type"], f"{where}.content[{position}]")
            texts.append(part["text"])
        content = "\n".join(texts)
    _check(isinstance(content, str), f"{where}.content must be a string or a list of text blocks")
    # The chat template has no error flag, so the model reads it in the text.
    return {"role": "tool", "tool_call_id": tool_use_id, "content": f"Error: {content}" if is_error else content}


def _convert_assistant_turn(blocks: list[dict], where: str) -> dict:
    texts, tool_calls = [], []
    for position, block in enumerate(blocks):
        block_where = f"{where}.content[{position}]"
        if block["type"] == "text":
            texts.append(block["text"])
        elif block["type"] == "tool_use":
            tool_calls.append(_convert_tool_use(block, block_where))
        else:
            _unsupported_block(block["type"], block_where)
    message = {"role": "assistant", "content": "".join(texts)}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _convert_tool_use(block: dict, where: str) -> dict:
    _check(isinstance(block.get("id"), str) and block["id"], f"{where}.id must be a non-empty string")
    _check(isinstance(block.get("name"), str) and block["name"], f"{where}.name must be a non-empty string")
    _check(isinstance(block.get("input"), dict), f"{where}.input must be an object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def convert_tools(tools: list) -> list[dict]:
    """Anthropic client tools -> OpenAI-style function tools."""
    converted = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        _check(isinstance(tool, dict), f"{where} must be an object")
        _check(tool.get("type") in (None, "custom"),
               f"{where}.type={tool.get('type')!r}: server tools are not supported; define a client tool "
               f"with name, description and input_schema")
        _check(isinstance(tool.get("name"), str) and tool["name"], f"{where}.name must be a non-empty string")
        _check(isinstance(tool.get("input_schema"), dict), f"{where}.input_schema must be a JSON schema object")
        # OpenAI's key order (name, description, parameters): the template renders the JSON as
        # is, so the same tool declared through either SDK gives the same prompt tokens.
        function = {"name": tool["name"]}
        if tool.get("description") is not None:
            _check(isinstance(tool["description"], str), f"{where}.description must be a string")
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice) -> str:
    if choice is None:
        return "auto"
    _check(isinstance(choice, dict) and isinstance(choice.get("type"), str),
           "'tool_choice' must be an object with a 'type'")
    _check(choice["type"] in TOOL_CHOICES,
           f"tool_choice type {choice['type']!r} is not supported yet; use 'auto' or 'none'")
    return choice["type"]


def _system_text(system) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    blocks = _blocks(system, "system")
    for position, block in enumerate(blocks):
        if block["type"] != "text":
            _unsupported_block(block["type"], f"system[{position}]")
    return "\n".join(block["text"] for block in blocks)


def _blocks(content, where: str) -> list[dict]:
    """`content` (at path `where`) as a list of typed blocks; a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    _check(isinstance(content, list), f"{where} must be a string or a list of content blocks")
    for position, block in enumerate(content):
        _check(isinstance(block, dict) and isinstance(block.get("type"), str),
               f"{where}[{position}] must be an object with a string 'type'")
        if block["type"] == "text":
            _check(isinstance(block.get("text"), str), f"{where}[{position}].text must be a string")
    return content


def _unsupported_block(kind: str, where: str):
    if kind == "image":
        raise RequestError(400, f"{where}: image input is not supported yet")
    raise RequestError(400, f"{where}: content block type {kind!r} is not supported here")


def _optional(body: dict, name: str, kind: type):
    value = body.get(name)
    _check(value is None or isinstance(value, kind), f"'{name}' must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
           and low <= value <= high, f"'{name}' must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(condition, message: str) -> None:
    if not condition:
        raise RequestError(400, message)


# -- response: Reply -> Anthropic message ----------------------------------------------------


def build_message(reply: Reply, *, model: str, message_id: str | None = None) -> dict:
    """The non-streaming `message` object for a Reply."""
    message = _message_skeleton(message_id or _message_id(), model, reply.prompt_tokens)
    message["content"] = [{"type": "text", "text": reply.content}] if _has_text_block(reply) else []
    message["content"] += [_tool_use_block(call, _tool_input(call)) for call in reply.tool_calls]
    message["stop_reason"] = STOP_REASONS[reply.finish_reason]
    message["usage"]["output_tokens"] = reply.completion_tokens
    return message


def _message_skeleton(message_id: str, model: str, input_tokens: int) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0}}


def _has_text_block(reply: Reply) -> bool:
    # A reply with neither text nor tool calls still gets its (empty) text block, so agents that
    # read `content[0].text` see an empty answer rather than an IndexError.
    return bool(reply.content) or not reply.tool_calls


def _tool_use_block(call: ToolCall, tool_input: dict) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": tool_input}


def _tool_input(call: ToolCall) -> dict:
    return json.loads(call.arguments)  # the parser guarantees a JSON object


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


# -- streaming: server-sent events -------------------------------------------------------------


async def stream_message(request: web.Request, session: Session, parsed: MessagesRequest) -> web.StreamResponse:
    """Stream the reply as the Messages API's events. The HTTP status waits for the Session's first
    item, so a request it refuses (e.g. too long for the context) still gets a plain error response."""
    items = session.stream(parsed.messages, parsed.tools, parsed.sampling)
    try:
        try:
            first = await anext(items)
        except RequestError as error:
            return anthropic_error(error.status, error.message, error.kind)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            await write_message_events(response, first, items, model=session.model_name)
        except RequestError as error:
            await _write_error_event(response, error.kind, error.message)
        except Exception as error:  # the status line is sent: report in the stream, as the API does
            logger.exception("session %s: streamed generation failed", session.session_id)
            await _write_error_event(response, "api_error", f"generation failed: {error}")
        await response.write_eof()
        return response
    finally:
        # Also reached when a client disconnect cancels the handler: closing the Session's stream
        # aborts the engine request.
        await items.aclose()


async def write_message_events(response: web.StreamResponse, first: str | Reply, items: AsyncIterator[str | Reply],
                               *, model: str) -> None:
    """message_start; a text block fed by text_delta events as text arrives; one block per tool
    call (its whole input in one input_json_delta); message_delta (stop reason, usage); message_stop."""
    await _write_event(response, "message_start",
                       {"type": "message_start", "message": _message_skeleton(_message_id(), model, 0)})
    item, text_open = first, False
    while not isinstance(item, Reply):
        if item:
            if not text_open:
                await _start_block(response, 0, {"type": "text", "text": ""})
                text_open = True
            await _write_delta(response, 0, {"type": "text_delta", "text": item})
        item = await anext(items, None)
        if item is None:
            raise RequestError(500, "generation ended without a reply", "api_error")
    reply, index = item, 0
    if text_open or _has_text_block(reply):
        if not text_open:
            await _start_block(response, 0, {"type": "text", "text": ""})
        await _write_event(response, "content_block_stop", {"type": "content_block_stop", "index": 0})
        index = 1
    for call in reply.tool_calls:
        await _start_block(response, index, _tool_use_block(call, {}))
        await _write_delta(response, index, {"type": "input_json_delta", "partial_json": call.arguments})
        await _write_event(response, "content_block_stop", {"type": "content_block_stop", "index": index})
        index += 1
    # input_tokens is known only once the Session has rendered the prompt, so it is sent here too;
    # the SDK reads usage on message_delta as cumulative totals that replace message_start's.
    await _write_event(response, "message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": STOP_REASONS[reply.finish_reason], "stop_sequence": None},
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens}})
    await _write_event(response, "message_stop", {"type": "message_stop"})


async def _write_delta(response: web.StreamResponse, index: int, delta: dict) -> None:
    await _write_event(response, "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


async def _write_error_event(response: web.StreamResponse, kind: str, message: str) -> None:
    await _write_event(response, "error", {"type": "error", "error": {"type": kind, "message": message}})


async def _start_block(response: web.StreamResponse, index: int, block: dict) -> None:
    await _write_event(response, "content_block_start", {"type": "content_block_start", "index": index,
                                                         "content_block": block})


async def _write_event(response: web.StreamResponse, event: str, data: dict) -> None:
    # One write per event, so a reader never sees half an event.
    await response.write(f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode())
