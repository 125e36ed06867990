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
    """The experiences of one forward/backward. Always at least one row, maybe no action tokens.

    The objectives see right-padded rows, one experience each. The model sees either those rows
    (with an attention mask) or, packed, one row of the experiences back to back with no padding,
    per-sequence position ids and attention kept within each sequence (`model_inputs`); `to_rows`
    brings what the model computed per token back to the padded rows.
    """

    input_ids: torch.Tensor  # [batch, seq] long
    attention_mask: torch.Tensor  # [batch, seq] long, 1 = real token
    action_mask: torch.Tensor  # [batch, seq] float, 1 = policy action
    behavior_logprobs: torch.Tensor  # [batch, seq] float, 0 off the action tokens
    advantages: torch.Tensor  # [batch, seq] float, 0 off the action tokens
    rewards: torch.Tensor  # [batch] float64, each row's rollout reward (0 for a filler row)
    rows: list[int]  # [batch] index of each row's experience in the rank's list; -1 = filler
    # Packed micro-batches only (None when padded):
    position_ids: torch.Tensor | None = None  # [1, packed] each token's position in its own sequence
    packed_index: torch.Tensor | None = None  # [packed] each packed token's index in input_ids.view(-1)
    # Filled per step by the learner when the objective needs them ([batch, seq], 0 off actions):
    ref_logprobs: torch.Tensor | None = None  # the frozen reference policy's log-probs
    old_values: torch.Tensor | None = None  # the critic's values before this step's update
    returns: torch.Tensor | None = None  # the critic's regression targets
    proximal_logprobs: torch.Tensor | None = None  # the actor's log-probs before the step's first update

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum().item())

    @property
    def num_real_tokens(self) -> int:
        return int(self.attention_mask.sum().item())

    @property
    def num_model_tokens(self) -> int:
        """Positions the model computes: the packed length, or rows x longest row."""
        return self.packed_index.numel() if self.packed_index is not None else self.input_ids.numel()

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments of the model's forward: padded rows with their attention mask, or one
        packed row with per-sequence position ids (Hugging Face then keeps attention within each
        sequence: a block-diagonal causal mask, or variable-length flash attention on CUDA where
        flash-attn is installed: molt.actor.choose_attention)."""
        if self.packed_index is None:
            return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        return {"input_ids": self.input_ids.reshape(-1)[self.packed_index][None], "position_ids": self.position_ids}

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """[batch, seq] from per-token `values` laid out like `model_inputs()` (0 on padding)."""
        if self.packed_index is None:
            return values
        flat = values.new_zeros(self.input_ids.numel()).index_copy(0, self.packed_index, values.reshape(-1))
        return flat.view(self.input_ids.shape)

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


def split_into_windows(experiences: list[Experience], num_windows: int) -> list[list[int]]:
    """Experience indices of each optimizer window (PPO mini-batch), balanced by tokens like ranks."""
    return assign_to_ranks(experiences, num_windows)


def count_window_micro_batches(experiences: list[Experience], *, num_windows: int, max_tokens_per_micro_batch: int,
                               packing: bool) -> list[int]:
    """Micro-batches each window of `build_windows` needs for these experiences (0 for an empty one).

    The controller takes the max over ranks per window, so every rank runs as many forwards and
    backwards in each window and joins every FSDP collective."""
    return [count_micro_batches([experiences[i] for i in window], max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                                packing=packing)
            for window in split_into_windows(experiences, num_windows)]


def build_windows(experiences: list[Experience], *, num_windows: int, micro_batch_counts: list[int],
                  max_tokens_per_micro_batch: int, pad_token_id: int, packing: bool) -> list[list[MicroBatch]]:
    """This rank's experiences as `num_windows` optimizer windows of micro-batches, each padded with
    empty micro-batches to `micro_batch_counts[window]`. Rows index the rank's whole list."""
    if len(micro_batch_counts) != num_windows:
        raise ValueError(f"need a micro-batch count per window: {num_windows} windows, {len(micro_batch_counts)} counts")
    windows = []
    for window, count in zip(split_into_windows(experiences, num_windows), micro_batch_counts):
        micro_batches = build_micro_batches([experiences[i] for i in window], max_tokens_per_micro_batch=
                                            max_tokens_per_micro_batch, pad_token_id=pad_token_id,
                                            num_micro_batches=count, packing=packing)
        for micro_batch in micro_batches:
            micro_batch.rows = [window[row] if row >= 0 else -1 for row in micro_batch.rows]
        windows.append(micro_batches)
    return windows


def count_micro_batches(experiences: list[Experience], *, max_tokens_per_micro_batch: int,
                        packing: bool = False) -> int:
    """How many micro-batches `build_micro_batches` needs for these experiences (0 if none).

    Ranks all-reduce the max of this so each pads to the same count.
    """
    lengths = [experience.num_tokens for experience in experiences]
    return len(_group_by_budget(lengths, max_tokens_per_micro_batch, packing))


def build_micro_batches(
    experiences: list[Experience],
    advantages: list[float] | None = None,
    *,
    max_tokens_per_micro_batch: int,
    pad_token_id: int,
    num_micro_batches: int | None = None,
    packing: bool = False,
) -> list[MicroBatch]:
    """Group experiences into micro-batches of at most `max_tokens_per_micro_batch` tokens.

    Padded (packing False), the budget counts rows x longest row; packed, the experiences' own
    tokens (first-fit decreasing into rows of the budget). A sequence longer than the budget gets
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
    groups = _group_by_budget(lengths, max_tokens_per_micro_batch, packing)
    micro_batches = [_collate(experiences, advantages, group, pad_token_id, packing) for group in groups]
    if num_micro_batches is not None:
        if num_micro_batches < len(micro_batches):
            raise ValueError(
                f"num_micro_batches={num_micro_batches} is fewer than the {len(micro_batches)} "
                f"these experiences need; pass the max of count_micro_batches over ranks"
            )
        num_empty = num_micro_batches - len(micro_batches)
        micro_batches.extend(_empty_micro_batch(pad_token_id, packing) for _ in range(num_empty))
    return micro_batches


def _group_by_budget(lengths: list[int], max_tokens: int, packing: bool) -> list[list[int]]:
    """Indices grouped longest first within the budget: padded, rows x longest <= max_tokens (the
    next pack opens when one is full); packed, sum of lengths <= max_tokens (first fit)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    groups: list[list[int]] = []
    used: list[int] = []  # packed tokens of each group
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if packing:
            target = next((g for g, tokens in enumerate(used) if tokens + lengths[index] <= max_tokens), None)
        else:  # sorted longest first, so a group's first row sets its padded length
            fits = groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens
            target = len(groups) - 1 if fits else None
        if target is None:
            groups.append([])
            used.append(0)
            target = len(groups) - 1
        groups[target].append(index)
        used[target] += lengths[index]
    return groups


def _collate(all_experiences: list[Experience], all_advantages: list[float], rows: list[int],
             pad_token_id: int, packing: bool) -> MicroBatch:
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
    position_ids = packed_index = None
    if packing:
        lengths = [e.num_tokens for e in experiences]
        packed_index = torch.cat([row * seq_len + torch.arange(n) for row, n in enumerate(lengths)])
        position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        action_mask=action_mask,
        behavior_logprobs=behavior_logprobs * action_mask,
        advantages=row_advantages * action_mask,
        rewards=torch.tensor([e.reward for e in experiences], dtype=torch.float64),
        rows=list(rows),
        position_ids=position_ids,
        packed_index=packed_index,
    )


def _empty_micro_batch(pad_token_id: int, packing: bool) -> MicroBatch:
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
        position_ids=torch.zeros((1, 1), dtype=torch.long) if packing else None,
        packed_index=torch.zeros(1, dtype=torch.long) if packing else None,
    )
