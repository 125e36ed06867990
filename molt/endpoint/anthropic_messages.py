"""The Anthropic Messages API: `POST /v1/messages` as a `message` object or the server-sent events
the Anthropic SDK's `stream=True` and `messages.stream()` consume, and `POST
/v1/messages/count_tokens`.

A request's content blocks (`text`, `tool_use`, `tool_result`) and top-level `system` are
converted to normalized chat messages; a Reply's text and tool calls become content blocks in
the order the model wrote them. Honoured: model, max_tokens, messages, system, tools,
tool_choice (auto, none, any, tool), temperature, top_p (1 only), top_k (unset or -1),
stop_sequences, stream, and `seed` (not in the API; via extra_body). Ignored: metadata,
service_tier, thinking (refused when enabled), disable_parallel_tool_use.
"""

from __future__ import annotations

import json
import uuid

from aiohttp import web

from molt.endpoint.errors import RequestError, anthropic_error_body
from molt.endpoint.fields import check, optional, read_json_object, sampling_temperature
from molt.endpoint.messages import ChatRequest, Reply, Sampling, Started, ToolCall, ToolChoice, normalize_messages
from molt.endpoint.stream import handle_request

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


async def handle_messages(request: web.Request, session) -> web.StreamResponse:
    """POST /v1/messages."""
    return await handle_request(request, session, MESSAGES)


async def handle_count_tokens(request: web.Request, session) -> web.Response:
    """POST /v1/messages/count_tokens: the prompt tokens the conversation would take as a new segment."""
    try:
        body = await read_json_object(request)
        check(isinstance(body.get("model"), str), "'model' is required and must be a string")
        tools = convert_tools(optional(body, "tools", list) or [])
        messages = normalize_messages(convert_messages(body.get("messages"), body.get("system")))
    except RequestError as error:
        return web.json_response(anthropic_error_body(error), status=error.status)
    return web.json_response({"input_tokens": session.count_prompt_tokens(messages, tools or None)})


# -- request: Anthropic -> normalized chat ------------------------------------------------------


def parse_messages_request(body: dict) -> ChatRequest:
    """Validate a Messages request body and convert it; raises RequestError(400) naming the field."""
    check(isinstance(body.get("model"), str), "'model' is required and must be a string")
    check("max_tokens" in body, "'max_tokens' is required")
    max_tokens = body["max_tokens"]
    check(_is_int(max_tokens) and max_tokens >= 1, f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    stop = optional(body, "stop_sequences", list)
    check(stop is None or all(isinstance(s, str) and s for s in stop),
           "'stop_sequences' must be a list of non-empty strings")
    check(isinstance(body.get("stream", False), bool), "'stream' must be a boolean")
    optional(body, "metadata", dict)
    thinking = optional(body, "thinking", dict)
    check(not thinking or thinking.get("type") == "disabled",
           "'thinking' is not supported: the chat template decides what the model writes; leave it unset")
    seed = body.get("seed")  # not in the Anthropic API; accepted (via extra_body) for reproducible rollouts
    check(seed is None or _is_int(seed), f"'seed' must be an integer, got {seed!r}")
    tools = convert_tools(optional(body, "tools", list) or [])
    sampling = Sampling(max_tokens=max_tokens, temperature=sampling_temperature(body),
                        stop=tuple(stop) if stop else None, seed=seed)
    return ChatRequest(messages=normalize_messages(convert_messages(body.get("messages"), body.get("system"))),
                       tools=tools or None, tool_choice=_tool_choice(body.get("tool_choice"), tools),
                       sampling=sampling, stream=body.get("stream", False))


def convert_messages(messages, system) -> list[dict]:
    """Anthropic `system` + `messages` -> OpenAI-style chat messages, in order.

    A user turn's `tool_result` blocks become one `tool` message each, placed before the turn's
    text; an assistant turn's `tool_use` blocks become its `tool_calls`.
    """
    check(isinstance(messages, list) and messages, "'messages' must be a non-empty list")
    converted = []
    system_text = _system_text(system)
    if system_text:
        converted.append({"role": "system", "content": system_text})
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        check(isinstance(message, dict), f"{where} must be an object, got {type(message).__name__}")
        role = message.get("role")
        check(role in ("user", "assistant"), f"{where}.role must be 'user' or 'assistant', got {role!r}")
        blocks = _blocks(message.get("content"), f"{where}.content")
        if role == "user":
            converted += _convert_user_turn(blocks, where)
        else:
            converted.append(_convert_assistant_turn(blocks, where))
    return converted


def _convert_user_turn(blocks: list[dict], where: str) -> list[dict]:
    tool_messages, parts = [], []
    for position, block in enumerate(blocks):
        block_where = f"{where}.content[{position}]"
        if block["type"] in ("text", "image"):
            parts.append(block)
        elif block["type"] == "tool_result":
            tool_messages.append(_convert_tool_result(block, block_where))
        else:
            _unsupported_block(block["type"], block_where)
    if parts or not tool_messages:
        return tool_messages + [{"role": "user", "content": _joined_content(parts)}]
    return tool_messages


def _joined_content(blocks: list[dict]) -> str | list[dict]:
    """Text blocks joined by newlines; with images, the blocks in order (texts still newline-separated)."""
    if all(block["type"] == "text" for block in blocks):
        return "\n".join(block["text"] for block in blocks)
    parts, previous = [], None
    for block in blocks:
        if block["type"] == "text" and previous == "text":
            parts.append({"type": "text", "text": "\n"})
        parts.append(block)
        previous = block["type"]
    return parts


def _convert_tool_result(block: dict, where: str) -> dict:
    tool_use_id = block.get("tool_use_id")
    check(isinstance(tool_use_id, str) and tool_use_id, f"{where}.tool_use_id must be a non-empty string")
    is_error = block.get("is_error", False)
    check(isinstance(is_error, bool), f"{where}.is_error must be a boolean")
    content = block.get("content", "")
    if isinstance(content, list):
        blocks = _blocks(content, f"{where}.content")
        for position, part in enumerate(blocks):
            if part["type"] not in ("text", "image"):
                _unsupported_block(part["type"], f"{where}.content[{position}]")
        content = _joined_content(blocks)
    check(isinstance(content, (str, list)), f"{where}.content must be a string or a list of text and image blocks")
    if is_error:  # the chat template has no error flag, so the model reads it in the text
        content = f"Error: {content}" if isinstance(content, str) else [{"type": "text", "text": "Error: "}, *content]
    return {"role": "tool", "tool_call_id": tool_use_id, "content": content}


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
    check(isinstance(block.get("id"), str) and block["id"], f"{where}.id must be a non-empty string")
    check(isinstance(block.get("name"), str) and block["name"], f"{where}.name must be a non-empty string")
    check(isinstance(block.get("input"), dict), f"{where}.input must be an object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def convert_tools(tools: list) -> list[dict]:
    """Anthropic client tools -> OpenAI-style function tools."""
    converted = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        check(isinstance(tool, dict), f"{where} must be an object")
        check(tool.get("type") in (None, "custom"),
               f"{where}.type={tool.get('type')!r}: server tools are not supported; define a client tool "
               f"with name, description and input_schema")
        check(isinstance(tool.get("name"), str) and tool["name"], f"{where}.name must be a non-empty string")
        check(isinstance(tool.get("input_schema"), dict), f"{where}.input_schema must be a JSON schema object")
        # OpenAI's key order (name, description, parameters): the template renders the JSON as
        # is, so the same tool declared through either SDK gives the same prompt tokens.
        function = {"name": tool["name"]}
        if tool.get("description") is not None:
            check(isinstance(tool["description"], str), f"{where}.description must be a string")
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        converted.append({"type": "function", "function": function})
    return converted


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
    check(isinstance(content, list), f"{where} must be a string or a list of content blocks")
    for position, block in enumerate(content):
        check(isinstance(block, dict) and isinstance(block.get("type"), str),
               f"{where}[{position}] must be an object with a string 'type'")
        if block["type"] == "text":
            check(isinstance(block.get("text"), str), f"{where}[{position}].text must be a string")
    return content


def _unsupported_block(kind: str, where: str):
    if kind == "image":
        raise RequestError(400, f"{where}: image blocks are accepted in user turns and tool results only")
    raise RequestError(400, f"{where}: content block type {kind!r} is not supported here")


def _tool_choice(choice, tools: list[dict]) -> ToolChoice:
    """auto | none | any (some tool) | tool (the named one)."""
    if choice is None:
        return ToolChoice()
    check(isinstance(choice, dict) and isinstance(choice.get("type"), str),
           "'tool_choice' must be an object with a 'type'")
    kind = choice["type"]
    check(kind in ("auto", "none", "any", "tool"),
           f"tool_choice type {kind!r} must be 'auto', 'none', 'any' or 'tool'")
    check(kind in ("auto", "none") or tools, f"tool_choice type {kind!r} needs at least one tool in 'tools'")
    if kind == "tool":
        name = choice.get("name")
        check(name in {tool["function"]["name"] for tool in tools},
               f"tool_choice names tool {name!r}, which is not in 'tools'")
        return ToolChoice(mode="function", name=name)
    return ToolChoice(mode={"any": "required"}.get(kind, kind))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- response: Reply -> Anthropic message ----------------------------------------------------


def build_message(reply: Reply, *, model: str, message_id: str | None = None) -> dict:
    """The non-streaming `message` object: the reply's text and tool calls as blocks, in order."""
    message = _message_skeleton(message_id or _message_id(), model, reply.prompt_tokens)
    blocks = [{"type": "text", "text": part} if isinstance(part, str)
              else _tool_use_block(part, json.loads(part.arguments)) for part in reply.parts]
    # A reply with neither text nor tool calls still gets its (empty) text block, so agents that
    # read `content[0].text` see an empty answer rather than an IndexError.
    message["content"] = blocks or [{"type": "text", "text": ""}]
    message["stop_reason"], message["stop_sequence"] = _stop(reply)
    message["usage"]["output_tokens"] = reply.completion_tokens
    return message


def _stop(reply: Reply) -> tuple[str, str | None]:
    if reply.stop_sequence is not None and reply.finish_reason == "stop":
        return "stop_sequence", reply.stop_sequence
    return STOP_REASONS[reply.finish_reason], None


def _message_skeleton(message_id: str, model: str, input_tokens: int) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0}}


def _tool_use_block(call: ToolCall, tool_input: dict) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": tool_input}


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


# -- streaming: server-sent events -------------------------------------------------------------


class MessageEvents:
    """message_start (with the real input_tokens); a text block fed by text_delta events as text
    arrives, closed when a tool call follows; one block per tool call (its whole input in one
    input_json_delta); message_delta (stop reason, usage); message_stop."""

    def __init__(self, response: web.StreamResponse, *, model: str):
        self.response = response
        self.model = model
        self.index = 0  # of the next block
        self.text_open = False

    async def start(self, started: Started) -> None:
        message = _message_skeleton(_message_id(), self.model, started.prompt_tokens)
        await self._event("message_start", {"type": "message_start", "message": message})

    async def text(self, text: str) -> None:
        if not self.text_open:
            await self._start_block({"type": "text", "text": ""})
            self.text_open = True
        await self._event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                  "delta": {"type": "text_delta", "text": text}})

    async def tool_call(self, call: ToolCall) -> None:
        await self._close_text()
        await self._start_block(_tool_use_block(call, {}))
        await self._event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                  "delta": {"type": "input_json_delta", "partial_json": call.arguments}})
        await self._stop_block()

    async def end(self, reply: Reply) -> None:
        if not reply.parts:
            await self._start_block({"type": "text", "text": ""})
            self.text_open = True
        await self._close_text()
        stop_reason, stop_sequence = _stop(reply)
        # The SDK reads usage on message_delta as cumulative totals.
        await self._event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens}})
        await self._event("message_stop", {"type": "message_stop"})

    async def error(self, error: RequestError) -> None:
        await self._event("error", anthropic_error_body(error))

    async def _close_text(self) -> None:
        if self.text_open:
            self.text_open = False
            await self._stop_block()

    async def _start_block(self, block: dict) -> None:
        await self._event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})

    async def _stop_block(self) -> None:
        await self._event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.index += 1

    async def _event(self, event: str, data: dict) -> None:
        # One write per event, so a reader never sees half an event.
        await self.response.write(f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode())


class Messages:
    api = "anthropic"

    def parse(self, body: dict, session) -> ChatRequest:
        return parse_messages_request(body)

    def build(self, reply: Reply, chat: ChatRequest, session) -> dict:
        return build_message(reply, model=session.model_name)

    def open_stream(self, response: web.StreamResponse, chat: ChatRequest, session) -> MessageEvents:
        return MessageEvents(response, model=session.model_name)


MESSAGES = Messages()
