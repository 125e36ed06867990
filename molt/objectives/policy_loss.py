"""Policy-gradient losses over token tensors (DESIGN section 8).

Every loss here is a masked SUM over action tokens, each token's term divided by `denominator`:
one number for the whole optimizer window (its action-token count, for the token mean), or one per
row (`compute_loss_denominator`, algorithm.loss_aggregation). The divisors depend only on counts
over the whole window (all micro-batches, all data-parallel ranks) and on each row's own tokens, so
summing the gradients of these terms over the window gives the same gradient however the window is
split, and the statistics are masked sums that add across micro-batches and ranks.
"""

from __future__ import annotations

from typing import get_args

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from molt.choices import ImportanceLevel, ImportanceMode, LossAggregation

# exp(20) ~ 5e8: far past any clip range, still finite in bf16/fp32 when multiplied by an advantage.
MAX_ABS_LOG_RATIO = 20.0

LOSS_AGGREGATIONS = get_args(LossAggregation)


def aggregate_tokens(values: Tensor, action_mask: Tensor, *, denominator: float | Tensor) -> Tensor:
    """Sum over action tokens of each token's value divided by its denominator: a number for every
    token, or [rows, 1] one per row (rows are the last-but-one dimension of `values`)."""
    masked = torch.where(action_mask > 0, values, torch.zeros_like(values))
    return (masked / denominator).sum()


def count_sequences(action_mask: Tensor) -> int:
    """The rows of `action_mask` ([rows, seq]) holding at least one action token: the sequences that
    the sequence aggregations average over (a filler row has none)."""
    return int((action_mask > 0).any(dim=-1).sum().item())


def compute_loss_denominator(
    action_mask: Tensor,
    *,
    aggregation: LossAggregation,
    window_tokens: int,
    window_sequences: int,
    constant_tokens: int = 0,
) -> float | Tensor:
    """What each action token's loss term is divided by, so that the window's terms, summed over its
    micro-batches and ranks, make up one loss (`algorithm.loss_aggregation`):

      - "token_mean": the window's action-token count, one number: every token weighs the same, and
        long sequences weigh more than short ones.
      - "seq_mean_token_mean": [rows, 1] each row's action-token count times the window's sequence
        count: each sequence's token mean, then the mean over the sequences (GSPO's and GRPO's
        original aggregation; Shao et al. 2024, arXiv:2402.03300, eq. 3).
      - "constant": the window's sequence count times `constant_tokens`, one number: token sums over
        a constant, so a token weighs the same in a short and a long sequence without the window's
        total length entering (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training",
        arXiv:2503.20783, which divides by the generation budget).

    `window_tokens` and `window_sequences` count the whole window (all micro-batches and ranks; a
    sequence is a row with an action token, `count_sequences`): they, and each row's own tokens,
    are all the divisors depend on, so the window's loss and gradient do not depend on its split
    into micro-batches, packing or ranks. Rejected tokens and sequences still count.

    Args:
        action_mask: [rows, seq] 1 where the token is a policy action, 0 elsewhere.
        constant_tokens: "constant": tokens per sequence in the divisor (> 0).
    """
    if aggregation == "token_mean":
        return float(max(window_tokens, 1))
    if aggregation == "constant":
        if constant_tokens < 1:
            raise ValueError(f"constant aggregation needs constant_tokens >= 1, got {constant_tokens}")
        return float(max(window_sequences, 1) * constant_tokens)
    if aggregation == "seq_mean_token_mean":
        row_tokens = (action_mask > 0).sum(dim=-1, keepdim=True).clamp(min=1)  # [rows, 1]
        return row_tokens.to(action_mask.dtype) * max(window_sequences, 1)
    raise ValueError(f"loss aggregation must be one of {', '.join(LOSS_AGGREGATIONS)}, got {aggregation!r}")


def compute_ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    denominator: float | Tensor,
    dual_clip: float | None = None,
    importance_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, summed over action tokens and divided by `denominator`.

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv:1707.06347), eq. 7;
    asymmetric clip range ("clip-higher") from Yu et al. 2025, "DAPO" (arXiv:2503.14476); dual
    clip from Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
    Learning" (arXiv:1912.09729), eq. 5.

    Per token: w * -min(ratio * A, clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * A) with
    ratio = exp(logprobs - old_logprobs). With `dual_clip` = c, a token with A < 0 loses at most
    -c * A, so a huge ratio on a bad token cannot produce an unbounded step. The log-ratio is
    clamped to +-MAX_ABS_LOG_RATIO before exp so extreme gaps stay finite; past that range the
    token is clipped anyway.

    `old_logprobs` is what the ratio is taken against: the behaviour log-probs recorded at
    sampling time, or, in the decoupled design, the trainer's own log-probs of the same tokens
    before this update, with `importance_weights` from `compute_importance_weights` correcting
    for the gap to the behaviour policy. The weights multiply each token's term inside the sum
    and never change `denominator`: a rejected token (weight 0) still counts in it.

    Args:
        logprobs: [...] trainer log-probs of each token (with grad).
        old_logprobs: [...] log-probs the ratio is taken against (no grad).
        advantages: [...] advantage of each token (0 off the action tokens is fine).
        action_mask: [...] 1 where the token is a policy action, 0 elsewhere.
        denominator: what each token's term is divided by: the window's action-token count, or
            [rows, 1] one number per row (`compute_loss_denominator`).
        dual_clip: None, or c > 1: a negative-advantage token's loss is capped at -c * A.
        importance_weights: None, or [...] per-token weights (no grad), 0 for rejected tokens.

    Returns:
        The scalar loss and statistics as masked sums over action tokens (they add across
        micro-batches and ranks): "action_tokens", "clipped_tokens" (the clipped term was taken),
        "dual_clipped_tokens" (the -c*A cap was taken), "ratio_sum", "approx_kl_sum" (k3
        estimator of KL(old || current)).
    """
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be None or greater than 1, got {dual_clip}")
    mask = action_mask > 0
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(mask)
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual_clipped = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual_clipped, cap, per_token)
    if importance_weights is not None:
        per_token = per_token * importance_weights
    loss = aggregate_tokens(per_token, mask, denominator=denominator)
    stats = _ratio_stats(mask, clipped > unclipped, ratio, log_ratio, per_token.dtype)
    stats["dual_clipped_tokens"] = (dual_clipped & mask).to(per_token.dtype).sum()
    return loss, stats


def _ratio_stats(mask: Tensor, clipped: Tensor, ratio: Tensor, log_ratio: Tensor,
                 dtype: torch.dtype) -> dict[str, Tensor]:
    """The statistics of every policy loss, masked sums over action tokens in `dtype`: "action_tokens",
    "clipped_tokens" (where `clipped`), "ratio_sum" (of `ratio`) and "approx_kl_sum" (k3 of `log_ratio`)."""
    with torch.no_grad():
        log_ratio = log_ratio.detach()
        return {
            "action_tokens": mask.to(dtype).sum(),
            "clipped_tokens": (clipped & mask).to(dtype).sum(),
            "ratio_sum": torch.where(mask, ratio.to(dtype), 0.0).sum(),
            "approx_kl_sum": torch.where(mask, ((torch.exp(log_ratio) - 1) - log_ratio).to(dtype), 0.0).sum(),
        }


def compute_gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    denominator: float | Tensor,
    importance_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO's sequence-level clipped surrogate, summed over action tokens and divided by `denominator`.

    Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071), GSPO-token (eq. 13):
    each row is one sequence with ratio s = exp(mean over its action tokens of logprobs -
    old_logprobs), and each of its tokens carries s_t = sg(s) * exp(logprobs_t - sg(logprobs_t))
    (equal to s in value, gradient s * grad logprobs_t). Per token: w * -min(s_t * A, clip(s_t,
    1 - clip_eps_low, 1 + clip_eps_high) * A): a sequence outside the band gives none of its tokens
    a gradient. The paper's ranges are far narrower than PPO's (3e-4, 4e-4), and its objective
    averages each sequence's token mean over the sequences: a per-row `denominator` from
    `compute_loss_denominator(..., aggregation="seq_mean_token_mean")`. Arguments and
    statistics as `compute_ppo_clip_loss` ("ratio_sum" adds each token's sequence ratio;
    "clipped_tokens" counts the tokens of clipped sequences; "approx_kl_sum" stays per token).
    """
    mask = action_mask > 0
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
    zeros = torch.zeros_like(log_ratio)
    num_actions = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    sequence_log_ratio = torch.where(mask, log_ratio, zeros).sum(dim=-1, keepdim=True) / num_actions  # [rows, 1]
    ratio = torch.exp(sequence_log_ratio.detach() + logprobs - logprobs.detach())  # s_t
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    if importance_weights is not None:
        per_token = per_token * importance_weights
    loss = aggregate_tokens(per_token, mask, denominator=denominator)
    return loss, _ratio_stats(mask, clipped > unclipped, ratio, log_ratio, per_token.dtype)


def compute_cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    denominator: float | Tensor,
    importance_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight, summed over action tokens
    and divided by `denominator`.

    MiniMax 2025, "MiniMax-M1" (arXiv:2506.13585), eq. 4: per token w * -sg(clip(ratio,
    1 - clip_eps_low, 1 + clip_eps_high)) * A * logprobs, ratio = exp(logprobs - old_logprobs).
    Unlike PPO's clip, which drops the gradient of a token outside the band, every token keeps
    its gradient (A * grad logprobs), only scaled by the clipped weight; the paper clips from
    above only (set clip_eps_low near 1 to match). The loss value is that REINFORCE term, not a
    surrogate of the return. Arguments and statistics as `compute_ppo_clip_loss`
    ("clipped_tokens": ratio outside the band).
    """
    mask = action_mask > 0
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
    ratio = torch.exp(log_ratio.detach())
    weight = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = -weight * advantages * logprobs
    if importance_weights is not None:
        per_token = per_token * importance_weights
    loss = aggregate_tokens(per_token, mask, denominator=denominator)
    return loss, _ratio_stats(mask, weight != ratio, ratio, log_ratio, per_token.dtype)


def compute_importance_weights(
    old_logprobs: Tensor,
    behavior_logprobs: Tensor,
    action_mask: Tensor,
    *,
    level: ImportanceLevel,
    mode: ImportanceMode,
    low: float,
    high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights correcting for the gap between the trainer's and the sampler's policy.

    The inference engine samples from a slightly different distribution than the trainer computes
    (other kernels, precision, batch shapes), so the tokens are off-policy for the trainer. Each
    token's loss term is weighted by w, built from r = exp(old_logprobs - behavior_logprobs), the
    ratio between the trainer's pre-update policy and the behaviour policy, without grad.

    Level sets which ratio decides: "token" uses each token's r; "seq" the row's product of r over
    its action tokens (sum of log-ratios); "geo" the row's geometric mean (mean of log-ratios).
    Mode sets what is done with it:
      - "trunc": w = min(r, high) (truncated importance sampling, TIS; `low` is unused).
        Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
        https://fengyao.notion.site/off-policy-rl
      - "clip": w = clamp(r, low, high).
      - "mask": a token (level "token") or a whole row ("seq", "geo") whose deciding ratio lies
        outside [low, high] is rejected, w = 0. Each kept token carries its OWN token ratio
        truncated at `high`, min(r, high) (the TIS weight; at level "token" a kept r is already
        <= high). token+mask is IcePop (Ling Team 2025, "Every Step Evolves: Scaling
        Reinforcement Learning for Trillion-Scale Thinking Model", arXiv:2510.18855); geo+mask
        is seq-mask-tis (Liu, Li et al. 2025, "When Speed Kills Stability",
        https://richardli.xyz/rl-collapse).
    "seq" and "geo" accept only "mask": the row ratio only decides which rows to reject, since
    weighting a row by one product of many token ratios has variance growing with its length.
    Rows are the last dimension. Log-ratios are clamped to
    +-MAX_ABS_LOG_RATIO per token, so any gap gives finite weights.

    Args:
        old_logprobs: [batch, seq] the trainer's log-probs of each token before the update.
        behavior_logprobs: [batch, seq] log-probs recorded when the token was sampled.
        action_mask: [batch, seq] 1 where the token is a policy action, 0 elsewhere.
        low, high: the acceptance band (mask) or clamp range (clip); 0 <= low < high.

    Returns:
        [batch, seq] weights (no grad; 0 off the action tokens and on rejected tokens), and
        statistics as masked sums over action tokens: "rejected_tokens", "kept_tokens",
        "capped_tokens" (kept, but the weight differs from the token's r), "weight_sum",
        "mismatch_kl_sum" (k3 estimator of KL(behaviour || trainer)).
    """
    check_importance_options(level=level, mode=mode, low=low, high=high)
    with torch.no_grad():
        mask = action_mask > 0
        gap = (old_logprobs - behavior_logprobs).clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
        log_ratio = torch.where(mask, gap, torch.zeros_like(gap))  # [batch, seq], 0 off actions
        ratio = torch.exp(log_ratio)
        if mode == "trunc":
            keep, weights = mask, ratio.clamp(max=high)
        elif mode == "clip":
            keep, weights = mask, ratio.clamp(low, high)
        else:
            # [batch, seq] at level token, [batch, 1] per row otherwise
            deciding = torch.exp(_deciding_log_ratio(log_ratio, mask, level))
            keep = mask & (deciding >= low) & (deciding <= high)
            weights = ratio.clamp(max=high)
        weights = torch.where(keep, weights, torch.zeros_like(weights))

        maskf = mask.to(weights.dtype)
        stats = {
            "rejected_tokens": (mask & ~keep).to(weights.dtype).sum(),
            "kept_tokens": keep.to(weights.dtype).sum(),
            "capped_tokens": (keep & (weights != ratio)).to(weights.dtype).sum(),
            "weight_sum": weights.sum(),
            "mismatch_kl_sum": (((ratio - 1) - log_ratio) * maskf).sum(),
        }
    return weights, stats


def _deciding_log_ratio(log_ratio: Tensor, mask: Tensor, level: ImportanceLevel) -> Tensor:
    """The log-ratio that decides keep/reject: per token, or per row as [batch, 1]."""
    if level == "token":
        return log_ratio
    row = log_ratio.sum(dim=-1, keepdim=True)
    if level == "geo":
        row = row / mask.sum(dim=-1, keepdim=True).clamp(min=1).to(row.dtype)
    return row  # only compared with the band, so exp overflowing to inf (or 0) is harmless


def check_importance_options(*, level: str, mode: str, low: float, high: float) -> None:
    """Raise ValueError for an unknown or refused level/mode or an empty band."""
    if level not in get_args(ImportanceLevel):
        raise ValueError(f"importance level must be 'token', 'seq' or 'geo', got {level!r}")
    if mode not in get_args(ImportanceMode):
        raise ValueError(f"importance mode must be 'mask', 'clip' or 'trunc', got {mode!r}")
    if level != "token" and mode != "mask":
        raise ValueError(
            f"importance level {level!r} with mode {mode!r} is not supported: sequence-level "
            f"ratios only decide rejection; use mode 'mask', or level 'token' for {mode!r}"
        )
    if not 0.0 <= low < high:
        raise ValueError(f"importance band needs 0 <= low < high, got low={low}, high={high}")


def compute_trust_region_weights(
    old_logprobs: Tensor,
    behavior_logprobs: Tensor,
    action_mask: Tensor,
    *,
    max_kl: float,
    weight_cap: float,
    importance_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence trust region: every token of a row whose trainer/behaviour divergence exceeds
    `max_kl` gets weight 0; the kept tokens' weights are capped at `weight_cap`.

    Li et al. 2025, "Trust Region Masking for Long-Horizon LLM Reinforcement Learning"
    (arXiv:2512.23075): the surrogate's error grows with the divergence anywhere in the sequence,
    which per-token clipping cannot bound, so a sequence outside the trust region is masked whole
    (the paper's threshold: 1e-3). A row's divergence is the mean over its action tokens of
    k = exp(d) - 1 - d, d = old_logprobs - behavior_logprobs: Schulman's k3 estimator of
    KL(behaviour || trainer) on the behaviour's own samples, >= 0 on every token, so, unlike the
    mean log-ratio, tokens off in opposite directions do not cancel. It is the per-token estimator
    of `compute_importance_weights`' "mismatch_kl_sum", averaged per row.

    A kept token's weight is min(importance_weights, weight_cap), or, without importance weights,
    min(exp(d), weight_cap) (truncated importance sampling). This is a stage after the importance
    correction: it only zeroes rows and caps, and never changes a loss's denominator.

    Args:
        old_logprobs: [batch, seq] the trainer's log-probs of each token before the update.
        behavior_logprobs: [batch, seq] log-probs recorded when the token was sampled.
        action_mask: [batch, seq] 1 where the token is a policy action, 0 elsewhere.
        max_kl: > 0, the largest per-token mean KL a kept row may have.
        weight_cap: > 0, the largest weight of a kept token.
        importance_weights: None, or [batch, seq] weights of `compute_importance_weights` (no grad).

    Returns:
        [batch, seq] weights (no grad; 0 off the action tokens and on rejected rows), and statistics
        that add across micro-batches and ranks, except "trust_region_kl_max" (a maximum):
        "trust_region_sequences" (rows with an action token), "trust_region_rejected_sequences",
        "trust_region_rejected_tokens", "trust_region_kl_sum" (the rows' KLs), "mismatch_kl_sum".
    """
    if not (max_kl > 0 and weight_cap > 0):
        raise ValueError(f"trust region needs max_kl > 0 and weight_cap > 0, got max_kl={max_kl}, "
                         f"weight_cap={weight_cap}")
    with torch.no_grad():
        mask = action_mask > 0
        gap = (old_logprobs - behavior_logprobs).clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
        log_ratio = torch.where(mask, gap, torch.zeros_like(gap))  # [batch, seq], 0 off actions
        ratio = torch.exp(log_ratio)
        token_kl = (ratio - 1) - log_ratio  # 0 off actions
        num_actions = mask.sum(dim=-1, keepdim=True)  # [batch, 1]
        sequence_kl = token_kl.sum(dim=-1, keepdim=True) / num_actions.clamp(min=1).to(token_kl.dtype)
        has_actions = num_actions > 0
        keep = mask & (sequence_kl <= max_kl)
        base = ratio if importance_weights is None else importance_weights
        weights = torch.where(keep, base.clamp(max=weight_cap), torch.zeros_like(base))
        rejected_rows = has_actions & (sequence_kl > max_kl)
        kl_of_rows = torch.where(has_actions, sequence_kl, torch.zeros_like(sequence_kl))
        stats = {
            "trust_region_sequences": has_actions.to(token_kl.dtype).sum(),
            "trust_region_rejected_sequences": rejected_rows.to(token_kl.dtype).sum(),
            "trust_region_rejected_tokens": (mask & ~keep).to(token_kl.dtype).sum(),
            "trust_region_kl_sum": kl_of_rows.sum(),
            "trust_region_kl_max": kl_of_rows.max() if kl_of_rows.numel() else token_kl.new_zeros(()),
            "mismatch_kl_sum": token_kl.sum(),
        }
    return weights, stats


def token_entropy_from_logits(logits: Tensor, *, chunk_rows: int = 1024) -> Tensor:
    """[...] entropy of softmax(logits) over the last (vocabulary) dimension, in float32 or wider.

    H = logsumexp(z) - sum(softmax(z) * z), computed `chunk_rows` positions at a time. With grad,
    each chunk is checkpointed: its [chunk_rows, vocab] softmax is recomputed in backward instead
    of kept, so the extra memory is one chunk's temporaries, not another [batch, seq, vocab]
    tensor per step. Logits must be finite (a -inf logit gives NaN).

    Args:
        logits: [..., vocab] logits (already divided by the sampling temperature).
    """
    flat = logits.reshape(-1, logits.shape[-1])  # [positions, vocab]
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    pieces = []
    for start in range(0, flat.shape[0], chunk_rows):
        chunk = flat[start : start + chunk_rows]
        if needs_grad:
            pieces.append(checkpoint(_entropy_of_rows, chunk, use_reentrant=False))
        else:
            pieces.append(_entropy_of_rows(chunk))
    if not pieces:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        return logits.new_zeros(logits.shape[:-1], dtype=dtype)
    return torch.cat(pieces).reshape(logits.shape[:-1])


def _entropy_of_rows(logits: Tensor) -> Tensor:
    """[rows] entropy of each row of [rows, vocab] logits."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def compute_entropy_bonus(
    entropy: Tensor,
    action_mask: Tensor,
    *,
    coef: float,
    denominator: float | Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The entropy bonus as a loss term: -coef * sum of action-token entropies / `denominator`
    (a number, or [rows, 1] one per row, as for the policy losses).

    Williams and Peng 1991, "Function Optimization Using Connectionist Reinforcement Learning
    Algorithms"; as an added loss term in Mnih et al. 2016, "Asynchronous Methods for Deep
    Reinforcement Learning" (arXiv:1602.01783). Adding it to the loss rewards a spread-out policy.

    Args:
        entropy: [...] entropy of the policy at each token (with grad), e.g. from
            `token_entropy_from_logits`.
        action_mask: [...] 1 where the token is a policy action, 0 elsewhere.

    Returns:
        The scalar term to add to the loss, and {"entropy_sum": masked sum of entropies}.
    """
    mask = action_mask > 0
    masked = torch.where(mask, entropy, torch.zeros_like(entropy))
    term = -coef * aggregate_tokens(entropy, mask, denominator=denominator)
    return term, {"entropy_sum": masked.detach().sum()}
