"""Trainer-side batching: experiences -> per-rank lists -> padded micro-batches (DESIGN section 2.6)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, fields

import torch

from molt.experience import Experience
from molt.objectives import (compute_dr_grpo_advantages, compute_group_mean_advantages, compute_grpo_advantages,
                             compute_rloo_advantages)

GROUP_ADVANTAGES = {"grpo": compute_grpo_advantages, "dr_grpo": compute_dr_grpo_advantages,
                    "group_mean": compute_group_mean_advantages, "rloo": compute_rloo_advantages}


@dataclass(kw_only=True)
class MicroBatch:
    """Right-padded rows for one forward/backward. Always at least one row, maybe no action tokens."""

    input_ids: torch.Tensor  # [batch, seq] long
    attention_mask: torch.Tensor  # [batch, seq] long, 1 = real token
    action_mask: torch.Tensor  # [batch, seq] float, 1 = policy action
    behavior_logprobs: torch.Tensor  # [batch, seq] float, 0 off the action tokens
    advantages: torch.Tensor  # [batch, seq] float, 0 off the action tokens
    rewards: torch.Tensor  # [batch] float64, each row's rollout reward (0 for a filler row)
    rows: list[int]  # [batch] index of each row's experience in the rank's list; -1 = filler
    # Filled per step by the learner when the objective needs them ([batch, seq], 0 off actions):
    ref_logprobs: torch.Tensor | None = None  # the frozen reference policy's log-probs
    old_values: torch.Tensor | None = None  # the critic's values before this step's update
    returns: torch.Tensor | None = None  # the critic's regression targets

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum().item())

    def to(self, device: torch.device) -> MicroBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return MicroBatch(**{name: value.to(device) if isinstance(value, torch.Tensor) else value
                             for name, value in moved.items()})


def compute_group_advantages(rollout_ids: list[int], group_ids: list[int], rewards: list[float], *,
                             estimator: str) -> list[float]:
    """One advantage per entry (an experience) from a group estimator (molt.objectives). Entries of
    one rollout (its segments) count once in the group statistics and all get its advantage."""
    if estimator not in GROUP_ADVANTAGES:
        raise ValueError(f"{estimator!r} is not a group estimator; use one of {', '.join(GROUP_ADVANTAGES)}")
    rollouts = {}
    for rollout_id, group_id, reward in zip(rollout_ids, group_ids, rewards, strict=True):
        rollouts.setdefault(rollout_id, (reward, group_id))
    if not rollouts:
        return []
    per_rollout = GROUP_ADVANTAGES[estimator](
        torch.tensor([reward for reward, _ in rollouts.values()], dtype=torch.float64),
        torch.tensor([group for _, group in rollouts.values()]))
    advantage_of = dict(zip(rollouts, per_rollout.tolist()))
    return [advantage_of[rollout_id] for rollout_id in rollout_ids]


def compute_experience_advantages(experiences: list[Experience], estimator: str = "grpo") -> list[float]:
    """`compute_group_advantages` over the experiences' own rollout ids, groups and rewards."""
    return compute_group_advantages([e.rollout_id for e in experiences], [e.group_id for e in experiences],
                                    [e.reward for e in experiences], estimator=estimator)


def assign_to_ranks(experiences: list[Experience], num_ranks: int) -> list[list[int]]:
    """Split experience indices over ranks, longest first onto the least-loaded rank.

    Greedy longest-processing-time scheduling on token count: the heaviest rank carries at most
    the lightest rank's load plus one experience's tokens. Indices within a rank are ascending.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    loads = [(0, rank) for rank in range(num_ranks)]  # (tokens, rank) min-heap
    assignment: list[list[int]] = [[] for _ in range(num_ranks)]
    by_length = sorted(range(len(experiences)), key=lambda i: (-experiences[i].num_tokens, i))
    for index in by_length:
        tokens, rank = heapq.heappop(loads)
        assignment[rank].append(index)
        heapq.heappush(loads, (tokens + experiences[index].num_tokens, rank))
    return [sorted(indices) for indices in assignment]


def count_micro_batches(experiences: list[Experience], *, max_tokens_per_micro_batch: int) -> int:
    """How many micro-batches `build_micro_batches` needs for these experiences (0 if none).

    Ranks all-reduce the max of this so each pads to the same count.
    """
    lengths = [experience.num_tokens for experience in experiences]
    return len(_pack_by_budget(lengths, max_tokens_per_micro_batch))


def build_micro_batches(
    experiences: list[Experience],
    advantages: list[float] | None = None,
    *,
    max_tokens_per_micro_batch: int,
    pad_token_id: int,
    num_micro_batches: int | None = None,
) -> list[MicroBatch]:
    """Pack experiences into right-padded micro-batches of at most `max_tokens_per_micro_batch`.

    The budget counts padded tokens (rows * longest row); a sequence longer than the budget gets
    a micro-batch of its own. With `num_micro_batches`, the list is padded with empty micro-batches
    (one real-token row with no actions) up to that count, so every rank runs the same number of
    forwards and backwards and joins every FSDP collective.

    Args:
        advantages: one per experience, broadcast onto its action tokens; None leaves them 0 (the
            learner fills them in per step).
    """
    if advantages is None:
        advantages = [0.0] * len(experiences)
    if len(advantages) != len(experiences):
        raise ValueError(
            f"need one advantage per experience, got {len(advantages)} advantages for "
            f"{len(experiences)} experiences"
        )
    lengths = [experience.num_tokens for experience in experiences]
    if min(lengths, default=1) < 1:
        raise ValueError("every experience needs at least one token; got an empty token_ids")
    packs = _pack_by_budget(lengths, max_tokens_per_micro_batch)
    micro_batches = [_collate(experiences, advantages, pack, pad_token_id) for pack in packs]
    if num_micro_batches is not None:
        if num_micro_batches < len(micro_batches):
            raise ValueError(
                f"num_micro_batches={num_micro_batches} is fewer than the {len(micro_batches)} "
                f"these experiences need; pass the max of count_micro_batches over ranks"
            )
        num_empty = num_micro_batches - len(micro_batches)
        micro_batches.extend(_empty_micro_batch(pad_token_id) for _ in range(num_empty))
    return micro_batches


def _pack_by_budget(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped longest first, each group within rows * longest <= max_tokens."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    packs: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        # Sorted longest first, so a pack's first row sets its padded length.
        if packs and (len(packs[-1]) + 1) * lengths[packs[-1][0]] <= max_tokens:
            packs[-1].append(index)
        else:
            packs.append([index])
    return packs


def _collate(all_experiences: list[Experience], all_advantages: list[float], rows: list[int],
             pad_token_id: int) -> MicroBatch:
    experiences = [all_experiences[i] for i in rows]
    advantages = [all_advantages[i] for i in rows]
    num_rows, seq_len = len(experiences), max(e.num_tokens for e in experiences)
    input_ids = torch.full((num_rows, seq_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((num_rows, seq_len), dtype=torch.long)
    action_mask = torch.zeros((num_rows, seq_len), dtype=torch.float32)
    behavior_logprobs = torch.zeros((num_rows, seq_len), dtype=torch.float32)
    for row, experience in enumerate(experiences):
        n = experience.num_tokens
        input_ids[row, :n] = torch.tensor(experience.token_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
        action_mask[row, :n] = torch.tensor(experience.action_mask, dtype=torch.float32)
        behavior_logprobs[row, :n] = torch.tensor(experience.behavior_logprobs, dtype=torch.float32)
    row_advantages = torch.tensor(advantages, dtype=torch.float32)[:, None]  # [batch, 1]
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        action_mask=action_mask,
        behavior_logprobs=behavior_logprobs * action_mask,
        advantages=row_advantages * action_mask,
        rewards=torch.tensor([e.reward for e in experiences], dtype=torch.float64),
        rows=list(rows),
    )


def _empty_micro_batch(pad_token_id: int) -> MicroBatch:
    # The filler token is marked real (attention 1) so attention never sees a fully masked row,
    # which would put NaNs into the forward; with no action tokens it adds nothing to the loss.
    return MicroBatch(
        input_ids=torch.full((1, 1), pad_token_id, dtype=torch.long),
        attention_mask=torch.ones((1, 1), dtype=torch.long),
        action_mask=torch.zeros((1, 1)),
        behavior_logprobs=torch.zeros((1, 1)),
        advantages=torch.zeros((1, 1)),
        rewards=torch.zeros(1, dtype=torch.float64),
        rows=[-1],
    )
