"""Engine routing: which rollout rank (so which engine) runs each rollout the controller dispatches."""

from __future__ import annotations

import json


class EngineRouter:
    """Which rollout rank runs each rollout; no sockets (the controller sends). A group's rollouts
    share a prompt, so they go to one engine, which prefills it once and serves the rest from vLLM's
    prefix cache, while load allows: the group's home (the rank of its first rollout) takes the next
    one if its outstanding tokens stay within one group's worth of the least-loaded rank's,
    `outstanding[home] + tokens <= min(outstanding) + group_size * tokens`. Otherwise, and for a
    group's first rollout, the least-loaded rank takes it (ties: the first one from position
    group_id mod ranks, so groups spread over equally loaded ranks). A group's first dispatch
    therefore always lands whole on one rank; its refills go home unless other groups piled up
    there meanwhile. With fewer groups per step than ranks, a synchronous step leaves ranks idle.

    A rollout's outstanding tokens are an estimate made at dispatch (estimate_rollout_tokens),
    held until its outcome comes back, failed or not. The state is the rollouts in flight only,
    which a checkpoint does not keep (they die with the job): a resumed run starts with none. With
    algorithm.max_staleness = 0 nothing is in flight when a step dispatches, so where each rollout
    runs follows from the dispatch order and fixed seeds still reproduce a run; under streaming it
    also depends on which outcomes are back, as the versions of a batch already do."""

    def __init__(self, ranks: list[int], *, group_affinity: bool = True):
        self.ranks = list(ranks)
        self.group_affinity = group_affinity  # rollout.group_affinity; False: always the least loaded
        self.outstanding = {rank: 0 for rank in self.ranks}  # rank -> estimated tokens of its rollouts in flight
        self._placed: dict[int, tuple[int, int]] = {}  # rollout id -> (rank, tokens), until its outcome
        self._homes: dict[int, int] = {}  # group id -> the rank of its first rollout, until the group is released

    def place(self, rollout_id: int, group_id: int, group_size: int, num_tokens: int) -> int:
        """The rank that runs this rollout; its `num_tokens` count as outstanding there until `release`."""
        home = self._homes.get(group_id) if self.group_affinity else None
        slack = group_size * num_tokens
        if home is not None and self.outstanding[home] + num_tokens <= min(self.outstanding.values()) + slack:
            rank = home
        else:
            rank = self.least_loaded(group_id)
            self._homes.setdefault(group_id, rank)
        self.outstanding[rank] += num_tokens
        self._placed[rollout_id] = (rank, num_tokens)
        return rank

    def least_loaded(self, group_id: int) -> int:
        start = group_id % len(self.ranks)
        return min(self.ranks[start:] + self.ranks[:start], key=self.outstanding.__getitem__)

    def release(self, rollout_id: int) -> None:
        """The rollout's outcome is back: its tokens no longer load its rank."""
        rank, num_tokens = self._placed.pop(rollout_id)
        self.outstanding[rank] -= num_tokens

    def forget_group(self, group_id: int) -> None:
        """A step released the group: no more of its rollouts will be dispatched."""
        self._homes.pop(group_id, None)


def estimate_rollout_tokens(request: dict) -> int:
    """The tokens a rollout request will occupy an engine with, as far as the controller knows at
    dispatch (it has no tokenizer): its messages and tool schemas at about 4 characters a token,
    plus sampling.max_tokens for each turn it may take."""
    prompt_characters = len(json.dumps([request["messages"], request["tools"]], default=str))
    return prompt_characters // 4 + request["sampling"]["max_tokens"] * request["max_turns"]
