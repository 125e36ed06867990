"""The ChatAgent path: the user's agent drives its own loop through the OpenAI or Anthropic SDK
against a per-session endpoint, and Molt records what the policy sampled (DESIGN sections 3, 4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from molt.agents.base import (AgentRunnerBase, BadResult, ContextExhausted, Result, RolloutOutcome, RolloutRequest,
                              SamplingParams)
from molt.agents.env import PromptTooLong
from molt.trace.experience import Experience, Segment, compute_action_digest
from molt.trace.images import data_uri, row_messages


@dataclass(kw_only=True)
class ChatContext:
    """What a ChatAgent gets for one rollout."""

    base_url: str  # session root + /v1: pass to the OpenAI SDK
    session_url: str  # session root: pass to the Anthropic SDK (it appends /v1/messages)
    api_key: str  # this session's secret
    model_name: str
    # The prompt row's chat messages; its images (its `images` column first in the first user
    # turn) as OpenAI image_url parts with data URIs, ready to send through an SDK.
    messages: list[dict]
    prompt: str  # text of the last user turn
    label: str
    tools: list[dict] | None
    images: list[str] | None  # the row's images as data URIs, in order; None without any
    sampling_params: SamplingParams
    max_length: int  # longest token sequence of one segment
    session_id: str


class ChatAgent:
    """Subclass and implement `run`; a fresh instance is made for every rollout.

    Use the SDKs' async clients (AsyncOpenAI, AsyncAnthropic): many rollouts share the agent
    worker's event loop, so a blocking call would stall every rollout of the worker."""

    async def run(self, ctx: ChatContext) -> Result:
        raise NotImplementedError


@dataclass(kw_only=True)
class SessionRecord:
    """What a session recorded, handed over when it is closed."""

    segments: list[Segment]  # in order; each becomes one experience
    ledger: dict[str, int] = field(default_factory=dict)  # turns by how they joined a segment
    context_exhausted: bool = False  # a request no longer fit rollout.max_length


class SessionHost(Protocol):
    """Where a ChatAgentRunner opens its sessions: in an agent worker, the rank's endpoint over RPC
    (molt.rollout.agent_worker.RemoteSessions); in-process (tests), a SessionEndpoint."""

    async def begin_session(self, *, sampling: SamplingParams, max_length: int) -> Any:
        """A session with `session_id`, `api_key`, `base_url`, `session_url` and `model_name`."""

    async def end_session(self, session) -> SessionRecord: ...


class ChatAgentRunner(AgentRunnerBase):
    """Opens a session per rollout, runs the agent, and turns the session's segments into experiences.

    When the conversation outgrew rollout.max_length (the endpoint answered with the API's
    context-length error), `on_context_exhausted` decides: 'train_truncated' keeps what was
    captured, marked truncated, with the agent's reward, or `context_exhausted_reward` when the
    agent raised; 'fail' fails the rollout (reason 'context_exhausted'). The agent worker sets both
    from agent.on_context_exhausted and agent.context_exhausted_reward."""

    def __init__(self, agent_class: type[ChatAgent]):
        if not (isinstance(agent_class, type) and issubclass(agent_class, ChatAgent)):
            raise TypeError(f"ChatAgentRunner needs a ChatAgent subclass, got {agent_class!r}")
        self.agent_class = agent_class
        self.endpoint: SessionHost | None = None  # attached by the agent worker
        self.on_context_exhausted = "train_truncated"
        self.context_exhausted_reward = 0.0

    async def run(self, request: RolloutRequest, sampler, tokenizer) -> RolloutOutcome:
        if self.endpoint is None:
            raise RuntimeError("ChatAgentRunner has no session endpoint attached")
        messages, blobs = row_messages(request.messages, request.images)
        session = await self.endpoint.begin_session(sampling=request.sampling, max_length=request.max_length)
        try:
            ctx = ChatContext(base_url=session.base_url, session_url=session.session_url, api_key=session.api_key,
                              model_name=session.model_name, messages=messages,
                              prompt=_last_user_text(request.messages), label=request.label, tools=request.tools,
                              images=[data_uri(blob) for blob in blobs] or None, sampling_params=request.sampling,
                              max_length=request.max_length, session_id=session.session_id)
            error = None
            try:
                result = await self.agent_class().run(ctx)
            except Exception as raised:
                error = raised
        finally:
            record = await self.endpoint.end_session(session)
        if record.context_exhausted:
            if not record.segments:
                raise PromptTooLong(f"the prompt does not fit rollout.max_length={request.max_length} tokens: "
                                    f"raise it or shorten the prompt")
            if self.on_context_exhausted == "fail":
                raise ContextExhausted(f"the conversation outgrew rollout.max_length={request.max_length} tokens "
                                       f"(agent.on_context_exhausted='fail')")
            if error is not None:
                result = Result(reward=self.context_exhausted_reward)
            result.truncated = True
        elif error is not None:
            raise error
        if not isinstance(result, Result):
            raise BadResult(f"{self.agent_class.__name__}.run returned {type(result).__name__}, "
                            f"not molt.agents.Result; return Result(reward=...)")
        return RolloutOutcome(rollout_id=request.rollout_id, group_id=request.group_id,
                              experiences=build_experiences(record.segments, result, request),
                              ledger=dict(record.ledger))


def build_experiences(segments: list[Segment], result: Result, request: RolloutRequest) -> list[Experience]:
    """One experience per segment, all with the rollout's reward."""
    score = float(result.reward if result.score is None else result.score)
    info = {k: float(v) for k, v in result.info.items()}
    return [Experience(token_ids=segment.token_ids, action_mask=segment.action_mask,
                       behavior_logprobs=segment.logprobs, policy_versions=segment.versions,
                       temperatures=segment.action_temperatures_or_none(request.sampling.temperature),
                       routed_experts=segment.routes_or_none(), images=segment.images,
                       action_digest=compute_action_digest(segment.token_ids, segment.action_mask),
                       reward=float(result.reward), score=score, group_id=request.group_id,
                       rollout_id=request.rollout_id, segment_index=index,
                       truncated=segment.truncated or result.truncated, info=info)
            for index, segment in enumerate(segments)]


def _last_user_text(messages: list[dict]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return content or ""
    return ""
