"""The OpenAI Chat Completions API on a capture session: request checks, the `chat.completion`
object, and the server-sent `chat.completion.chunk` stream the OpenAI SDK (and its `.stream()`
helper) consumes. Errors have OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass

from aiohttp import web

from molt.endpoint.session import Reply, RequestError, Sampling, Session

logger = logging.getLogger("molt")


class ParameterError(RequestError):
    """A request field with the wrong type or value; `param` names it in the error body."""

    def __init__(self, param: str, message: str):
        super().__init__(400, message, "invalid_request_error")
        self.param = param


@dataclass(kw_only=True)
class ChatRequest:
    """The parts of a chat completions request the session acts on."""

    messages: list  # OpenAI chat messages as sent; the session validates each one
    tools: list[dict] | None
    sampling: Sampling
    stream: bool
    include_usage: bool  # streaming only: end with a usage chunk


# -- routes -------------------------------------------------------------------------------------


async def handle_chat_completions(request: web.Request, session: Session) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    try:
        chat = parse_chat_request(await read_json_object(request))
        if chat.stream:
            return await stream_chat_completion(request, session, chat)
        reply = await session.complete(chat.messages, chat.tools, chat.sampling)
    except RequestError as error:
        return error_response(error)
    except Exception:
        logger.exception("chat completion failed in session %s", session.session_id)
        return error_response(RequestError(500, "the endpoint failed to generate a reply; see the Molt log",
                                           "api_error"))
    return web.json_response(build_chat_completion(reply, model=session.model_name))


async def handle_models(request: web.Request, session: Session) -> web.Response:
    """GET /v1/models: the one model this session serves."""
    return web.json_response({"object": "list", "data": [
        {"id": session.model_name, "object": "model", "created": 0, "owned_by": "molt"}]})


def error_response(error: RequestError) -> web.Response:
    body = {"message": error.message, "type": error.kind, "param": getattr(error, "param", None), "code": None}
    return web.json_response({"error": body}, status=error.status)


# -- request ------------------------------------------------------------------------------------


async def read_json_object(request: web.Request) -> dict:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError as error:
        raise RequestError(400, f"the request body is not valid JSON ({error}); send a JSON object") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {_json_type(body)}")
    return body


def parse_chat_request(body: dict) -> ChatRequest:
    """Check the fields Molt honours; unknown fields (user, metadata, parallel_tool_calls...) are ignored."""
    if "messages" not in body:
        raise ParameterError("messages", "'messages' is required: a list of chat messages")
    if not isinstance(body["messages"], list):
        raise ParameterError("messages", f"'messages' must be a list of chat messages, "
                                         f"got {_json_type(body['messages'])}")
    _optional(body, "model", str)
    num_choices = _optional(body, "n", int)
    if num_choices not in (None, 1):
        raise ParameterError("n", f"n={num_choices} is not supported: a session samples one choice per request; "
                                  f"send n=1 or leave it out")
    max_tokens = _optional(body, "max_completion_tokens", int)
    max_tokens_param = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_tokens_param = _optional(body, "max_tokens", int), "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise ParameterError(max_tokens_param, f"{max_tokens_param}={max_tokens} must be at least 1")
    stream = bool(_optional(body, "stream", bool))
    stream_options = _optional(body, "stream_options", dict) or {}
    include_usage = bool(_optional(stream_options, "include_usage", bool, prefix="stream_options."))
    return ChatRequest(messages=body["messages"], tools=_parse_tools(body), stream=stream,
                       include_usage=include_usage,
                       sampling=Sampling(max_tokens=max_tokens, temperature=_parse_temperature(body),
                                         top_p=_parse_top_p(body), stop=_parse_stop(body),
                                         seed=_optional(body, "seed", int)))


def _parse_temperature(body: dict) -> float | None:
    temperature = _optional(body, "temperature", float)
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise ParameterError("temperature", f"temperature={temperature} must be a finite number >= 0")
    return temperature


def _parse_top_p(body: dict) -> float | None:
    top_p = _optional(body, "top_p", float)
    if top_p is not None and not 0 < top_p <= 1:
        raise ParameterError("top_p", f"top_p={top_p} must be in (0, 1]")
    return top_p


def _parse_stop(body: dict) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, list) or not all(isinstance(item, str) for item in stop):
        raise ParameterError("stop", f"'stop' must be a string or a list of strings, got {json.dumps(stop)[:200]}")
    return stop or None


def _parse_tools(body: dict) -> list[dict] | None:
    """The request's tools as the chat template takes them; tool_choice 'none' withholds them."""
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise ParameterError("tool_choice", f"tool_choice={json.dumps(tool_choice)[:200]} is not supported; "
                                            f"use 'auto' or 'none' (the model decides when to call a tool)")
    tools = _optional(body, "tools", list)
    for index, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ParameterError(f"tools[{index}]", f"tools[{index}] must be an object with type 'function'")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ParameterError(f"tools[{index}].function",
                                 f"tools[{index}].function must be an object with a non-empty string 'name'")
    if tool_choice == "none":
        return None
    return tools or None


def _optional(body: dict, name: str, kind: type, *, prefix: str = ""):
    """body[name] when it is present and not null, checked to be of JSON type `kind`."""
    value = body.get(name)
    if value is None:
        return None
    if not _is_json_type(value, kind):
        raise ParameterError(prefix + name, f"'{prefix}{name}' must be {_JSON_NAMES[kind]}, "
                                            f"got {_json_type(value)} {json.dumps(value)[:200]}")
    return float(value) if kind is float else value


def _is_json_type(value, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):  # an int in Python, not in JSON
        return False
    if kind is float:  # an integer is a fine number
        return isinstance(value, (int, float))
    return isinstance(value, kind)


_JSON_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object"}


def _json_type(value) -> str:
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


# -- response -----------------------------------------------------------------------------------


def build_chat_completion(reply: Reply, *, model: str, completion_id: str | None = None,
                          created: int | None = None) -> dict:
    """The non-streaming `chat.completion` object for one reply."""
    message = {"role": "assistant", "content": _message_content(reply), "refusal": None}
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in reply.tool_calls]
    return {"id": completion_id or new_completion_id(), "object": "chat.completion",
            "created": int(time.time()) if created is None else created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reply.finish_reason}],
            "usage": build_usage(reply)}


def build_usage(reply: Reply) -> dict:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _message_content(reply: Reply) -> str | None:
    # OpenAI sends null content for a reply that is only tool calls.
    return None if reply.tool_calls and not reply.content else reply.content


# -- streaming ----------------------------------------------------------------------------------


class ChunkStream:
    """Writes one reply as OpenAI's server-sent `chat.completion.chunk` events, each in one write."""

    def __init__(self, response: web.StreamResponse, *, model: str, include_usage: bool):
        self.response = response
        self.model = model
        self.include_usage = include_usage
        self.completion_id = new_completion_id()
        self.created = int(time.time())
        self.started = False  # the first chunk (with the role) is out
        self.streamed = ""  # content sent so far

    async def send_content(self, text: str) -> None:
        if not self.started:
            await self._send_choice({"role": "assistant", "content": text})
            self.started = True
        elif text:
            await self._send_choice({"content": text})
        self.streamed += text

    async def send_end(self, reply: Reply) -> None:
        """Content the deltas did not carry, the tool calls, finish_reason, usage, [DONE]."""
        rest = reply.content[len(self.streamed):] if reply.content.startswith(self.streamed) else ""
        if not self.started:
            # Only tool calls: null content, so the streamed message matches the non-streamed one.
            await self._send_choice({"role": "assistant", "content": rest or (None if reply.tool_calls else "")})
            self.started = True
        elif rest:
            await self.send_content(rest)
        for index, call in enumerate(reply.tool_calls):
            await self._send_choice({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                                     "function": {"name": call.name, "arguments": call.arguments}}]})
        await self._send_choice({}, finish_reason=reply.finish_reason)
        if self.include_usage:
            await self._send(self._chunk([], usage=build_usage(reply)))
        await self.response.write(b"data: [DONE]\n\n")

    async def send_error(self, error: RequestError) -> None:
        """An error after the stream began: the SDK raises APIError on a data event with `error`."""
        body = {"message": error.message, "type": error.kind, "param": getattr(error, "param", None), "code": None}
        await self._send({"error": body})

    async def _send_choice(self, delta: dict, *, finish_reason: str | None = None) -> None:
        await self._send(self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]))

    def _chunk(self, choices: list[dict], *, usage: dict | None = None) -> dict:
        chunk = {"id": self.completion_id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.model, "system_fingerprint": None, "choices": choices}
        if self.include_usage:  # as OpenAI: every chunk carries usage, null until the last one
            chunk["usage"] = usage
        return chunk

    async def _send(self, payload: dict) -> None:
        await self.response.write(f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode())


async def stream_chat_completion(request: web.Request, session: Session, chat: ChatRequest) -> web.StreamResponse:
    """Stream one reply. Errors before the first item (bad messages, context overflow) get a plain
    error response with their status; later ones become an error event. Closing the session's
    stream, also when the client went away, aborts its engine request."""
    async with aclosing(session.stream(chat.messages, chat.tools, chat.sampling)) as items:
        first = await anext(items)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        chunks = ChunkStream(response, model=session.model_name, include_usage=chat.include_usage)
        try:
            item = first
            while not isinstance(item, Reply):
                await chunks.send_content(item)
                item = await anext(items)
            await chunks.send_end(item)
        except ConnectionResetError:
            logger.debug("client of session %s went away mid-stream", session.session_id)
            return response
        except RequestError as error:
            await chunks.send_error(error)
        except Exception:
            logger.exception("streamed chat completion failed in session %s", session.session_id)
            await chunks.send_error(RequestError(500, "the endpoint failed mid-stream; see the Molt log", "api_error"))
    await response.write_eof()
    return response
