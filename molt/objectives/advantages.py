"""Advantage estimators (DESIGN section 8).

Group estimators take one reward per rollout (a rollout with several segments counts once) and
return one advantage per rollout. Token estimators take right-padded [batch, seq] rows and return
one advantage per token, 0 off the action tokens; each row is one segment of an episode, and
observation tokens between action ranges are skipped, not episode ends. A row ends its episode at
its last action token unless the caller passes what follows it: a rollout of several segments
(experiences) chains them (`compute_segment_heads`, then `chain_segments`), so its returns and
its GAE run through all of its action tokens in segment order, as if they were one row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class _Groups(NamedTuple):
    """Each rollout's view of its group, in float64."""

    rewards: Tensor  # [num_rollouts] float64
    index: Tensor  # [num_rollouts] long, group of each rollout in 0..num_groups-1
    num_groups: int
    size: Tensor  # [num_rollouts] float64, number of rollouts in this rollout's group
    total: Tensor  # [num_rollouts] float64, sum of rewards in this rollout's group
    constant: Tensor  # [num_rollouts] bool, all rewards in this rollout's group are equal


def _sum_by_group(values: Tensor, index: Tensor, num_groups: int) -> Tensor:
    """[num_rollouts] -> [num_rollouts]: the sum of `values` over each rollout's group."""
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    return sums.index_add_(0, index, values)[index]


def _collect_groups(rewards: Tensor, group_ids: Tensor) -> _Groups:
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards and group_ids must both be 1-D of the same length, got shapes "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    unique_ids, index = torch.unique(group_ids, return_inverse=True)
    num_groups = unique_ids.numel()
    values = rewards.to(torch.float64)
    lowest = torch.full((num_groups,), torch.inf, dtype=torch.float64, device=values.device)
    lowest = lowest.scatter_reduce(0, index, values, "amin")
    highest = torch.full_like(lowest, -torch.inf).scatter_reduce(0, index, values, "amax")
    return _Groups(
        rewards=values,
        index=index,
        num_groups=num_groups,
        size=_sum_by_group(torch.ones_like(values), index, num_groups),
        total=_sum_by_group(values, index, num_groups),
        constant=(lowest == highest)[index],
    )


def _zero_where(condition: Tensor, advantages: Tensor, dtype: torch.dtype) -> Tensor:
    # Constant groups carry no learning signal; computing them through the mean would leave
    # rounding noise instead of an exact 0.
    return torch.where(condition, torch.zeros_like(advantages), advantages).to(dtype)


def compute_group_mean_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Group-mean baseline: each reward minus the mean reward of its group.

    The REINFORCE baseline (Williams 1992) estimated from the group of samples of one prompt, as
    in GRPO without the std division; identical to Dr. GRPO's advantage (Liu et al. 2025,
    arXiv:2503.20783). The rollout's own reward is in the mean, so the estimate is biased by a
    factor (n - 1) / n against RLOO. A constant group, including a group of one, gets exactly 0.

    Args:
        rewards: [num_rollouts] one reward per rollout (count each rollout once, not per segment).
        group_ids: [num_rollouts] long, any values; rollouts with the same id form a group.

    Returns:
        [num_rollouts] advantages, same dtype as `rewards`.
    """
    groups = _collect_groups(rewards, group_ids)
    advantages = groups.rewards - groups.total / groups.size
    return _zero_where(groups.constant, advantages, rewards.dtype)


def compute_dr_grpo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr. GRPO advantages: each reward minus its group's mean, with no std division.

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (arXiv:2503.20783): dividing by the group std up-weights prompts that are nearly
    always solved or always failed. Their other change, dropping the per-response length
    normalisation, belongs to the loss (DESIGN section 8 divides by the window's token count).
    Same values as `compute_group_mean_advantages`; a constant group gets exactly 0.

    Args:
        rewards: [num_rollouts] one reward per rollout (count each rollout once, not per segment).
        group_ids: [num_rollouts] long, any values; rollouts with the same id form a group.

    Returns:
        [num_rollouts] advantages, same dtype as `rewards`.
    """
    return compute_group_mean_advantages(rewards, group_ids)


def compute_rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO advantages: each reward minus the mean reward of the other rollouts of its group.

    REINFORCE Leave-One-Out: Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for
    Free!" (ICLR DeepRLStructPred workshop); Ahmadian et al. 2024, "Back to Basics: Revisiting
    REINFORCE Style Optimization for Learning from Human Feedback in LLMs" (arXiv:2402.14740).
    The baseline excludes the rollout itself, so it is unbiased; it equals
    n / (n - 1) times the group-mean advantage.

    A constant group of two or more gets exactly 0. A group of one has no other rollout to
    baseline against and keeps its reward unchanged (baseline 0).

    Args:
        rewards: [num_rollouts] one reward per rollout (count each rollout once, not per segment).
        group_ids: [num_rollouts] long, any values; rollouts with the same id form a group.

    Returns:
        [num_rollouts] advantages, same dtype as `rewards`.
    """
    groups = _collect_groups(rewards, group_ids)
    has_others = groups.size > 1
    others_mean = (groups.total - groups.rewards) / (groups.size - 1).clamp(min=1)
    baseline = torch.where(has_others, others_mean, torch.zeros_like(others_mean))
    advantages = groups.rewards - baseline
    return _zero_where(groups.constant & has_others, advantages, rewards.dtype)


def compute_grpo_advantages(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std plus `eps`.

    Group Relative Policy Optimization, Shao et al. 2024, "DeepSeekMath: Pushing the Limits of
    Mathematical Reasoning in Open Language Models" (arXiv:2402.03300), section 4.1.2.

    The std is the unbiased (Bessel-corrected, n - 1) sample std, as in the reference
    implementations most recipes are tuned against (TRL, verl, OpenRLHF all call `Tensor.std()`).
    A group whose rewards are all equal, including a group of one, gets exactly 0: it carries no
    learning signal, and computing it through the mean would leave rounding noise.

    Args:
        rewards: [num_rollouts] one reward per rollout (count each rollout once, not per segment).
        group_ids: [num_rollouts] long, any values; rollouts with the same id form a group.
        eps: added to the std so near-constant groups do not blow up.

    Returns:
        [num_rollouts] advantages, same dtype as `rewards`.
    """
    groups = _collect_groups(rewards, group_ids)
    centered = groups.rewards - groups.total / groups.size
    squares = _sum_by_group(centered.square(), groups.index, groups.num_groups)
    std = (squares / (groups.size - 1).clamp(min=1)).sqrt()  # [num_rollouts], 0 for a group of one
    return _zero_where(groups.constant, centered / (std + eps), rewards.dtype)


class Moments(NamedTuple):
    """Masked count, sum and sum of squares: they add across micro-batches and ranks."""

    count: Tensor  # [] float64
    total: Tensor  # [] float64
    total_square: Tensor  # [] float64


def masked_moments(values: Tensor, mask: Tensor) -> Moments:
    """The `Moments` of `values` where `mask` is set (float64)."""
    selected = mask > 0
    x = torch.where(selected, values.to(torch.float64), torch.zeros((), dtype=torch.float64, device=values.device))
    return Moments(count=selected.sum().to(torch.float64), total=x.sum(), total_square=x.square().sum())


def whiten(values: Tensor, mask: Tensor, *, eps: float = 1e-8, moments: Moments | None = None) -> Tensor:
    """Shift and scale `values` to mean 0 and std 1 over the tokens where `mask` is set.

    (values - mean) / (std + eps), with mean and std over the masked entries only and std the
    population std (divide by the count, not count - 1: the masked tokens are the whole batch
    being normalised, not a sample of it). Entries off the mask come back 0 whatever they held;
    if every masked entry is equal (or none is masked) all come back exactly 0.

    Args:
        values: [...] any shape.
        mask: [...] same shape; nonzero where the entry counts.
        moments: the moments of the whole population when `values` is only part of it (e.g. one
            micro-batch of a window spread over ranks: sum `masked_moments` of every part).
            Default: the moments of `values` itself.

    Returns:
        [...] whitened values, same dtype as `values`.
    """
    if values.shape != mask.shape:
        raise ValueError(f"values and mask must have the same shape, got {tuple(values.shape)} "
                         f"and {tuple(mask.shape)}")
    if values.numel() == 0:
        return values.clone()
    selected = mask > 0
    x = values.to(torch.float64)
    zeros = torch.zeros_like(x)
    count, total, total_square = moments if moments is not None else masked_moments(values, mask)
    count = count.to(x.device).clamp(min=1)
    mean = total.to(x.device) / count
    centered = torch.where(selected, x - mean, zeros)
    if moments is None:  # the whole population is here: the exact two-pass variance
        variance = centered.square().sum() / count
    else:
        variance = (total_square.to(x.device) / count - mean.square()).clamp(min=0)
    # A constant population (every masked entry equal) carries no signal: exactly 0, not rounding
    # noise. Summed moments leave a variance of ~1e-16 * mean^2 for one; real spreads are far above.
    constant = variance <= 1e-10 * mean.square()
    whitened = torch.where(constant, zeros, centered / (variance.sqrt() + eps))
    return whitened.to(values.dtype)


def _check_token_shapes(
    rewards: Tensor, action_mask: Tensor, **token_tensors: Tensor | None
) -> None:
    if action_mask.dim() != 2 or rewards.shape != action_mask.shape[:1]:
        raise ValueError(
            f"rewards must be [batch] and action_mask [batch, seq], got shapes "
            f"{tuple(rewards.shape)} and {tuple(action_mask.shape)}"
        )
    for name, tensor in token_tensors.items():
        if tensor is not None and tensor.shape != action_mask.shape:
            raise ValueError(f"{name} must be [batch, seq] like action_mask "
                             f"{tuple(action_mask.shape)}, got {tuple(tensor.shape)}")


def _check_row_shapes(rewards: Tensor, **row_tensors: Tensor | None) -> None:
    for name, tensor in row_tensors.items():
        if tensor is not None and tensor.shape != rewards.shape:
            raise ValueError(f"{name} must be [batch] like rewards {tuple(rewards.shape)}, got {tuple(tensor.shape)}")


def _float64_or_none(tensor: Tensor | None) -> Tensor | None:
    return None if tensor is None else tensor.to(torch.float64)


def _build_token_rewards(
    rewards: Tensor, action: Tensor, token_kl: Tensor | None, kl_coef: float
) -> Tensor:
    """[batch, seq] float64: -kl_coef * token_kl on action tokens, plus each row's reward on its
    last action token. A row with no action token has nowhere to put its reward and drops it."""
    zeros = torch.zeros(action.shape, dtype=torch.float64, device=action.device)
    kl = zeros if token_kl is None else token_kl.to(torch.float64)
    token_rewards = torch.where(action, -kl_coef * kl, zeros)
    is_last = action & (action.cumsum(dim=1) == action.sum(dim=1, keepdim=True))
    return token_rewards + torch.where(is_last, rewards.to(torch.float64)[:, None], zeros)


def _discounted_sum_over_actions(x: Tensor, action: Tensor, discount: float, after: Tensor | None = None) -> Tensor:
    """[batch, seq]: at each action token, sum over it and the later action tokens j of its row
    of discount^(number of action tokens from it to j) * x_j, plus discount^(number of action
    tokens from it to the row's end) * after (the sum that continues past the row: [batch], None
    for 0); 0 off the action tokens."""
    zeros = torch.zeros_like(x)
    x = torch.where(action, x, zeros)
    if discount == 1.0:
        sums = x.flip(1).cumsum(1).flip(1)
        return torch.where(action, sums if after is None else sums + after[:, None], zeros)
    sums = torch.zeros_like(x)
    # [batch] the sum from the next action token on
    running = x.new_zeros(x.shape[0]) if after is None else after.to(x.dtype)
    for t in reversed(range(x.shape[1])):
        # An observation token leaves the running sum untouched: it is not an episode end.
        running = torch.where(action[:, t], x[:, t] + discount * running, running)
        sums[:, t] = running
    return torch.where(action, sums, zeros)


def _next_action_values(current: Tensor, action: Tensor, after: Tensor | None) -> Tensor:
    """[batch, seq]: at each token, `current` at the next action token of its row, across any
    observation gap; past the row's last action token, `after` ([batch], None for 0)."""
    # Index of each token's next action token in its row; seq_len (the `after` column) past the last one.
    seq_len = action.shape[1]
    positions = torch.arange(seq_len, device=action.device).expand_as(action)
    action_positions = torch.where(action, positions, torch.full_like(positions, seq_len))
    next_position = action_positions.flip(1).cummin(dim=1).values.flip(1)  # this or later
    past_end = torch.full_like(next_position[:, :1], seq_len)
    next_position = torch.cat([next_position[:, 1:], past_end], dim=1)  # strictly later
    last_column = torch.zeros_like(current[:, :1]) if after is None else after[:, None].to(current.dtype)
    padded = torch.cat([current, last_column], dim=1)  # [batch, seq + 1]
    return padded.gather(1, next_position)


def compute_reinforce_pp_advantages(
    rewards: Tensor,
    action_mask: Tensor,
    *,
    gamma: float,
    token_kl: Tensor | None = None,
    kl_coef: float = 0.0,
    whiten_returns: bool = True,
    eps: float = 1e-8,
    next_returns: Tensor | None = None,
) -> Tensor:
    """REINFORCE++ advantages: whitened discounted returns of per-token rewards.

    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models"
    (arXiv:2501.03262). The per-token reward is -kl_coef * token_kl on every action
    token plus the row's reward on its last action token; the return of an action token is the
    gamma-discounted sum of the rewards of it and the later action tokens of its row, counting
    only action tokens (an observation gap costs no discount). Returns are then whitened over all
    action tokens passed in (`whiten`: population std), so pass the whole batch to match the
    paper's batch normalisation.

    Args:
        rewards: [batch] the terminal reward of each row.
        action_mask: [batch, seq] 1 where the policy sampled the token, 0 on observations and
            padding.
        gamma: discount per action token; 1 gives every token the undiscounted return.
        token_kl: [batch, seq] per-token KL estimate to the reference policy; None: no penalty.
        kl_coef: weight of the KL penalty in the reward.
        whiten_returns: whiten here over the rows passed in; False returns the raw returns, for a
            caller that whitens over a batch spread across micro-batches or ranks (`whiten` with
            the summed `masked_moments`).
        eps: added to the std in the whitening.
        next_returns: [batch] the return at the first action token after each row's last one (its
            rollout's next segment: `chain_segments`), discounted by gamma into the row; None: every
            row ends its episode (0).

    Returns:
        [batch, seq] advantages, 0 off the action tokens, same dtype as `rewards`.
    """
    _check_token_shapes(rewards, action_mask, token_kl=token_kl)
    _check_row_shapes(rewards, next_returns=next_returns)
    action = action_mask > 0
    token_rewards = _build_token_rewards(rewards, action, token_kl, kl_coef)
    returns = _discounted_sum_over_actions(token_rewards, action, gamma, _float64_or_none(next_returns))
    if not whiten_returns:
        return returns.to(rewards.dtype)
    return whiten(returns, action, eps=eps).to(rewards.dtype)


def compute_gae_advantages(
    rewards: Tensor,
    values: Tensor,
    action_mask: Tensor,
    *,
    gamma: float,
    lam: float,
    token_kl: Tensor | None = None,
    kl_coef: float = 0.0,
    whiten_advantages: bool = True,
    eps: float = 1e-8,
    next_values: Tensor | None = None,
    next_advantages: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation over the action tokens of each row, and the value targets.

    Schulman et al. 2015, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation" (arXiv:1506.02438), eq. 16. Per action token k (in order along its row):
    delta_k = r_k + gamma * V_{k+1} - V_k and A_k = delta_k + gamma * lam * A_{k+1}, where r_k is
    the per-token reward of `compute_reinforce_pp_advantages` (KL penalty, plus the row's reward
    on its last action token), V_{k+1} is the value at the row's next action token, across any
    observation gap, and 0 after the last action token (episode end) unless the row continues
    (`next_values`, `next_advantages`: a rollout's next segment). With lam = 1 this is the
    discounted return minus the value.

    returns = advantages + values on the action tokens, from the advantages before whitening:
    they are the critic's regression targets. `whiten_advantages` (default on, as in the common
    PPO implementations) then whitens the advantages over all action tokens passed in.

    Args:
        rewards: [batch] the terminal reward of each row.
        values: [batch, seq] critic value of each token's state (only action tokens are read).
        action_mask: [batch, seq] 1 where the policy sampled the token, 0 on observations and
            padding.
        gamma: discount per action token.
        lam: GAE lambda; 1 gives Monte-Carlo returns minus values, 0 gives one-step TD errors.
        token_kl: [batch, seq] per-token KL estimate to the reference policy; None: no penalty.
        kl_coef: weight of the KL penalty in the reward.
        whiten_advantages: whiten the advantages over the masked tokens (`whiten`).
        eps: added to the std in the whitening.
        next_values: [batch] the value at the first action token after each row's last one (its
            rollout's next segment: `chain_segments`); None: every row ends its episode (0).
        next_advantages: [batch] the advantage at that token, before whitening; None: 0.

    Returns:
        (advantages, returns), both [batch, seq], 0 off the action tokens, same dtype as `rewards`.
    """
    _check_token_shapes(rewards, action_mask, values=values, token_kl=token_kl)
    _check_row_shapes(rewards, next_values=next_values, next_advantages=next_advantages)
    action = action_mask > 0
    token_rewards = _build_token_rewards(rewards, action, token_kl, kl_coef)
    zeros = torch.zeros_like(token_rewards)
    current = torch.where(action, values.to(torch.float64), zeros)
    next_value = _next_action_values(current, action, _float64_or_none(next_values))
    deltas = token_rewards + gamma * next_value - current
    advantages = _discounted_sum_over_actions(deltas, action, gamma * lam, _float64_or_none(next_advantages))
    returns = torch.where(action, advantages + current, zeros)
    if whiten_advantages:
        advantages = whiten(advantages, action, eps=eps)
    return advantages.to(rewards.dtype), returns.to(rewards.dtype)


class SegmentHeads(NamedTuple):
    """What the earlier segments of a rollout need of each row (one segment) to chain through it."""

    head: Tensor  # [batch] float64, the row's own discounted sum at its first action token (below)
    num_actions: Tensor  # [batch] float64, the row's action-token count
    first_value: Tensor  # [batch] float64, the value at its first action token (0 without values or actions)


def compute_segment_heads(
    action_mask: Tensor,
    *,
    gamma: float,
    lam: float = 1.0,
    values: Tensor | None = None,
    token_kl: Tensor | None = None,
    kl_coef: float = 0.0,
) -> SegmentHeads:
    """Each row's head: its GAE advantage (values given) or REINFORCE++ return (values None, lam 1:
    the same sum with 0 values) at its first action token, counting only its own KL rewards and
    TD errors: no reward, and 0 value and advantage after its last action token. With what follows
    the row added, `chain_segments` gives the advantage at the row's first action token.

    Args:
        action_mask: [batch, seq] 1 where the policy sampled the token.
        gamma, lam: as in `compute_gae_advantages` (lam 1 for REINFORCE++).
        values: [batch, seq] critic values (GAE); None: 0.
        token_kl, kl_coef: the per-token KL penalty, as in `compute_reinforce_pp_advantages`.
    """
    batch = action_mask.shape[0]
    no_rewards = torch.zeros(batch, dtype=torch.float64, device=action_mask.device)
    _check_token_shapes(no_rewards, action_mask, values=values, token_kl=token_kl)
    action = action_mask > 0
    zeros = torch.zeros(action.shape, dtype=torch.float64, device=action.device)
    current = zeros if values is None else torch.where(action, values.to(torch.float64), zeros)
    deltas = (_build_token_rewards(no_rewards, action, token_kl, kl_coef)
              + gamma * _next_action_values(current, action, None) - current)
    place = (action.cumsum(dim=1) - 1).clamp(min=0)  # each action token's place in its row, 0 = first
    weights = torch.where(action, torch.full_like(zeros, gamma * lam).pow(place), zeros)
    first = action & (place == 0)
    return SegmentHeads(head=(weights * torch.where(action, deltas, zeros)).sum(dim=1),
                        num_actions=action.sum(dim=1).to(torch.float64),
                        first_value=torch.where(first, current, zeros).sum(dim=1))


class SegmentLinks(NamedTuple):
    """Per experience, what follows its last action token in its rollout: the arguments that chain
    it (`compute_reinforce_pp_advantages`, `compute_gae_advantages`)."""

    rewards: Tensor  # [experiences] float64, its rollout's reward on the rollout's last segment, else 0
    next_values: Tensor  # [experiences] float64, the value at the next segment's first action token
    next_advantages: Tensor  # [experiences] float64, the advantage (REINFORCE++: return) there


def chain_segments(
    heads: SegmentHeads,
    rewards: Tensor,
    rollout_ids: Tensor,
    segment_indices: Tensor,
    *,
    gamma: float,
    lam: float = 1.0,
) -> SegmentLinks:
    """Chain the segments (experiences) of each rollout into one episode, in segment order.

    A rollout's action tokens are taken in order across its segments, as one row: the rollout's
    reward sits on its final action token (in its last segment that has one; earlier segments get
    0), and a segment's last action token continues into the next segment's first action token
    (its value for GAE's V_next, its advantage or return for the discounted sum); the rollout's
    last segment ends the episode (0). Segments with no action token are skipped. Experiences of
    different rollouts never chain; a rollout of one segment gets its own reward and 0, exactly
    the unchained computation.

    Args:
        heads: [experiences] each experience's `compute_segment_heads` (same gamma and lam).
        rewards: [experiences] each experience's rollout reward (the last segment's counts).
        rollout_ids: [experiences] the rollout of each experience.
        segment_indices: [experiences] each experience's place in its rollout (distinct per rollout).
        gamma, lam: as in `compute_gae_advantages` (lam 1 for REINFORCE++).

    Returns:
        `SegmentLinks` per experience, float64.
    """
    num = len(rollout_ids)
    if not (len(rewards) == len(segment_indices) == len(heads.head) == num):
        raise ValueError(f"need one reward, segment index and head per experience: {num} rollout ids, "
                         f"{len(rewards)} rewards, {len(segment_indices)} segment indices, {len(heads.head)} heads")
    segments: dict[int, list[tuple[int, int]]] = {}  # rollout id -> [(segment index, experience)]
    for experience, (rollout, segment) in enumerate(zip(rollout_ids.tolist(), segment_indices.tolist())):
        segments.setdefault(rollout, []).append((segment, experience))
    head, num_actions, first_value = (part.tolist() for part in heads)
    reward_list = rewards.tolist()
    reward_of, value_after, advantage_after = [0.0] * num, [0.0] * num, [0.0] * num
    discount = gamma * lam
    for rollout, members in segments.items():
        order = sorted(members)
        if len({segment for segment, _ in order}) != len(order):
            raise ValueError(f"rollout {rollout} has two experiences with the same segment index: "
                             f"{[segment for segment, _ in order]}; each segment needs its own")
        value, advantage = 0.0, 0.0  # at the first action token of the segment after this one
        for position, experience in enumerate(reversed([e for _, e in order if num_actions[e] > 0])):
            reward = reward_list[experience] if position == 0 else 0.0
            reward_of[experience], value_after[experience], advantage_after[experience] = reward, value, advantage
            length = num_actions[experience]
            advantage = (head[experience] + discount ** (length - 1) * (reward + gamma * value)
                         + discount ** length * advantage)
            value = first_value[experience]
    links = (torch.tensor(values, dtype=torch.float64, device=rewards.device)
             for values in (reward_of, value_after, advantage_after))
    return SegmentLinks(*links)
