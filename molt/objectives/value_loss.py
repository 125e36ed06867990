"""Critic loss over token tensors (DESIGN section 8)."""

from __future__ import annotations

import torch
from torch import Tensor


def compute_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    action_mask: Tensor,
    *,
    clip_range: float | None,
    denominator: float | Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped value loss, summed over action tokens and divided by `denominator`.

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv:1707.06347), the
    value-clipping variant of the reference implementation (OpenAI baselines ppo2), discussed in
    Engstrom et al. 2020, "Implementation Matters in Deep Policy Gradients: A Case Study on PPO and
    TRPO" (arXiv:2005.12729).

    Per token: 0.5 * max((v - R)^2, (clip(v, v_old - clip_range, v_old + clip_range) - R)^2), so
    a value that moved more than `clip_range` from `old_values` gets no gradient when moving it
    back would not help. `clip_range=None` gives the plain 0.5 * (v - R)^2.

    `denominator` is the number of action tokens in the whole optimizer window (all micro-batches,
    all data-parallel ranks), as for `compute_ppo_clip_loss`, so the window's gradient is the
    token mean however the window is split.

    Args:
        values: [...] critic values of each token (with grad).
        old_values: [...] critic values recorded when the returns were computed.
        returns: [...] value targets (e.g. from `compute_gae_advantages`).
        action_mask: [...] 1 where the token is a policy action, 0 elsewhere.

    Returns:
        The scalar loss and statistics as masked sums over action tokens (they add across
        micro-batches and ranks): "value_clipped_tokens" (the clipped term was taken),
        "value_error_sum" (sum of (v - R)^2, over the action count: the mean squared error),
        "value_sum", "return_sum" and "return_square_sum" (with the error sum they give the
        explained variance 1 - MSE / Var(R)).
    """
    mask = action_mask > 0
    unclipped = (values - returns).square()
    if clip_range is None:
        per_token = 0.5 * unclipped
        clipped = torch.zeros_like(unclipped)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (clipped_values - returns).square()
        per_token = 0.5 * torch.maximum(unclipped, clipped)
    zeros = torch.zeros_like(per_token)
    loss = torch.where(mask, per_token, zeros).sum() / denominator

    with torch.no_grad():
        maskf = mask.to(per_token.dtype)
        stats = {
            "value_clipped_tokens": ((clipped > unclipped).to(per_token.dtype) * maskf).sum(),
            "value_error_sum": torch.where(mask, unclipped, zeros).sum(),
            "value_sum": torch.where(mask, values, zeros).sum(),
            "return_sum": torch.where(mask, returns, zeros).sum(),
            "return_square_sum": torch.where(mask, returns.square(), zeros).sum(),
        }
    return loss, stats
