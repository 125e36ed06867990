"""The OpenAI Chat Completions API: `POST /v1/chat/completions` as the `chat.completion` object or
the `chat.completion.chunk` event stream the OpenAI SDK (and its `.stream()` helper) consumes.

Honoured: messages, tools, tool_choice, max_tokens / max_completion_tokens, temperature, top_p
(1 only), stop, seed, n (1 only), response_format, logprobs / top_logprobs, stream,
stream_options.include_usage. Ignored: model, user, metadata, store, parallel_tool_calls,
frequency/presence penalties (rejected when non-zero), service_tier, reasoning_effort.
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from molt.endpoint.errors import RequestError, openai_error_body
from molt.endpoint.fields import check, json_type, number_in, optional, positive_int, sampling_temperature
from molt.endpoint.messages import (ChatRequest, Reply, ResponseFormat, Sampling, Started, TokenLogprob,
                                    ToolCall, ToolChoice, normalize_messages)
from molt.endpoint.stream import handle_request


async def handle_chat_completions(request: web.Request, session) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await handle_request(request, session, CHAT_COMPLETIONS)


async def handle_models(request: web.Request, session) -> web.Response:
    """GET /v1/models: the one model this session serves."""
    return web.json_response({"object": "list", "data": [
        {"id": session.model_name, "object": "model", "created": 0, "owned_by": "molt"}]})


# -- request ------------------------------------------------------------------------------------


def parse_chat_request(body: dict) -> ChatRequest:
    if "messages" not in body:
        raise RequestError(400, "'messages' is required: a list of chat messages", param="messages")
    check(isinstance(body["messages"], list),
          f"'messages' must be a list of chat messages, got {json_type(body['messages'])}", "messages")
    optional(body, "model", str)
    num_choices = optional(body, "n", int)
    check(num_choices in (None, 1), f"n={num_choices} is not supported: a session samples one choice per request; "
                                    f"send n=1 or leave it out (several requests give several samples)", "n")
    for penalty in ("frequency_penalty", "presence_penalty"):
        value = number_in(body, penalty, -2.0, 2.0)
        if value:
            raise RequestError(400, f"{penalty}={value:g} is not supported: it changes the sampled distribution, "
                                    f"which the trainer could not reproduce; leave it unset", param=penalty)
    max_tokens = positive_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = positive_int(body, "max_tokens")
    stream_options = optional(body, "stream_options", dict) or {}
    tools = parse_function_tools(optional(body, "tools", list) or [], nested=True)
    return ChatRequest(
        messages=normalize_messages(body["messages"]), tools=tools or None,
        tool_choice=parse_tool_choice(body.get("tool_choice"), tools, nested=True),
        sampling=Sampling(max_tokens=max_tokens, temperature=sampling_temperature(body), stop=parse_stop(body),
                          seed=optional(body, "seed", int)),
        response_format=parse_response_format(optional(body, "response_format", dict)),
        top_logprobs=_top_logprobs(body), stream=bool(optional(body, "stream", bool)),
        include_usage=bool(optional(stream_options, "include_usage", bool, where="stream_options.")))


def parse_stop(body: dict) -> tuple[str, ...] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        return (stop,)
    check(isinstance(stop, list) and all(isinstance(item, str) for item in stop),
          f"'stop' must be a string or a list of strings, got {json.dumps(stop)[:200]}", "stop")
    return tuple(stop) or None


def parse_function_tools(tools: list, *, nested: bool) -> list[dict]:
    """OpenAI function tools as the chat template takes them. `nested`: chat completions'
    {"type": "function", "function": {...}}; otherwise the Responses API's flat form."""
    converted = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        kind = tool.get("type") if isinstance(tool, dict) else tool
        check(isinstance(tool, dict) and kind == "function",
              f"{where} must be an object with type 'function' (got {kind!r}); only function tools are supported", where)
        function = tool.get("function") if nested else tool
        check(isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"],
              f"{where}{'.function' if nested else ''} must have a non-empty string 'name'", where)
        entry = {"name": function["name"]}
        if function.get("description") is not None:
            entry["description"] = function["description"]
        if function.get("parameters") is not None:
            check(isinstance(function["parameters"], dict), f"{where} parameters must be a JSON schema object", where)
            entry["parameters"] = function["parameters"]
        converted.append({"type": "function", "function": entry})
    return converted


def parse_tool_choice(choice, tools: list[dict], *, nested: bool) -> ToolChoice:
    """'auto' | 'none' | 'required' | a named function ({"type": "function", "function": {"name"}}
    in chat completions, {"type": "function", "name"} in the Responses API)."""
    if choice is None or choice in ("auto", "none", "required"):
        mode = choice or "auto"
        check(mode != "required" or tools, "tool_choice='required' needs at least one tool in 'tools'", "tool_choice")
        return ToolChoice(mode=mode)
    function = choice.get("function") if nested and isinstance(choice, dict) else choice
    name = function.get("name") if isinstance(function, dict) else None
    check(isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str),
          f"tool_choice={json.dumps(choice)[:200]} must be 'auto', 'none', 'required' or a function "
          f"by name", "tool_choice")
    check(name in {tool["function"]["name"] for tool in tools},
          f"tool_choice names function {name!r}, which is not in 'tools'", "tool_choice")
    return ToolChoice(mode="function", name=name)


def parse_response_format(response_format: dict | None, *, where: str = "response_format") -> ResponseFormat | None:
    if response_format is None or response_format.get("type") == "text":
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return ResponseFormat(kind="json_object")
    check(kind == "json_schema", f"{where}.type={kind!r} must be 'text', 'json_object' or 'json_schema'", where)
    # Chat completions nest the schema in json_schema; the Responses API's text.format has it flat.
    spec = response_format.get("json_schema", response_format)
    check(isinstance(spec, dict) and isinstance(spec.get("schema"), dict),
          f"{where} of type json_schema needs a 'schema' object", where)
    return ResponseFormat(kind="json_schema", schema=spec["schema"])


def _top_logprobs(body: dict) -> int | None:
    top = optional(body, "top_logprobs", int)
    if not optional(body, "logprobs", bool):
        check(top is None, "top_logprobs needs logprobs=true", "top_logprobs")
        return None
    check(top is None or 0 <= top <= 20, f"top_logprobs={top} must be in [0, 20]", "top_logprobs")
    return top or 0


# -- response -----------------------------------------------------------------------------------


def build_chat_completion(reply: Reply, *, model: str, completion_id: str | None = None,
                          created: int | None = None, with_logprobs: bool = False) -> dict:
    """The non-streaming `chat.completion` object for one reply."""
    message = {"role": "assistant", "content": _message_content(reply), "refusal": None}
    if reply.tool_calls:
        message["tool_calls"] = [_tool_call(call) for call in reply.tool_calls]
    return {"id": completion_id or new_completion_id(), "object": "chat.completion",
            "created": int(time.time()) if created is None else created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason,
                         "logprobs": _logprobs(reply.logprobs) if with_logprobs else None}],
            "usage": build_usage(reply)}


def build_usage(reply: Reply) -> dict:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _message_content(reply: Reply) -> str | None:
    # OpenAI sends null content for a reply that is only tool calls.
    return None if reply.tool_calls and not reply.content else reply.content


def _tool_call(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _logprobs(tokens: list[TokenLogprob] | None) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(*alt) for alt in t.top]}
                        for t in tokens or []], "refusal": None}


# -- streaming ----------------------------------------------------------------------------------


class ChunkStream:
    """Writes one reply as `chat.completion.chunk` events, each in one write."""

    def __init__(self, response: web.StreamResponse, *, model: str, include_usage: bool, with_logprobs: bool):
        self.response = response
        self.model = model
        self.include_usage = include_usage
        self.with_logprobs = with_logprobs
        self.completion_id = new_completion_id()
        self.created = int(time.time())
        self.started = False  # the first chunk (with the role) is out
        self.num_calls = 0

    async def start(self, started: Started) -> None:
        """Nothing yet: the first chunk carries the role with the first content or call."""

    async def text(self, text: str) -> None:
        await self._send_choice({"role": "assistant", "content": text} if not self.started else {"content": text})
        self.started = True

    async def tool_call(self, call: ToolCall) -> None:
        if not self.started:
            # Only tool calls so far: null content, as in the non-streamed message.
            await self._send_choice({"role": "assistant", "content": None})
            self.started = True
        await self._send_choice({"tool_calls": [{"index": self.num_calls, **_tool_call(call)}]})
        self.num_calls += 1

    async def end(self, reply: Reply) -> None:
        if not self.started:
            await self._send_choice({"role": "assistant", "content": ""})
        logprobs = _logprobs(reply.logprobs) if self.with_logprobs else None
        await self._send_choice({}, finish_reason=reply.finish_reason, logprobs=logprobs)
        if self.include_usage:
            await self._send(self._chunk([], usage=build_usage(reply)))
        await self.response.write(b"data: [DONE]\n\n")

    async def error(self, error: RequestError) -> None:
        """The SDK raises APIError on a data event with `error`."""
        await self._send(openai_error_body(error))

    async def _send_choice(self, delta: dict, *, finish_reason: str | None = None, logprobs: dict | None = None):
        await self._send(self._chunk([{"index": 0, "delta": delta, "logprobs": logprobs,
                                       "finish_reason": finish_reason}]))

    def _chunk(self, choices: list[dict], *, usage: dict | None = None) -> dict:
        chunk = {"id": self.completion_id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.model, "system_fingerprint": None, "choices": choices}
        if self.include_usage:  # as OpenAI: every chunk carries usage, null until the last one
            chunk["usage"] = usage
        return chunk

    async def _send(self, payload: dict) -> None:
        await self.response.write(f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode())


class ChatCompletions:
    api = "openai"

    def parse(self, body: dict, session) -> ChatRequest:
        return parse_chat_request(body)

    def build(self, reply: Reply, chat: ChatRequest, session) -> dict:
        return build_chat_completion(reply, model=session.model_name, with_logprobs=chat.top_logprobs is not None)

    def open_stream(self, response: web.StreamResponse, chat: ChatRequest, session) -> ChunkStream:
        return ChunkStream(response, model=session.model_name, include_usage=chat.include_usage,
                           with_logprobs=chat.top_logprobs is not None)


CHAT_COMPLETIONS = ChatCompletions()
