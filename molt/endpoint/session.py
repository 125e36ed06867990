"""A capture session: one rollout's conversation with the policy, recorded token-exactly.

The session keeps its current segment (token ids, action mask, behaviour log-probs, versions)
and the messages it has recorded. Each request either continues the segment (the recorded
messages are a prefix of the new list: the recorded ids are reused as sampled and the new
messages are rendered and appended as context) or closes it and opens a new one from the freshly
rendered prompt (DESIGN section 4). An identical retry returns the cached reply and records
nothing; a failed generation records nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from molt.agents.base import SamplingParams
from molt.endpoint.tool_calls import ToolCall, parse_tool_calls
from molt.experience import Segment

logger = logging.getLogger("molt")

ROLES = ("system", "user", "assistant", "tool")
TOOL_CALL_MARKER = "<tool_call>"


class RequestError(Exception):
    """A request the session refuses; the route turns it into its API's error shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


@dataclass(kw_only=True)
class Sampling:
    """Per-request sampling overrides; None keeps the rollout's configured value."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] | None = None
    seed: int | None = None


@dataclass(kw_only=True)
class Reply:
    content: str  # generated text without tool-call markup
    tool_calls: list[ToolCall]
    finish_reason: str  # 'stop' | 'length' | 'tool_calls'
    prompt_tokens: int
    completion_tokens: int


@dataclass
class DriftLedger:
    """How turns joined their segment: clean continuations vs new segments, by reason."""

    counts: Counter = field(default_factory=Counter)

    def metrics(self) -> dict[str, float]:
        return {f"drift/{key}": float(value) for key, value in self.counts.items()}


class Session:
    def __init__(self, *, session_id: str, api_key: str, model_name: str, engine, tokenizer,
                 sampling: SamplingParams, max_length: int, base_url: str):
        self.session_id = session_id
        self.api_key = api_key
        self.model_name = model_name
        self.engine = engine
        self.tokenizer = tokenizer
        self.default_sampling = sampling
        self.max_length = max_length
        self.session_url = base_url  # session root, for the Anthropic SDK
        self.base_url = base_url + "/v1"  # for the OpenAI SDK
        self.closed = False
        self.segments: list[Segment] = []  # closed segments
        self.current: Segment | None = None
        self.ledger = DriftLedger()
        self._recorded: list[dict] = []  # normalized messages of the current segment, with the last reply
        self._recorded_tools: list[dict] | None = None
        self._last_key: tuple | None = None  # (messages, tools, sampling) of the last request
        self._last_reply: Reply | None = None

    # -- the two entry points ---------------------------------------------------------------

    async def complete(self, messages: list[dict], tools: list[dict] | None, sampling: Sampling) -> Reply:
        """The whole reply at once."""
        reply = None
        async for item in self.stream(messages, tools, sampling, incremental=False):
            reply = item
        return reply

    async def stream(self, messages: list[dict], tools: list[dict] | None, sampling: Sampling, *,
                     incremental: bool = True) -> AsyncIterator[str | Reply]:
        """Yield content deltas as they are generated (if `incremental`), then the final Reply."""
        normalized = normalize_messages(messages)
        tools = tools or None
        key = (normalized, tools, sampling)
        if key == self._last_key and self._last_reply is not None:
            self.ledger.counts["retry"] += 1  # an identical retry: the cached reply, nothing recorded
            yield self._last_reply
            return
        base, reason, prompt_ids = self._prepare(normalized, tools)
        budget = self.max_length - len(prompt_ids)
        if budget <= 0:
            raise RequestError(400, f"the conversation is {len(prompt_ids)} tokens; this session's context is "
                                    f"{self.max_length} tokens (rollout.max_length)", "invalid_request_error")
        params = SamplingParams(
            max_tokens=min(sampling.max_tokens or self.default_sampling.max_tokens, budget),
            temperature=self.default_sampling.temperature if sampling.temperature is None else sampling.temperature,
            top_p=self.default_sampling.top_p if sampling.top_p is None else sampling.top_p)
        sampled, logprobs, versions, text, finish_reason, shown = [], [], [], "", None, 0
        # aclosing: when this generator is closed early (the client went away), close the engine
        # stream at once, which aborts the engine request, instead of whenever it is collected.
        async with contextlib.aclosing(self.engine.stream(prompt_ids, params, stop=sampling.stop, seed=sampling.seed,
                                                          incremental=incremental)) as deltas:
            async for delta in deltas:
                sampled += delta.token_ids
                logprobs += delta.logprobs
                text += delta.text
                versions = delta.policy_versions or versions  # per token, on the last delta
                finish_reason = delta.finish_reason or finish_reason
                if not incremental:
                    continue
                visible = text.split(TOOL_CALL_MARKER, 1)[0]
                # Hold back a possible partial marker at the end, so markup never reaches the client.
                safe = len(visible) if TOOL_CALL_MARKER in text else _safe_prefix_length(visible)
                if safe > shown:
                    yield visible[shown:safe]
                    shown = safe
        if finish_reason not in ("stop", "length"):
            raise RequestError(503, f"generation ended with {finish_reason!r}; retry the request", "api_error")
        visible = text.split(TOOL_CALL_MARKER, 1)[0]
        if incremental and len(visible) > shown:
            yield visible[shown:]
        content, tool_calls = parse_tool_calls(text) if TOOL_CALL_MARKER in text else (text, [])
        segment = base.copy() if base else Segment()
        segment.add_context(prompt_ids[len(segment.token_ids):])
        segment.add_action(sampled, logprobs, versions)
        segment.truncated = finish_reason == "length"
        self._commit(segment, reason, normalized, tools, content, tool_calls)
        reply = Reply(content=content, tool_calls=tool_calls,
                      finish_reason="tool_calls" if tool_calls else finish_reason,
                      prompt_tokens=len(prompt_ids), completion_tokens=len(sampled))
        self._last_key, self._last_reply = key, reply
        yield reply

    # -- segments -------------------------------------------------------------------------

    def _prepare(self, messages: list[dict], tools) -> tuple[Segment | None, str, list[int]]:
        """The segment this request extends (or None for a new one), why, and the full prompt ids."""
        if self.current is not None:
            recorded = self._recorded
            if tools != self._recorded_tools:
                reason = "tools_changed"
            elif len(messages) > len(recorded) and messages[:len(recorded)] == recorded:
                before = self._render(recorded, tools, generation_prompt=False)
                after = self._render(messages, tools, generation_prompt=True)
                if after.startswith(before):
                    context = self._text_after_last_reply(before) + after[len(before):]
                    context_ids = self.tokenizer.encode(context, add_special_tokens=False)
                    return self.current, "continued", self.current.token_ids + context_ids
                reason = "template_rewrite"
            else:
                reason = "history_rewrite"
        else:
            reason = "first_turn"
        prompt = self._render(messages, tools, generation_prompt=True)
        return None, reason, self.tokenizer.encode(prompt, add_special_tokens=False)

    def _text_after_last_reply(self, rendered: str) -> str:
        """What the template puts after the recorded reply's last sampled token.

        A reply that ended with the end-of-turn token continues after it; a reply cut at
        max_tokens never sampled it, so the end-of-turn text is context too."""
        eos_text = self.tokenizer.eos_token or ""
        end = rendered.rfind(eos_text) if eos_text else -1
        if end < 0:
            return ""
        last_sampled = self.current.token_ids[-1] if self.current.token_ids else None
        return rendered[end + len(eos_text):] if last_sampled == self.tokenizer.eos_token_id else rendered[end:]

    def _commit(self, segment: Segment, reason: str, messages, tools, content: str, tool_calls) -> None:
        self.ledger.counts[reason] += 1
        if reason != "continued" and self.current is not None:
            self.segments.append(self.current)
        self.current = segment
        reply = {"role": "assistant", "content": content.strip(),
                 "tool_calls": [{"name": c.name, "arguments": _json_or_text(c.arguments)} for c in tool_calls]}
        self._recorded = messages + [reply]
        self._recorded_tools = tools

    def all_segments(self) -> list[Segment]:
        return self.segments + ([self.current] if self.current is not None else [])

    def _render(self, messages: list[dict], tools, *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [_template_message(m) for m in messages], tools=tools, tokenize=False,
            add_generation_prompt=generation_prompt)


# -- message normalization --------------------------------------------------------------------


def normalize_messages(messages) -> list[dict]:
    """Validate chat messages and reduce them to what the template renders, so the same
    conversation sent twice compares equal whatever SDK objects or ids it carries."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list of message objects")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(400, f"messages[{index}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role == "developer":
            role = "system"
        if role not in ROLES:
            raise RequestError(400, f"messages[{index}].role={role!r} is not one of {', '.join(ROLES)}")
        entry = {"role": role, "content": _content_text(message.get("content"), index)}
        if role == "assistant":
            # Streamed and parsed replies may differ in surrounding whitespace only.
            entry["content"] = entry["content"].strip()
            entry["tool_calls"] = [_tool_call(call, index) for call in message.get("tool_calls") or []]
        normalized.append(entry)
    return normalized


def _content_text(content, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(400, f"messages[{index}].content has a part of type {kind!r}; "
                                        f"only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(400, f"messages[{index}].content must be a string or a list of parts, "
                            f"got {type(content).__name__}")


def _tool_call(call, index: int) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(400, f"messages[{index}].tool_calls entries need function.name and function.arguments")
    arguments = function.get("arguments", "{}")
    return {"name": function["name"], "arguments": _json_or_text(arguments) if isinstance(arguments, str) else arguments}


def _json_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        return arguments


def _template_message(message: dict) -> dict:
    """Normalized message -> what the chat template expects."""
    out = {"role": message["role"], "content": message["content"]}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "function": call} for call in message["tool_calls"]]
    return out


def _safe_prefix_length(text: str) -> int:
    """Length of `text` that cannot be the start of a tool-call marker."""
    for keep in range(min(len(TOOL_CALL_MARKER) - 1, len(text)), 0, -1):
        if TOOL_CALL_MARKER.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)
