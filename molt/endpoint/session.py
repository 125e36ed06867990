"""A capture session: one rollout's conversation with the policy, recorded token-exactly.

The session keeps its current segment (token ids, action mask, behaviour log-probs, versions,
sampling temperatures, routed experts) and the messages it has recorded. Each request either continues the
segment (the recorded messages are a prefix of the new list: the recorded ids are kept as sampled
and the new messages are rendered and appended as context) or closes it and opens a new one from
the freshly rendered prompt (DESIGN section 4).

Requests of one session are served one at a time, in arrival order. Two calls an agent makes at
once (or a sub-agent sharing the session) are therefore recorded one after the other: the second
does not extend the first's reply, so it opens a new segment (ledger: history_rewrite), and every
reply the agent receives is in exactly one segment.

A request the client marks as a retry of its previous one (the SDKs' `x-stainless-retry-count`,
or a repeated `Idempotency-Key`) gets the cached reply and records nothing; any other request
samples afresh, so an agent that repeats a call to draw several candidates gets several. A failed
generation records nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from molt.agents.base import SamplingParams
from molt.endpoint.constraints import build_constraint
from molt.endpoint.errors import ContextLengthExceeded, RequestError
from molt.endpoint.images import PromptImages, image_digests
from molt.endpoint.messages import ChatRequest, Reply, Started, TokenLogprob, ToolCall, reply_message, template_message
from molt.endpoint.tool_calls import ToolCallParser, merged_parts
from molt.trace.experience import Segment
from molt.trace.images import ImageInputs, concat_image_inputs

logger = logging.getLogger("molt")


@dataclass
class DriftLedger:
    """How turns joined their segment: clean continuations vs new segments, by reason."""

    counts: Counter = field(default_factory=Counter)

    def metrics(self) -> dict[str, float]:
        return {f"drift/{key}": float(value) for key, value in self.counts.items()}


class Session:
    def __init__(self, *, session_id: str, api_key: str, model_name: str, engine, tokenizer,
                 sampling: SamplingParams, max_length: int, base_url: str, turn_end: str = "",
                 seed_salt: int = 0, tool_parser=None, images: PromptImages | None = None):
        self.session_id = session_id
        self.api_key = api_key
        self.model_name = model_name
        self.engine = engine
        self.tokenizer = tokenizer
        self.default_sampling = sampling
        self.max_length = max_length
        self.session_url = base_url  # session root, for the Anthropic SDK
        self.base_url = base_url + "/v1"  # for the OpenAI SDK
        self.turn_end = turn_end  # what the template writes after an assistant turn (template_check.turn_end_text)
        self.seed_salt = seed_salt  # mixed into request seeds, so one seed does not make a group's samples equal
        # enabled -> a fresh tool-call parser per request (molt.endpoint.tool_calls)
        self.tool_parser = tool_parser or (lambda enabled: ToolCallParser(enabled=enabled))
        self.images = images  # image parts' reader and the model's processor; None: images refused
        self._blobs: dict[str, bytes] = {}  # the files of the images this session has seen, by digest
        self._digests: dict[str, str] = {}  # data URI -> digest of the images this session has seen
        self.closed = False
        self.context_exhausted = False  # a request no longer fit rollout.max_length
        self.segments: list[Segment] = []  # closed segments
        self.current: Segment | None = None
        self.ledger = DriftLedger()
        self.api_state: dict = {}  # per-API memory of the translators (e.g. stored responses)
        self._recorded: list[dict] = []  # normalized messages of the current segment, with the last reply
        self._recorded_tools: list[dict] | None = None
        self._last_key: tuple | None = None
        self._last_idempotency_key: str | None = None
        self._last_reply: Reply | None = None
        self._lock = asyncio.Lock()

    # -- the two entry points ---------------------------------------------------------------

    async def complete(self, chat: ChatRequest) -> Reply:
        """The whole reply at once."""
        async for item in self.stream(chat, incremental=False):
            if isinstance(item, Reply):
                return item
        raise RequestError(500, "generation ended without a reply", "api_error")

    async def stream(self, chat: ChatRequest, *,
                     incremental: bool = True) -> AsyncIterator[Started | str | ToolCall | Reply]:
        """Yield Started once the prompt is rendered, then content strings and complete ToolCalls
        as they are generated (when `incremental`; otherwise all at the end), then the Reply.
        Errors before Started (a bad or too long conversation) are the request's; later ones
        happen mid-stream."""
        async with self._lock:
            chat = self._resolve_images(chat)
            if self._is_retry(chat):
                self.ledger.counts["retry"] += 1
                yield Started(prompt_tokens=self._last_reply.prompt_tokens)
                for part in self._last_reply.parts:
                    yield part
                yield self._last_reply
                return
            async with contextlib.aclosing(self._generate(chat, incremental)) as items:
                async for item in items:
                    yield item

    def _resolve_images(self, chat: ChatRequest) -> ChatRequest:
        """The request with its image parts read and replaced by their digests (molt.endpoint.images)."""
        if not any(isinstance(message["content"], list) for message in chat.messages):
            return chat
        if self.images is None:
            raise RequestError(400, "this endpoint takes no images", param="messages")
        return dataclasses.replace(chat, messages=self.images.resolve(chat.messages, self._blobs, self._digests))

    def _is_retry(self, chat: ChatRequest) -> bool:
        if self._last_reply is None:
            return False
        same_key = chat.idempotency_key is not None and chat.idempotency_key == self._last_idempotency_key
        return same_key or (chat.retry and chat.key() == self._last_key)

    async def _generate(self, chat: ChatRequest, incremental: bool) -> AsyncIterator:
        base, reason, prompt_ids, new_images = self._prepare(chat.messages, chat.tools)
        budget = self.max_length - len(prompt_ids)
        if budget <= 0:
            self.context_exhausted = True
            raise ContextLengthExceeded(len(prompt_ids), self.max_length)
        constraint = build_constraint(chat)
        parser = self.tool_parser(chat.tool_choice.mode != "none")
        if constraint is not None and chat.tool_choice.mode in ("required", "function") \
                and not isinstance(parser, ToolCallParser):
            raise RequestError(400, f"tool_choice={chat.tool_choice.mode!r} forces a call in the <tool_call> format, "
                                    f"but this model's calls are read by another parser (rollout.tool_call_parser); "
                                    f"use tool_choice 'auto'", param="tool_choice")
        yield Started(prompt_tokens=len(prompt_ids))
        sampling = chat.sampling
        temperature = self.default_sampling.temperature if sampling.temperature is None else sampling.temperature
        params = SamplingParams(max_tokens=min(sampling.max_tokens or self.default_sampling.max_tokens, budget),
                                temperature=temperature, top_p=self.default_sampling.top_p)
        seed = None if sampling.seed is None else hash((sampling.seed, self.seed_salt)) & (2**63 - 1)
        if seed is None and self.default_sampling.seed is not None:  # an eval rollout's seed, for every request
            params.seed = self.default_sampling.seed
        sampled, logprobs, versions, top, parts = [], [], [], [], []
        routes = None  # [prompt + response tokens, layers, top_k], on the last delta (molt.trace.routes)
        finish_reason, stop_reason = None, None
        # aclosing: when this generator is closed early (the client went away), close the engine
        # stream at once, which aborts the engine request, instead of whenever it is collected.
        start = len(base.token_ids) if base else 0
        images = concat_image_inputs([base.images if base else None, new_images], [0, start])
        async with contextlib.aclosing(self.engine.stream(
                prompt_ids, params, stop=list(sampling.stop) if sampling.stop else None, seed=seed,
                incremental=incremental, top_logprobs=chat.top_logprobs, constraint=constraint,
                images=images.for_engine() if images else None)) as deltas:
            async for delta in deltas:
                sampled += delta.token_ids
                logprobs += delta.logprobs
                top += delta.top_logprobs or []
                versions = delta.policy_versions or versions  # per token, on the last delta
                routes = delta.routed_experts if delta.routed_experts is not None else routes
                finish_reason = delta.finish_reason or finish_reason
                stop_reason = delta.stop_reason if delta.stop_reason is not None else stop_reason
                new = parser.feed(delta.text)
                parts += new
                if incremental:
                    for item in new:
                        yield item
        if finish_reason not in ("stop", "length"):
            raise RequestError(503, f"generation ended with {finish_reason!r}; retry the request", "api_error")
        rest = parser.finish()
        parts += rest
        if incremental:
            for item in rest:
                yield item
        segment = base.copy() if base else Segment()
        segment.add_context(prompt_ids[len(segment.token_ids):], images=new_images)
        segment.add_action(sampled, logprobs, versions, temperature=temperature, routes=routes)
        segment.truncated = finish_reason == "length"
        reply = Reply(parts=merged_parts(parts), prompt_tokens=len(prompt_ids), completion_tokens=len(sampled),
                      finish_reason=_finish_reason(finish_reason, parts),
                      stop_sequence=stop_reason if isinstance(stop_reason, str) else None,
                      logprobs=self._token_logprobs(sampled, logprobs, top) if chat.top_logprobs is not None else None)
        if constraint is not None:
            self.ledger.counts["constrained"] += 1
        self._commit(segment, reason, chat, reply)
        yield reply

    def _token_logprobs(self, sampled: list[int], logprobs: list[float], top: list) -> list[TokenLogprob]:
        decode = self.tokenizer.decode
        return [TokenLogprob(token=decode([token]), logprob=logprob,
                             top=[(decode([alt]), alt_logprob) for alt, alt_logprob in alternatives])
                for token, logprob, alternatives in zip(sampled, logprobs, top or [[]] * len(sampled))]

    # -- segments -------------------------------------------------------------------------

    def _prepare(self, messages: list[dict], tools) -> tuple[Segment | None, str, list[int], ImageInputs | None]:
        """The segment this request extends (or None for a new one), why, the full prompt ids, and
        the images of the ids it adds to that segment (positions from the first added id)."""
        if self.current is not None:
            recorded = self._recorded
            if tools != self._recorded_tools:
                reason = "tools_changed"
            elif len(messages) > len(recorded) and messages[:len(recorded)] == recorded:
                before = self._render(recorded, tools, generation_prompt=False)
                after = self._render(messages, tools, generation_prompt=True)
                if after.startswith(before):
                    context = self._unsampled_turn_end() + after[len(before):]
                    context_ids, images = self._expand(self.tokenizer.encode(context, add_special_tokens=False),
                                                       messages[len(recorded):])
                    return self.current, "continued", self.current.token_ids + context_ids, images
                reason = "template_rewrite"
            else:
                reason = "history_rewrite"
        else:
            reason = "first_turn"
        prompt = self._render(messages, tools, generation_prompt=True)
        return None, reason, *self._expand(self.tokenizer.encode(prompt, add_special_tokens=False), messages)

    def _expand(self, token_ids: list[int], messages: list[dict]) -> tuple[list[int], ImageInputs | None]:
        """Rendered ids with the placeholders of `messages`' images expanded (as they are without images)."""
        digests = image_digests(messages)
        return self.images.expand(token_ids, digests, self._blobs) if digests else (token_ids, None)

    def _unsampled_turn_end(self) -> str:
        """The part of the template's end-of-turn text the model did not sample itself: after the
        end-of-turn token when the reply ended with it, all of it when the reply was cut."""
        last = self.current.token_ids[-1:] if self.current.token_ids else []
        sampled = self.tokenizer.decode(last) if last else ""
        if sampled and not self.current.truncated and self.current.action_mask[-1] and self.turn_end.startswith(sampled):
            return self.turn_end[len(sampled):]
        return self.turn_end

    def _commit(self, segment: Segment, reason: str, chat: ChatRequest, reply: Reply) -> None:
        self.ledger.counts[reason] += 1
        if reason != "continued" and self.current is not None:
            self.segments.append(self.current)
        self.current = segment
        self._recorded = chat.messages + [reply_message(reply)]
        self._recorded_tools = chat.tools
        self._last_key, self._last_idempotency_key, self._last_reply = chat.key(), chat.idempotency_key, reply

    def count_prompt_tokens(self, messages: list[dict], tools) -> int:
        """The tokens of the conversation rendered as a new prompt."""
        messages = self._resolve_images(ChatRequest(messages=messages)).messages
        ids = self.tokenizer.encode(self._render(messages, tools, generation_prompt=True), add_special_tokens=False)
        return len(self._expand(ids, messages)[0])

    def all_segments(self) -> list[Segment]:
        return self.segments + ([self.current] if self.current is not None else [])

    def _render(self, messages: list[dict], tools, *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [template_message(m) for m in messages], tools=tools, tokenize=False,
            add_generation_prompt=generation_prompt)


def _finish_reason(engine_reason: str, parts: list) -> str:
    """'length' when cut at max_tokens (whatever it holds), else 'tool_calls' when it has calls."""
    if engine_reason == "length":
        return "length"
    return "tool_calls" if any(not isinstance(part, str) for part in parts) else engine_reason
