"""Trainer-side batching: experiences -> per-rank lists -> padded micro-batches (DESIGN section 2.6)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from molt.experience import Experience
from molt.objectives import compute_grpo_advantages


@dataclass(kw_only=True)
class MicroBatch:
    """Right-padded rows for one forward/backward. Always at least one row, maybe no action tokens."""

    input_ids: torch.Tensor  # [batch, seq] long
    attention_mask: torch.Tensor  # [batch, seq] long, 1 = real token
    action_mask: torch.Tensor  # [batch, seq] float, 1 = policy action
    behavior_logprobs: torch.Tensor  # [batch, seq] float, 0 off the action tokens
    advantages: torch.Tensor  # [batch, seq] float, the rollout's advantage on its action tokens

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum().item())

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            action_mask=self.action_mask.to(device),
            behavior_logprobs=self.behavior_logprobs.to(device),
            advantages=self.advantages.to(device),
        )


def compute_experience_advantages(experiences: list[Experience]) -> list[float]:
    """GRPO advantage of each experience's rollout. A rollout with several segments (several
    experiences) counts once in its group's statistics, and each of its segments gets its advantage."""
    rollouts = {e.rollout_id: (e.reward, e.group_id) for e in experiences}
    if not rollouts:
        return []
    per_rollout = compute_grpo_advantages(
        torch.tensor([reward for reward, _ in rollouts.values()], dtype=torch.float64),
        torch.tensor([group for _, group in rollouts.values()]))
    advantage_of = dict(zip(rollouts, per_rollout.tolist()))
    return [advantage_of[e.rollout_id] for e in experiences]


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
    advantages: list[float],
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
        advantages: one per experience, broadcast onto its action tokens.
    """
    if len(advantages) != len(experiences):
        raise ValueError(
            f"need one advantage per experience, got {len(advantages)} advantages for "
            f"{len(experiences)} experiences"
        )
    lengths = [experience.num_tokens for experience in experiences]
    if min(lengths, default=1) < 1:
        raise ValueError("every experience needs at least one token; got an empty token_ids")
    packs = _pack_by_budget(lengths, max_tokens_per_micro_batch)
    micro_batches = [
        _collate([experiences[i] for i in pack], [advantages[i] for i in pack], pad_token_id)
        for pack in packs
    ]
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


def _collate(experiences: list[Experience], advantages: list[float], pad_token_id: int) -> MicroBatch:
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
    )
