"""The trace: one experience per trajectory segment (DESIGN section 5)."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field


@dataclass(kw_only=True)
class Experience:
    """One trajectory segment: the token stream the policy saw and what it sampled.

    Token-axis fields all have the same length (`num_tokens`). Lists, not tensors, because the
    record travels over ZeroMQ as msgpack; the trainer turns it into tensors once.
    """

    token_ids: list[int]  # [tokens] prompt, context and sampled tokens in order
    action_mask: list[int]  # [tokens] 1 where the policy sampled the token
    behavior_logprobs: list[float]  # [tokens] engine log-prob of each sampled token, 0 elsewhere
    policy_versions: list[int]  # [tokens] weight version that sampled each action token, -1 elsewhere
    reward: float  # the rollout's reward, shared by all its segments
    score: float  # value used for group filtering; defaults to the reward
    group_id: int  # prompt group this rollout belongs to
    rollout_id: int  # unique per rollout; segments of one rollout share it
    segment_index: int = 0  # position of this segment within its rollout
    truncated: bool = False  # the last response was cut at max_response_tokens or max_length
    info: dict[str, float] = field(default_factory=dict)  # numeric metrics from the agent

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Experience:
        return cls(**data)


@dataclass
class Segment:
    """Token-axis buffers of a segment while its rollout runs (the Env runner and a chat session
    both build one); it becomes an Experience when the rollout ends."""

    token_ids: list[int] = field(default_factory=list)  # [tokens]
    action_mask: list[int] = field(default_factory=list)  # [tokens]
    logprobs: list[float] = field(default_factory=list)  # [tokens]
    versions: list[int] = field(default_factory=list)  # [tokens]
    truncated: bool = False  # its last response was cut at max_tokens

    def add_context(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.action_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)

    def add_action(self, token_ids: list[int], logprobs: list[float], version: int) -> None:
        if len(token_ids) != len(logprobs):
            raise RuntimeError(f"engine returned {len(token_ids)} tokens but {len(logprobs)} logprobs")
        self.token_ids += token_ids
        self.action_mask += [1] * len(token_ids)
        self.logprobs += logprobs
        self.versions += [version] * len(token_ids)

    def copy(self) -> Segment:
        return copy.deepcopy(self)
