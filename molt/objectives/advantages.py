"""Advantage estimators over per-rollout rewards (DESIGN section 8)."""

from __future__ import annotations

import torch
from torch import Tensor


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
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards and group_ids must both be 1-D of the same length, got shapes "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if rewards.numel() == 0:
        return rewards.clone()
    _, group_index = torch.unique(group_ids, return_inverse=True)  # [num_rollouts] in 0..G-1
    num_groups = int(group_index.max()) + 1
    values = rewards.to(torch.float64)

    counts = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device)
    counts.index_add_(0, group_index, torch.ones_like(values))
    sums = torch.zeros_like(counts).index_add_(0, group_index, values)
    centered = values - (sums / counts)[group_index]
    squares = torch.zeros_like(counts).index_add_(0, group_index, centered.square())
    std = (squares / (counts - 1).clamp(min=1)).sqrt()  # [num_groups], 0 for a group of one

    group_max = torch.full_like(counts, -torch.inf).scatter_reduce(0, group_index, values, "amax")
    group_min = torch.full_like(counts, torch.inf).scatter_reduce(0, group_index, values, "amin")
    constant = (group_max == group_min)[group_index]

    advantages = centered / (std[group_index] + eps)
    return torch.where(constant, torch.zeros_like(advantages), advantages).to(rewards.dtype)
