"""The OpenAI Responses API: `POST /v1/responses` as a `response` object or the event stream that
the OpenAI SDK (`responses.create(stream=True)`, `responses.stream()`) and the OpenAI Agents SDK's
`OpenAIResponsesModel` consume.

`instructions` and the `input` items (messages, function calls, function call outputs) become
normalized chat messages, so one conversation sent through chat completions or through this API
normalizes to the same list and continues one segment. A Reply becomes output items in the order
the model wrote them: a `message` item per run of text, a `function_call` item per call; turned
back into input, a run of assistant items is one assistant turn again. A stored response (the
default) can be continued with `previous_response_id` in its session, which remembers the
conversation each response answered and its reply.

Honoured: input, instructions, tools (function tools), tool_choice, max_output_tokens,
temperature, top_p (1 only), text.format, stream, store, previous_response_id, and `seed` and
`stop` (not in the API; send them in extra_body). Echoed, not acted on: metadata, user,
parallel_tool_calls (the model may write several calls either way), truncation ('auto' acts as
'disabled': a conversation over rollout.max_length is refused, never cut). Ignored: model,
include (but log-probs are refused), reasoning (the chat template decides whether the model
thinks; no reasoning items are returned), service_tier, prompt_cache_key, safety_identifier,
stream_options. Refused: background, conversation, prompt, reasoning and other non-message
input items, non-function tools.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from aiohttp import web

from molt.endpoint.errors import RequestError
from molt.endpoint.fields import check, json_type, optional, positive_int, sampling_temperature
from molt.endpoint.messages import (ChatRequest, Reply, Sampling, Started, ToolCall, content_text,
                                    normalize_messages, reply_message)
from molt.endpoint.openai_chat import parse_function_tools, parse_response_format, parse_stop, parse_tool_choice
from molt.endpoint.stream import handle_request

MAX_STORED_RESPONSES = 64  # per session, for previous_response_id; the oldest is forgotten first
INPUT_ROLES = ("user", "system", "developer", "assistant")


async def handle_responses(request: web.Request, session) -> web.StreamResponse:
    """POST /v1/responses."""
    return await handle_request(request, session, RESPONSES)


@dataclass(kw_only=True)
class ResponsesRequest(ChatRequest):
    """A ChatRequest plus what the response object repeats and what a follow-up response needs."""

    num_instructions: int = 0  # leading messages from `instructions`, which a follow-up does not inherit
    store: bool = True  # remember the response for previous_response_id
    echo: dict = field(default_factory=dict)  # request fields the response object repeats


# -- request: Responses -> normalized chat ------------------------------------------------------


def parse_responses_request(body: dict, session) -> ResponsesRequest:
    optional(body, "model", str)
    _refuse_unsupported(body)
    messages, num_instructions = _conversation(body, session)
    tools = parse_function_tools(optional(body, "tools", list) or [], nested=False)
    text = optional(body, "text", dict) or {}
    sampling = Sampling(max_tokens=positive_int(body, "max_output_tokens"), temperature=sampling_temperature(body),
                        stop=parse_stop(body), seed=optional(body, "seed", int))
    store = _default(optional(body, "store", bool), True)
    return ResponsesRequest(
        messages=messages, tools=tools or None,
        tool_choice=parse_tool_choice(body.get("tool_choice"), tools, nested=False), sampling=sampling,
        response_format=parse_response_format(optional(text, "format", dict, where="text."), where="text.format"),
        stream=bool(optional(body, "stream", bool)), num_instructions=num_instructions, store=store,
        echo=_echo(body, session, sampling, store))


def _conversation(body: dict, session) -> tuple[list[dict], int]:
    """The normalized messages (the instructions, the conversation of previous_response_id, the
    input items) and how many of them come from the instructions."""
    instructions = optional(body, "instructions", str)
    previous_id = optional(body, "previous_response_id", str)
    history = stored_conversation(session, previous_id) if previous_id is not None else []
    check(body.get("input") is not None or history, "'input' is required: a string or a list of input items",
          "input")
    items = convert_input(body["input"]) if body.get("input") is not None else []
    head = [{"role": "system", "content": instructions}] if instructions else []
    messages = _normalized(head, "instructions") + history + _normalized(items, "input")
    check(len(messages) > len(head), "'input' must hold at least one item", "input")
    return messages, len(head)


def _echo(body: dict, session, sampling: Sampling, store: bool) -> dict:
    """The request fields the response object repeats, with the values in force (read after they
    were checked)."""
    text = body.get("text") or {}
    return {"instructions": body.get("instructions"), "max_output_tokens": sampling.max_tokens,
            "previous_response_id": body.get("previous_response_id"), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": _default(optional(body, "parallel_tool_calls", bool), True),
            "temperature": _default(sampling.temperature, session.default_sampling.temperature),
            "top_p": session.default_sampling.top_p, "text": {**text, "format": text.get("format") or {"type": "text"}},
            "truncation": _truncation(body), "metadata": optional(body, "metadata", dict) or {},
            "user": optional(body, "user", str), "store": store,
            # No reasoning effort is applied: the chat template decides whether the model thinks.
            "reasoning": {"effort": None, "summary": None}}


def convert_input(items) -> list[dict]:
    """Responses `input` -> OpenAI-style chat messages, in order.

    A string is one user message. A run of assistant items (assistant messages and function
    calls) is one assistant turn: its texts joined, its calls in order, which undoes how a reply
    is split into output items. A function_call_output is a `tool` message.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    check(isinstance(items, list), f"'input' must be a string or a list of input items, got {json_type(items)}",
          "input")
    messages = []
    for index, item in enumerate(items):
        message = _convert_item(item, f"input[{index}]")
        if message["role"] == "assistant" and messages and messages[-1]["role"] == "assistant":
            previous = messages[-1]
            previous["content"] += message["content"]
            previous["tool_calls"] = previous.get("tool_calls", []) + message.get("tool_calls", [])
        else:
            messages.append(message)
    return messages


def _convert_item(item, where: str) -> dict:
    check(isinstance(item, dict), f"{where} must be an object, got {json_type(item)}", where)
    kind = item.get("type", "message")  # a message may leave out its type
    if kind == "message":
        role = item.get("role")
        check(role in INPUT_ROLES, f"{where}.role={role!r} is not one of {', '.join(INPUT_ROLES)}", f"{where}.role")
        content = item.get("content")  # with images, the parts go on to normalize_messages
        return {"role": role, "content": content_text(content, f"{where}.content") if role == "assistant" else content}
    if kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            check(isinstance(item.get(name), str) and (item[name] or name == "arguments"),
                  f"{where}.{name} must be a non-empty string (a function_call item has call_id, name and "
                  f"arguments)", f"{where}.{name}")
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": item["call_id"], "type": "function",
             "function": {"name": item["name"], "arguments": item["arguments"]}}]}
    if kind == "function_call_output":
        check(isinstance(item.get("call_id"), str) and item["call_id"],
              f"{where}.call_id must be a non-empty string", f"{where}.call_id")
        return {"role": "tool", "tool_call_id": item["call_id"], "content": content_text(item.get("output"),
                                                                                         f"{where}.output")}
    if kind == "reasoning":
        raise RequestError(400, f"{where} is a reasoning item, which is not supported: the chat template decides "
                                f"what the model thinks, and this endpoint never returns reasoning items; leave "
                                f"it out of 'input'", param=where)
    raise RequestError(400, f"{where}.type={kind!r} is not supported; input items are 'message', 'function_call' "
                            f"and 'function_call_output'", param=f"{where}.type")


def _refuse_unsupported(body: dict) -> None:
    check(not body.get("background"), "background=true is not supported: a rollout's responses are served "
                                      "while the agent waits; leave it unset", "background")
    for name, why in (("conversation", "conversation objects are not kept; send the history in 'input' or use "
                                       "previous_response_id"),
                      ("prompt", "prompt templates are not served; send the text in 'instructions' and 'input'")):
        check(body.get(name) is None, f"'{name}' is not supported: {why}", name)
    include = optional(body, "include", list) or []
    top_logprobs = optional(body, "top_logprobs", int)
    check("message.output_text.logprobs" not in include and not top_logprobs,
          "log-probs are not returned by /v1/responses; use /v1/chat/completions with logprobs=true",
          "include" if "message.output_text.logprobs" in include else "top_logprobs")
    optional(body, "reasoning", dict)


def _truncation(body: dict) -> str:
    truncation = optional(body, "truncation", str) or "disabled"
    check(truncation in ("auto", "disabled"), f"truncation={truncation!r} must be 'auto' or 'disabled'", "truncation")
    return truncation


def _normalized(messages: list[dict], where: str) -> list[dict]:
    return normalize_messages(messages, where) if messages else []


def _default(value, default):
    return default if value is None else value


# -- previous_response_id: the session's stored responses ---------------------------------------


def stored_conversation(session, response_id: str) -> list[dict]:
    """The normalized conversation (without its instructions) and reply of a stored response."""
    conversation = session.api_state.get("responses", {}).get(response_id)
    if conversation is None:
        raise RequestError(400, f"previous_response_id={response_id!r} is not a stored response of this session "
                                f"(a session keeps its last {MAX_STORED_RESPONSES} responses, none created with "
                                f"store=false); send the whole conversation in 'input' instead",
                           param="previous_response_id", code="previous_response_not_found")
    return conversation


def remember_response(session, response_id: str, chat: ResponsesRequest, reply: Reply) -> None:
    if not chat.store:
        return
    stored = session.api_state.setdefault("responses", {})
    stored[response_id] = chat.messages[chat.num_instructions:] + [reply_message(reply)]
    while len(stored) > MAX_STORED_RESPONSES:
        del stored[next(iter(stored))]  # dicts keep insertion order: the oldest first


# -- response: Reply -> response object ---------------------------------------------------------


def build_response(reply: Reply, chat: ResponsesRequest, *, model: str, response_id: str, created_at: int,
                   message_ids: Sequence[str] = ()) -> dict:
    """The `response` object for one reply. `message_ids` name its message items in order (a
    stream's, so its final response repeats the ids its events used); missing ones are made up."""
    incomplete = reply.finish_reason == "length"
    response = response_skeleton(chat, model=model, response_id=response_id, created_at=created_at)
    response.update(status="incomplete" if incomplete else "completed",
                    completed_at=None if incomplete else int(time.time()),
                    incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                    output=output_items(reply, message_ids), usage=build_usage(reply))
    return response


def response_skeleton(chat: ResponsesRequest, *, model: str, response_id: str, created_at: int) -> dict:
    """The response object while the reply is generated: no output, no usage yet."""
    return {"id": response_id, "object": "response", "created_at": created_at, "status": "in_progress",
            "completed_at": None, "error": None, "incomplete_details": None, "model": model, "output": [],
            "usage": None, **chat.echo}


def output_items(reply: Reply, message_ids: Sequence[str] = ()) -> list[dict]:
    """A message item per run of text, a function_call item per call, in the order written. A
    reply with neither still gets an (empty) message, so agents read an empty answer."""
    ids = iter(message_ids)
    return [message_item(next(ids, None) or new_message_id(), part) if isinstance(part, str)
            else function_call_item(part) for part in reply.parts or [""]]


def message_item(item_id: str, text: str | None, *, status: str = "completed") -> dict:
    """A message item; text None: the item as it opens, before its content part."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call: ToolCall, *, status: str = "completed") -> dict:
    return {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call", "call_id": call.id,
            "name": call.name, "arguments": call.arguments if status == "completed" else "", "status": status}


def build_usage(reply: Reply) -> dict:
    return {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


# -- streaming: server-sent events -------------------------------------------------------------


class ResponseEvents:
    """response.created and response.in_progress; per run of text a message item (added, its
    output_text part added, a delta per piece of text as it arrives, text done, part done, item
    done); per tool call a function_call item (added, its whole arguments in one delta, arguments
    done, item done); then response.completed (or response.incomplete) with the whole response.
    Every event has its `type` and a `sequence_number` counting from 0."""

    def __init__(self, response: web.StreamResponse, chat: ResponsesRequest, session):
        self.response = response
        self.chat = chat
        self.session = session
        self.response_id = new_response_id()
        self.created_at = int(time.time())
        self.sequence_number = 0
        self.num_items = 0  # output items opened so far; the open one's output_index is num_items - 1
        self.message_ids: list[str] = []
        self.open_text: str | None = None  # the open message item's text so far; None: none is open

    async def start(self, started: Started) -> None:
        snapshot = response_skeleton(self.chat, model=self.session.model_name, response_id=self.response_id,
                                     created_at=self.created_at)
        await self._event("response.created", response=snapshot)
        await self._event("response.in_progress", response=snapshot)

    async def text(self, text: str) -> None:
        if not text:
            return
        if self.open_text is None:
            await self._open_message()
        self.open_text += text
        await self._event("response.output_text.delta", **self._text_position(), delta=text, logprobs=[])

    async def tool_call(self, call: ToolCall) -> None:
        await self._close_message()
        where = {"output_index": self.num_items}
        self.num_items += 1
        item_id = function_call_item(call)["id"]
        await self._event("response.output_item.added", **where, item=function_call_item(call, status="in_progress"))
        await self._event("response.function_call_arguments.delta", **where, item_id=item_id, delta=call.arguments)
        await self._event("response.function_call_arguments.done", **where, item_id=item_id,
                          arguments=call.arguments)
        await self._event("response.output_item.done", **where, item=function_call_item(call))

    async def end(self, reply: Reply) -> None:
        if not reply.parts:
            await self._open_message()
        await self._close_message()
        final = build_response(reply, self.chat, model=self.session.model_name, response_id=self.response_id,
                               created_at=self.created_at, message_ids=self.message_ids)
        remember_response(self.session, self.response_id, self.chat, reply)
        await self._event(f"response.{final['status']}", response=final)

    async def error(self, error: RequestError) -> None:
        """The SDK's ResponseErrorEvent; the Agents SDK raises on it."""
        await self._event("error", code=error.code or error.kind, message=error.message, param=error.param)

    async def _open_message(self) -> None:
        self.message_ids.append(new_message_id())
        self.num_items += 1
        self.open_text = ""
        position = self._text_position()
        await self._event("response.output_item.added", output_index=position["output_index"],
                          item=message_item(position["item_id"], None, status="in_progress"))
        await self._event("response.content_part.added", **position, part=output_text(""))

    async def _close_message(self) -> None:
        if self.open_text is None:
            return
        text, self.open_text = self.open_text, None
        position = self._text_position()
        await self._event("response.output_text.done", **position, text=text, logprobs=[])
        await self._event("response.content_part.done", **position, part=output_text(text))
        await self._event("response.output_item.done", output_index=position["output_index"],
                          item=message_item(position["item_id"], text))

    def _text_position(self) -> dict:
        """Where the open message's text goes: its item, its output index, its one content part."""
        return {"item_id": self.message_ids[-1], "output_index": self.num_items - 1, "content_index": 0}

    async def _event(self, kind: str, **fields) -> None:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        # One write per event, so a reader never sees half an event.
        await self.response.write(f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode())


class Responses:
    api = "openai"

    def parse(self, body: dict, session) -> ResponsesRequest:
        return parse_responses_request(body, session)

    def build(self, reply: Reply, chat: ResponsesRequest, session) -> dict:
        response = build_response(reply, chat, model=session.model_name, response_id=new_response_id(),
                                  created_at=int(time.time()))
        remember_response(session, response["id"], chat, reply)
        return response

    def open_stream(self, response: web.StreamResponse, chat: ResponsesRequest, session) -> ResponseEvents:
        return ResponseEvents(response, chat, session)


RESPONSES = Responses()
