"""What every agent returns, what a rollout request carries, and how a user's agent file is loaded."""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from molt.trace.experience import Experience

if TYPE_CHECKING:
    import torch


@dataclass(kw_only=True)
class Result:
    """What an Env step or a ChatAgent returns (DESIGN section 3)."""

    reward: float
    terminated: bool = True
    truncated: bool = False
    observation: str = ""  # Env path: text fed back to the policy as context (not trained on)
    info: dict[str, float] = field(default_factory=dict)  # numeric metrics, averaged per step
    score: float | None = None  # for group filtering; None means the reward
    # Env path: images shown with the observation, before its text (PIL images, file bytes, data
    # URIs or paths); each becomes the model's image tokens and travels with the experience.
    images: list[Any] | None = None


@dataclass(kw_only=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # the rollout's sampling seed (eval rollouts); None: the engine derives each request's


@dataclass(kw_only=True)
class RolloutRequest:
    """One rollout of one prompt, as dispatched by the controller."""

    rollout_id: int
    group_id: int
    sample_index: int
    messages: list[dict]
    label: str
    tools: list[dict] | None
    sampling: SamplingParams
    max_length: int  # longest token sequence of one segment
    max_turns: int
    policy_version: int  # engine weight version when dispatched
    metadata: dict | None = None
    images: list[str] | None = None  # the row's `images` column: paths or data URIs (molt.trace.images.row_messages)


@dataclass(kw_only=True)
class RolloutOutcome:
    """A finished rollout: its experiences, or the reason it failed."""

    rollout_id: int
    group_id: int
    experiences: list[Experience]
    failure: str = ""  # '' on success; 'timeout' | 'agent_error' | 'bad_result' | 'no_generation' | 'prompt_too_long'
    # | 'context_exhausted' (agent.on_context_exhausted='fail') | 'sampled_image_token' (molt.rollout.rank)
    # or 'agent_worker_died' (the agent worker process running it died; set by the rank)
    error: str = ""  # the exception text of a failure, for the log
    ledger: dict[str, int] = field(default_factory=dict)  # ChatAgent path: turns by how they joined a segment
    loop_lag_max_seconds: float = 0.0  # most its agent worker's or rank's event loop lagged since their last outcome

    def __post_init__(self) -> None:
        for experience in self.experiences:
            if not math.isfinite(experience.reward):
                self.failure, self.error = "bad_result", f"non-finite reward {experience.reward}"


class BadResult(TypeError):
    """An agent returned something other than a Result."""


class ContextExhausted(RuntimeError):
    """A ChatAgent's conversation outgrew rollout.max_length under agent.on_context_exhausted='fail'."""


class Generation(Protocol):
    token_ids: list[int]
    logprobs: list[float]
    policy_version: int
    finish_reason: str
    routed_experts: torch.Tensor | None  # [prompt + response tokens, layers, top_k] (molt.trace.routes)


class Sampler(Protocol):
    """What a runner generates with: the rollout rank's engine."""

    async def generate(self, token_ids: list[int], sampling: SamplingParams) -> Generation: ...


class AgentRunnerBase:
    """Runs one rollout request to completion. Subclassed by StepEnvRunner and ChatAgentRunner."""

    async def run(self, request: RolloutRequest, sampler: Sampler, tokenizer) -> RolloutOutcome:
        raise NotImplementedError


def load_agent_runner(path: str) -> AgentRunnerBase:
    """Import the user's agent file and instantiate its `AgentRunner()` with no arguments."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"agent.path={path!r} does not exist; point it at a Python file defining AgentRunner")
    module_name = f"molt_user_agent_{file.stem}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling-free introspection need it registered
    spec.loader.exec_module(module)
    runner_class = getattr(module, "AgentRunner", None)
    if runner_class is None:
        raise AttributeError(
            f"agent.path={path!r} defines no AgentRunner; add `class AgentRunner(StepEnvRunner)` "
            f"whose __init__ calls super().__init__(YourEnv)")
    runner = runner_class()
    if not isinstance(runner, AgentRunnerBase):
        raise TypeError(f"agent.path={path!r}: AgentRunner must subclass StepEnvRunner or ChatAgentRunner, "
                        f"got {runner_class.__mro__[1:]}")
    return runner
