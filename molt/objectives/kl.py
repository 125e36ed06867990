"""KL to a reference policy: per-token estimators, in the loss or the reward (DESIGN section 8)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from molt.choices import KLEstimator
from molt.objectives.policy_loss import MAX_ABS_LOG_RATIO


def compute_kl_estimate(
    logprobs: Tensor, ref_logprobs: Tensor, *, estimator: KLEstimator, clamp: float = 0.0
) -> Tensor:
    """[...] per-token estimate of KL(current || reference) on tokens sampled from current.

    Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html. With
    d = logprobs - ref_logprobs (clamped to +-MAX_ABS_LOG_RATIO so any gap stays finite):
      - "k1" = d: unbiased, high variance, negative on some tokens;
      - "k2" = d^2 / 2: biased, low variance, >= 0;
      - "k3" = exp(-d) - 1 + d: unbiased, low variance, >= 0.
    `clamp` > 0 caps k3 at that value (0 = uncapped; k1 and k2 are never capped): k3 grows as
    exp(-d), so one token the policy has made far less likely than the reference (d = -20 gives
    ~5e8) would swamp the term; a capped token adds `clamp` and no gradient, as verl's
    "low_var_kl" does with 10.
    Gradients flow through `logprobs` (and `ref_logprobs`, which is normally a constant).
    """
    diff = (logprobs - ref_logprobs).clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        k3 = torch.exp(-diff) - 1 + diff
        return k3.clamp(max=clamp) if clamp > 0 else k3
    raise ValueError(f"KL estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def compute_kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    action_mask: Tensor,
    *,
    estimator: KLEstimator,
    coef: float,
    denominator: float | Tensor,
    clamp: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-in-loss: coef * sum of per-token KL estimates over action tokens / `denominator`.

    As in GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, eq. 4, which uses k3).
    `denominator` is the window's action-token count, as for the policy loss, so the term adds
    across micro-batches and ranks. `clamp`: the cap on k3 (`compute_kl_estimate`; 0 = none).

    Args:
        logprobs: [...] trainer log-probs of each token (with grad).
        ref_logprobs: [...] reference-policy log-probs of the same tokens (no grad).
        action_mask: [...] 1 where the token is a policy action, 0 elsewhere.

    Returns:
        The scalar loss term and {"ref_kl_sum": masked sum of the per-token estimates}.
    """
    mask = action_mask > 0
    kl = compute_kl_estimate(logprobs, ref_logprobs, estimator=estimator, clamp=clamp)
    masked = torch.where(mask, kl, torch.zeros_like(kl))
    loss = coef * masked.sum() / denominator
    return loss, {"ref_kl_sum": masked.detach().sum()}


def compute_kl_reward_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    action_mask: Tensor,
    *,
    estimator: KLEstimator,
    coef: float,
    clamp: float = 0.0,
) -> Tensor:
    """KL-in-reward: [...] per-token penalty coef * KL estimate (no grad), 0 off the action tokens.

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences" (arXiv:1909.08593),
    usually with "k1". Subtract it from the per-token rewards (REINFORCE++ token-level
    returns) or its row sum from a rollout's reward; it carries no gradient. `clamp`: the cap on
    k3 (`compute_kl_estimate`; 0 = none).

    Args:
        logprobs: [...] log-probs of each token under the policy that sampled it.
        ref_logprobs: [...] reference-policy log-probs of the same tokens.
        action_mask: [...] 1 where the token is a policy action, 0 elsewhere.
    """
    with torch.no_grad():
        kl = compute_kl_estimate(logprobs, ref_logprobs, estimator=estimator, clamp=clamp)
        return torch.where(action_mask > 0, coef * kl, torch.zeros_like(kl))


@dataclass(kw_only=True)
class AdaptiveKLController:
    """A KL coefficient steered toward a target KL; its fields are its whole state.

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences" (arXiv:1909.08593):
    e = clip(observed_kl / target_kl - 1, -0.2, 0.2), and the coefficient is
    multiplied by 1 + e * num_steps / horizon.
    """

    coef: float  # current KL coefficient, >= 0
    target_kl: float  # KL per rollout the controller aims at, > 0 (same units as observed_kl)
    horizon: float  # samples over which the coefficient moves by about e, > 0 (paper: 10000)

    def __post_init__(self) -> None:
        if self.coef < 0 or self.target_kl <= 0 or self.horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs coef >= 0, target_kl > 0 and horizon > 0, got "
                f"coef={self.coef}, target_kl={self.target_kl}, horizon={self.horizon}"
            )

    def update(self, observed_kl: float, num_steps: int) -> float:
        """Move the coefficient after `num_steps` samples of mean KL `observed_kl`; returns it."""
        error = min(max(observed_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * num_steps / self.horizon
        return self.coef
