"""The neutral request and reply model every API translator speaks (chat completions, messages,
responses): normalized chat messages, tools, the tool choice, sampling overrides, and a Reply as
the ordered text and tool calls the model generated. The Session sees only these.

A normalized message is a dict the chat template renders: {"role", "content"} plus, for an
assistant turn, "tool_calls": [{"name", "arguments"}] with the arguments parsed from JSON. The
content is a string, or, when the message holds images, a list of {"type": "text", "text"} and
{"type": "image", "url"} parts in order (`url`: the image as the client sent it, a data URI or a
path; the Session reads it and puts its content digest in its place). The same conversation sent
through either SDK, or twice, normalizes to equal lists, which is how the Session tells a
continued conversation from a rewritten one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from molt.endpoint.errors import RequestError

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """Per-request sampling overrides; None keeps the rollout's configured value."""

    max_tokens: int | None = None
    temperature: float | None = None
    stop: tuple[str, ...] | None = None
    seed: int | None = None


@dataclass
class ToolCall:
    """One call the model made."""

    id: str  # 'call_<hex>', unique per call
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True, kw_only=True)
class ToolChoice:
    """What the request allows: 'auto' (the model decides), 'none' (no call is parsed; the tools
    still reach the prompt, so the rendering does not change), 'required' (at least one call),
    'function' (exactly one call, of `name`)."""

    mode: str = "auto"
    name: str | None = None


@dataclass(frozen=True, kw_only=True)
class ResponseFormat:
    """Structured output: 'json_object' (any JSON object) or 'json_schema' (`schema`)."""

    kind: str
    schema: dict | None = None


@dataclass(kw_only=True)
class ChatRequest:
    """One request, whatever API it came through."""

    messages: list[dict]  # normalized (normalize_messages)
    tools: list[dict] | None = None  # OpenAI-style function tools, as the chat template takes them
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    sampling: Sampling = field(default_factory=Sampling)
    response_format: ResponseFormat | None = None
    top_logprobs: int | None = None  # None: no log-probs asked; k >= 0: each token's and the k most likely
    stream: bool = False
    include_usage: bool = False  # chat completions streaming: end with a usage chunk
    retry: bool = False  # the client says this repeats its previous request (x-stainless-retry-count > 0)
    idempotency_key: str | None = None

    def key(self) -> tuple:
        """What makes two requests the same request, for retry detection."""
        return (json.dumps(self.messages, sort_keys=True), json.dumps(self.tools, sort_keys=True), self.tool_choice,
                self.sampling, self.response_format, self.top_logprobs)


@dataclass(kw_only=True)
class TokenLogprob:
    """One generated token's log-prob, and the most likely alternatives when asked."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass(kw_only=True)
class Reply:
    """What the model generated for one request, in order: text and tool calls interleaved."""

    parts: list[str | ToolCall]
    finish_reason: str  # 'stop' | 'length' | 'tool_calls'
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None  # the stop string that ended the reply, if one did
    logprobs: list[TokenLogprob] | None = None  # when the request asked for them

    @property
    def content(self) -> str:
        return "".join(part for part in self.parts if isinstance(part, str))

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [part for part in self.parts if isinstance(part, ToolCall)]


@dataclass(kw_only=True)
class Started:
    """The first item of a Session's stream: the prompt is rendered and generation began."""

    prompt_tokens: int


# -- normalization ------------------------------------------------------------------------------


def normalize_messages(messages, where: str = "messages") -> list[dict]:
    """Validate OpenAI-style chat messages and reduce them to what the template renders."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, f"'{where}' must be a non-empty list of message objects", param=where)
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(400, f"{where}[{index}] must be an object, got {type(message).__name__}",
                               param=f"{where}[{index}]")
        role = message.get("role")
        if role == "developer":
            role = "system"
        if role not in ROLES:
            raise RequestError(400, f"{where}[{index}].role={role!r} is not one of {', '.join(ROLES)}",
                               param=f"{where}[{index}].role")
        entry = {"role": role, "content": message_content(message.get("content"), f"{where}[{index}].content")}
        if role == "assistant":
            if not isinstance(entry["content"], str):
                raise RequestError(400, f"{where}[{index}] is an assistant turn with an image; only user, system and "
                                        f"tool turns may carry images", param=f"{where}[{index}].content")
            entry = assistant_message(entry["content"], [_tool_call(call, f"{where}[{index}]")
                                                         for call in message.get("tool_calls") or []])
        normalized.append(entry)
    return normalized


def assistant_message(content: str, tool_calls: list[dict]) -> dict:
    """A normalized assistant turn. Streamed and parsed replies may differ in surrounding
    whitespace only, so it is stripped."""
    return {"role": "assistant", "content": content.strip(), "tool_calls": tool_calls}


def reply_message(reply: Reply) -> dict:
    """The assistant turn a reply becomes in the conversation."""
    return assistant_message(reply.content, [{"name": call.name, "arguments": json_or_text(call.arguments)}
                                             for call in reply.tool_calls])


TEXT_PARTS = ("text", "input_text", "output_text")
IMAGE_PARTS = ("image_url", "input_image", "image")  # chat completions, responses, Anthropic


def content_text(content, where: str) -> str:
    """A message content (a string, null, or a list of text parts) as one string."""
    normalized = message_content(content, where)
    if not isinstance(normalized, str):
        raise RequestError(400, f"{where} has an image part; images are accepted in message contents only",
                           param=where)
    return normalized


def message_content(content, where: str) -> str | list[dict]:
    """A message content (a string, null, or a list of text and image parts) as one string, or,
    when it holds images, as a list of text and {"type": "image", "url"} parts in order (adjacent
    texts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(400, f"{where} must be a string or a list of parts, got {type(content).__name__}",
                           param=where)
    parts: list[dict] = []
    for position, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            if parts and parts[-1]["type"] == "text":
                parts[-1] = {"type": "text", "text": parts[-1]["text"] + part["text"]}
            else:
                parts.append({"type": "text", "text": part["text"]})
        elif kind in IMAGE_PARTS:
            parts.append({"type": "image", "url": image_part_url(part, f"{where}[{position}]")})
        else:
            raise RequestError(400, f"{where} has a part of type {kind!r}; text and image parts are supported",
                               param=where)
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def image_part_url(part: dict, where: str) -> str:
    """The image of an image part, as a data URI or path: chat completions' {"image_url": {"url"}},
    responses' {"image_url": "..."} and Anthropic's {"source": {"type": "base64", "media_type", "data"}}."""
    if part["type"] == "image":
        source = part.get("source")
        if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str) \
                and isinstance(source.get("media_type"), str):
            return f"data:{source['media_type']};base64,{source['data']}"
        if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
            return source["url"]
        raise RequestError(400, f"{where}.source must be {{'type': 'base64', 'media_type', 'data'}} or "
                                f"{{'type': 'url', 'url'}}", param=f"{where}.source")
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise RequestError(400, f"{where}.image_url must be a URL string or {{'url': ...}} (a data URI)",
                           param=f"{where}.image_url")
    return url


def _tool_call(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(400, f"{where}.tool_calls entries need function.name and function.arguments",
                           param=f"{where}.tool_calls")
    arguments = function.get("arguments", "{}")
    return {"name": function["name"], "arguments": json_or_text(arguments) if isinstance(arguments, str) else arguments}


def json_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        return arguments


def template_message(message: dict) -> dict:
    """Normalized message -> what the chat template expects."""
    out = {"role": message["role"], "content": message["content"]}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "function": call} for call in message["tool_calls"]]
    return out
