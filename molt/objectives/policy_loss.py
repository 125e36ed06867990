"""Policy-gradient losses over token tensors (DESIGN section 8)."""

from __future__ import annotations

import torch
from torch import Tensor

# exp(20) ~ 5e8: far past any clip range, still finite in bf16/fp32 when multiplied by an advantage.
MAX_ABS_LOG_RATIO = 20.0


def compute_ppo_clip_loss(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    denominator: float | Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, summed over action tokens and divided by `denominator`.

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv:1707.06347), eq. 7;
    asymmetric clip range ("clip-higher") from Yu et al. 2025, "DAPO" (arXiv:2503.14476).

    Per token: -min(ratio * A, clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * A) with
    ratio = exp(logprobs - behavior_logprobs). The log-ratio is clamped to +-MAX_ABS_LOG_RATIO
    before exp so extreme gaps stay finite; past that range the token is clipped anyway.

    `denominator` is the number of action tokens in the whole optimizer window (all micro-batches,
    all data-parallel ranks), so summing this loss's gradients over the window gives the
    token-mean gradient however the window is split.

    Args:
        logprobs: [...] trainer log-probs of each token (with grad).
        behavior_logprobs: [...] log-probs recorded when the token was sampled.
        advantages: [...] advantage of each token (0 off the action tokens is fine).
        action_mask: [...] 1 where the token is a policy action, 0 elsewhere.

    Returns:
        The scalar loss and statistics as masked sums over action tokens (they add across
        micro-batches and ranks): "action_tokens", "clipped_tokens" (the clipped term was taken),
        "ratio_sum", "approx_kl_sum" (k3 estimator of KL(behavior || current)).
    """
    mask = action_mask > 0
    log_ratio = (logprobs - behavior_logprobs).clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    zeros = torch.zeros_like(per_token)
    loss = torch.where(mask, per_token, zeros).sum() / denominator

    with torch.no_grad():
        maskf = mask.to(per_token.dtype)
        stats = {
            "action_tokens": maskf.sum(),
            "clipped_tokens": ((clipped > unclipped).to(per_token.dtype) * maskf).sum(),
            "ratio_sum": torch.where(mask, ratio, zeros).sum(),
            "approx_kl_sum": torch.where(mask, (ratio - 1) - log_ratio, zeros).sum(),
        }
    return loss, stats
