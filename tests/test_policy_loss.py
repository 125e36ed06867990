import math

import pytest
import torch

from molt.objectives.kl import compute_kl_estimate, compute_kl_loss
from molt.objectives.policy_loss import (
                                         LOSS_AGGREGATIONS,
                                         MAX_ABS_LOG_RATIO,
                                         aggregate_tokens,
                                         compute_cispo_loss,
                                         compute_entropy_bonus,
                                         compute_gspo_loss,
                                         compute_importance_weights,
                                         compute_loss_denominator,
                                         compute_ppo_clip_loss,
                                         compute_trust_region_weights,
                                         count_sequences,
                                         token_entropy_from_logits,
                                         )

VALID_COMBINATIONS = [
    ("token", "trunc", 0.5, 1.3),  # low is unused by trunc
    ("token", "clip", 0.8, 1.25),
    ("token", "mask", 0.8, 1.25),
    ("seq", "mask", 0.5, 2.0),
    ("geo", "mask", 0.9, 1.1),
]


def clamp_log(value: float) -> float:
    return min(max(value, -MAX_ABS_LOG_RATIO), MAX_ABS_LOG_RATIO)


def naive_importance_weights(old, behavior, mask, level, mode, low, high):
    """Row by row, token by token: the weights of `compute_importance_weights`."""
    weights = []
    for old_row, behavior_row, mask_row in zip(old, behavior, mask):
        logs = [clamp_log(o - b) for o, b in zip(old_row, behavior_row)]
        action_logs = [value for value, m in zip(logs, mask_row) if m]
        row_log = sum(action_logs)
        if level == "geo":
            row_log /= max(len(action_logs), 1)
        row_ratio = math.exp(clamp_log(row_log))
        row = []
        for value, m in zip(logs, mask_row):
            ratio = math.exp(value)
            if not m:
                row.append(0.0)
            elif mode == "trunc":
                row.append(min(ratio, high))
            elif mode == "clip":
                row.append(min(max(ratio, low), high))
            else:
                deciding = ratio if level == "token" else row_ratio
                row.append(min(ratio, high) if low <= deciding <= high else 0.0)
        weights.append(row)
    return weights


def build_rows(seed: int, num_rows: int = 8, seq: int = 12):
    """Variable-length rows: prompt (mask 0), actions (mask 1), right padding (mask 0)."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(num_rows, seq, dtype=torch.float64)
    for row in range(num_rows):
        prompt = 1 + row % 3
        end = seq - (row * 5) % 4
        mask[row, prompt:end] = 1.0
    old = -torch.rand(num_rows, seq, generator=generator, dtype=torch.float64) * 3
    noise_scale = 0.1 * torch.arange(1, num_rows + 1, dtype=torch.float64).unsqueeze(1)
    behavior = old + noise_scale * torch.randn(
        num_rows, seq, generator=generator, dtype=torch.float64
    )
    return old, behavior, mask


@pytest.mark.parametrize(("level", "mode", "low", "high"), VALID_COMBINATIONS)
def test_importance_weights_match_naive_loop(level, mode, low, high):
    old, behavior, mask = build_rows(seed=3)
    weights, stats = compute_importance_weights(
        old, behavior, mask, level=level, mode=mode, low=low, high=high
    )
    expected = torch.tensor(
        naive_importance_weights(
            old.tolist(), behavior.tolist(), mask.tolist(), level, mode, low, high
        ),
        dtype=torch.float64,
    )
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=0.0)

    action = mask > 0
    kept = action & (expected > 0)
    ratio = torch.exp(old - behavior)
    assert stats["kept_tokens"].item() == kept.sum().item()
    assert stats["rejected_tokens"].item() == (action & ~kept).sum().item()
    assert math.isclose(stats["weight_sum"].item(), expected.sum().item(), rel_tol=1e-12)
    k3 = (ratio - 1) - (old - behavior)
    assert math.isclose(stats["mismatch_kl_sum"].item(), (k3 * mask).sum().item(), rel_tol=1e-12)
    capped = kept & ((expected - ratio).abs() > 1e-12)
    assert stats["capped_tokens"].item() == capped.sum().item()
    if mode == "mask":
        assert 0 < stats["rejected_tokens"].item() < action.sum().item(), (
            "inputs should reject some, keep some"
        )
    else:
        assert stats["capped_tokens"].item() > 0, "inputs should exercise the truncation"


def test_sequence_masks_decide_per_row_and_keep_truncated_token_weights():
    # Row 0 log-ratios 0.3, -0.2, 0.5 (sum 0.6, mean 0.2); row 1: 0.05, 0.05 then a masked token.
    old = torch.tensor([[0.3, -0.2, 0.5], [0.05, 0.05, 9.0]], dtype=torch.float64)
    behavior = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)

    # seq: exp(0.6) = 1.82 is outside [0.9, 1.5] -> row 0 rejected; exp(0.1) = 1.105 kept.
    weights, stats = compute_importance_weights(
        old, behavior, mask, level="seq", mode="mask", low=0.9, high=1.5
    )
    row1 = math.exp(0.05)
    torch.testing.assert_close(
        weights, torch.tensor([[0.0, 0.0, 0.0], [row1, row1, 0.0]], dtype=torch.float64)
    )
    assert stats["rejected_tokens"].item() == 3 and stats["kept_tokens"].item() == 2

    # geo: exp(0.2) = 1.22 and exp(0.05) inside [0.9, 1.5]; each token keeps min(its ratio, 1.5),
    # except 0.5: exp(0.5) = 1.65 is truncated to 1.5.
    weights, stats = compute_importance_weights(
        old, behavior, mask, level="geo", mode="mask", low=0.9, high=1.5
    )
    expected = torch.tensor(
        [[math.exp(0.3), math.exp(-0.2), 1.5], [row1, row1, 0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(weights, expected)
    assert stats["rejected_tokens"].item() == 0 and stats["capped_tokens"].item() == 1

    # token (IcePop): exp(0.5) = 1.65 and exp(-0.2) = 0.82 fall outside [0.9, 1.5].
    weights, _ = compute_importance_weights(
        old, behavior, mask, level="token", mode="mask", low=0.9, high=1.5
    )
    expected = torch.tensor([[math.exp(0.3), 0.0, 0.0], [row1, row1, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(weights, expected)


@pytest.mark.parametrize(
    ("level", "mode", "low", "high", "message"),
    [
        ("seq", "clip", 0.5, 2.0, "'seq' with mode 'clip'"),
        ("seq", "trunc", 0.0, 2.0, "'seq' with mode 'trunc'"),
        ("geo", "clip", 0.5, 2.0, "'geo' with mode 'clip'"),
        ("geo", "trunc", 0.0, 2.0, "'geo' with mode 'trunc'"),
        ("token", "mask", 1.2, 1.2, "low < high"),
        ("token", "trunc", 2.0, 1.0, "low < high"),
        ("token", "clip", -0.1, 1.0, "0 <= low"),
        ("sentence", "mask", 0.5, 2.0, "importance level"),
        ("token", "drop", 0.5, 2.0, "importance mode"),
    ],
)
def test_importance_weights_refuse_bad_options(level, mode, low, high, message):
    old, behavior, mask = build_rows(seed=4, num_rows=2)
    with pytest.raises(ValueError, match=message):
        compute_importance_weights(old, behavior, mask, level=level, mode=mode, low=low, high=high)


def naive_ppo(logprobs, old, advantages, mask, weights, low, high, dual_clip, denominator):
    total = 0.0
    for lp, olp, adv, m, w in zip(logprobs, old, advantages, mask, weights):
        if not m:
            continue
        ratio = math.exp(clamp_log(lp - olp))
        loss = -min(ratio * adv, min(max(ratio, 1 - low), 1 + high) * adv)
        if dual_clip is not None and adv < 0:
            loss = min(loss, -dual_clip * adv)
        total += w * loss
    return total / denominator


@pytest.mark.parametrize("dual_clip", [None, 2.0])
def test_weighted_ppo_matches_naive_loop_and_keeps_the_denominator(dual_clip):
    old, behavior, mask = build_rows(seed=5)
    generator = torch.Generator().manual_seed(6)
    logprobs = old + 0.8 * torch.randn(old.shape, generator=generator, dtype=torch.float64)
    advantages = 2 * torch.randn(old.shape, generator=generator, dtype=torch.float64)
    weights, stats = compute_importance_weights(
        old, behavior, mask, level="token", mode="mask", low=0.8, high=1.25
    )
    assert stats["rejected_tokens"].item() > 0
    denominator = mask.sum().item()  # rejected tokens still count
    loss, ppo_stats = compute_ppo_clip_loss(
        logprobs,
        old,
        advantages,
        mask,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        denominator=denominator,
        dual_clip=dual_clip,
        importance_weights=weights,
    )
    expected = naive_ppo(
        logprobs.flatten().tolist(),
        old.flatten().tolist(),
        advantages.flatten().tolist(),
        mask.flatten().tolist(),
        weights.flatten().tolist(),
        0.2,
        0.28,
        dual_clip,
        denominator,
    )
    assert math.isclose(loss.item(), expected, rel_tol=1e-12)
    assert (ppo_stats["dual_clipped_tokens"].item() > 0) == (dual_clip is not None)


def test_dual_clip_caps_negative_advantages_only():
    # ratio, advantage per token (clip range [0.8, 1.28], dual clip c = 3):
    #   5.0, -1 -> PPO 5, capped at 3 (no gradient)   2.0, -1 -> 2 < 3, untouched (grad 2)
    #   5.0, +1 -> clipped to -1.28 (no gradient)      0.1, +1 -> -0.1 (grad -0.1)
    #   0.5, -2 -> clipped to 1.6 < 6, untouched (no gradient)
    ratios = torch.tensor([5.0, 2.0, 5.0, 0.1, 0.5], dtype=torch.float64)
    advantages = torch.tensor([-1.0, -1.0, 1.0, 1.0, -2.0], dtype=torch.float64)
    old = torch.full((5,), -1.0, dtype=torch.float64)
    mask = torch.ones(5, dtype=torch.float64)

    def run(dual_clip):
        logprobs = (old + ratios.log()).requires_grad_()
        loss, stats = compute_ppo_clip_loss(
            logprobs,
            old,
            advantages,
            mask,
            clip_eps_low=0.2,
            clip_eps_high=0.28,
            denominator=5.0,
            dual_clip=dual_clip,
        )
        loss.backward()
        return loss.item(), logprobs.grad, stats

    loss, grad, stats = run(3.0)
    assert math.isclose(loss, (3 + 2 - 1.28 - 0.1 + 1.6) / 5, rel_tol=1e-12)
    torch.testing.assert_close(
        grad, torch.tensor([0.0, 2.0, 0.0, -0.1, 0.0], dtype=torch.float64) / 5
    )
    assert stats["dual_clipped_tokens"].item() == 1

    loss, grad, stats = run(None)
    assert math.isclose(loss, (5 + 2 - 1.28 - 0.1 + 1.6) / 5, rel_tol=1e-12)
    torch.testing.assert_close(
        grad, torch.tensor([5.0, 2.0, 0.0, -0.1, 0.0], dtype=torch.float64) / 5
    )
    assert stats["dual_clipped_tokens"].item() == 0


@pytest.mark.parametrize("dual_clip", [1.0, 0.5])
def test_dual_clip_must_exceed_one(dual_clip):
    with pytest.raises(ValueError, match="dual_clip"):
        compute_ppo_clip_loss(
            torch.zeros(2),
            torch.zeros(2),
            torch.ones(2),
            torch.ones(2),
            clip_eps_low=0.2,
            clip_eps_high=0.2,
            denominator=2,
            dual_clip=dual_clip,
        )


@pytest.mark.parametrize(("level", "mode", "low", "high"), VALID_COMBINATIONS)
def test_extreme_logprob_gaps_stay_finite(level, mode, low, high):
    old = torch.tensor([[0.0, -1e4, -200.0, 0.0], [-80.0, 0.0, -1e4, -1.0]])
    behavior = torch.tensor([[-1e4, 0.0, 0.0, -300.0], [-1.0, -1e4, 0.0, -1.0]])
    logprobs = torch.tensor([[-1e4, 0.0, -1e4, 0.0], [0.0, -1e4, 0.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -1e4, 0.0, -1e4], [-1e4, 0.0, -1e4, 0.0]])
    advantages = torch.tensor([[1.0, -1.0, 2.0, -3.0], [-1.0, 1.0, -2.0, 1.0]])
    mask = torch.ones(2, 4)
    weights, stats = compute_importance_weights(
        old, behavior, mask, level=level, mode=mode, low=low, high=high
    )
    assert torch.isfinite(weights).all() and (weights >= 0).all()
    assert all(torch.isfinite(value) for value in stats.values())
    loss, ppo_stats = compute_ppo_clip_loss(
        logprobs,
        old,
        advantages,
        mask,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        denominator=8,
        dual_clip=3.0,
        importance_weights=weights,
    )
    kl_loss, kl_stats = compute_kl_loss(
        logprobs, ref, mask, estimator="k3", coef=0.1, denominator=8
    )
    (loss + kl_loss).backward()
    assert torch.isfinite(loss) and torch.isfinite(kl_loss)
    assert torch.isfinite(logprobs.grad).all()
    assert all(torch.isfinite(value) for value in [*ppo_stats.values(), *kl_stats.values()])


@pytest.mark.parametrize("chunk_rows", [1, 4, 1024])
def test_token_entropy_matches_categorical(chunk_rows):
    generator = torch.Generator().manual_seed(7)
    logits = (3 * torch.randn(3, 5, 11, generator=generator, dtype=torch.float64)).requires_grad_()
    upstream = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    entropy = token_entropy_from_logits(logits, chunk_rows=chunk_rows)
    (entropy * upstream).sum().backward()
    grad = logits.grad.clone()

    logits.grad = None
    expected = torch.distributions.Categorical(logits=logits).entropy()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(entropy, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, logits.grad, rtol=1e-10, atol=1e-12)

    with torch.no_grad():
        torch.testing.assert_close(
            token_entropy_from_logits(logits, chunk_rows=chunk_rows), expected.detach()
        )


def test_token_entropy_upcasts_low_precision_and_handles_empty():
    logits = torch.randn(2, 3, 7).to(torch.bfloat16)
    entropy = token_entropy_from_logits(logits)
    assert entropy.dtype == torch.float32
    expected = torch.distributions.Categorical(logits=logits.float()).entropy()
    torch.testing.assert_close(entropy, expected)
    assert token_entropy_from_logits(torch.zeros(0, 4, 7)).shape == (0, 4)


def test_entropy_bonus_is_negative_masked_sum_over_denominator():
    entropy = torch.tensor([[1.0, 2.0, 4.0], [0.5, 8.0, 16.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    term, stats = compute_entropy_bonus(entropy, mask, coef=0.01, denominator=10.0)
    assert math.isclose(term.item(), -0.01 * (2 + 4 + 0.5 + 16) / 10, rel_tol=1e-6)
    assert stats["entropy_sum"].item() == 22.5
    term.backward()
    torch.testing.assert_close(entropy.grad, -0.001 * mask)


def window_terms(logits, tokens, old, behavior, ref, advantages, mask, rows, level, aggregation):
    """Policy + KL + entropy terms of the micro-batch made of `rows`, padded to its own width, each
    token divided by its `aggregation` denominator over the whole window (mask)."""
    width = int(torch.nonzero(mask[rows].sum(dim=0)).max()) + 1
    index = torch.tensor(rows)
    micro_logits = logits[index, :width]  # [micro_batch, width, vocab]
    logprobs = (
        torch.log_softmax(micro_logits, dim=-1).gather(-1, tokens[index, :width, None]).squeeze(-1)
    )
    micro_mask = mask[index, :width]
    denominator = compute_loss_denominator(
        micro_mask, aggregation=aggregation, window_tokens=int(mask.sum()), window_sequences=count_sequences(mask),
        constant_tokens=16)
    micro_old = old[index, :width]
    low, high = {"token": (0.8, 1.25), "seq": (0.5, 2.0), "geo": (0.9, 1.1)}[level]
    weights, stats = compute_importance_weights(
        micro_old, behavior[index, :width], micro_mask, level=level, mode="mask", low=low, high=high
    )
    policy, _ = compute_ppo_clip_loss(
        logprobs,
        micro_old,
        advantages[index, :width],
        micro_mask,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        denominator=denominator,
        dual_clip=3.0,
        importance_weights=weights,
    )
    # as the actor aggregates the KL term (compute_kl_loss takes one number as its denominator)
    kl = 0.05 * aggregate_tokens(compute_kl_estimate(logprobs, ref[index, :width], estimator="k3"), micro_mask,
                                 denominator=denominator)
    entropy = token_entropy_from_logits(micro_logits, chunk_rows=4)
    bonus, _ = compute_entropy_bonus(entropy, micro_mask, coef=0.01, denominator=denominator)
    return policy + kl + bonus, stats


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("level", ["token", "seq", "geo"])
def test_window_gradient_is_invariant_to_micro_batch_partition(level, aggregation):
    num_rows, seq, vocab = 8, 12, 6
    generator = torch.Generator().manual_seed(8)
    base, noisy, mask = build_rows(seed=9, num_rows=num_rows, seq=seq)
    gap = 1.5 * (noisy - base)  # behaviour minus trainer log-probs, noisier on later rows
    logits = torch.randn(num_rows, seq, vocab, generator=generator, dtype=torch.float64)
    tokens = torch.randint(vocab, (num_rows, seq), generator=generator)
    current = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    old = current + 0.3 * torch.randn(num_rows, seq, generator=generator, dtype=torch.float64)
    behavior = old + gap
    ref = current + 0.2 * torch.randn(num_rows, seq, generator=generator, dtype=torch.float64)
    row_advantage = 2 * torch.randn(num_rows, 1, generator=generator, dtype=torch.float64)
    advantages = row_advantage * mask

    def window_gradient(partition):
        leaf = logits.clone().requires_grad_()
        rejected = kept = 0.0
        for rows in partition:
            loss, stats = window_terms(
                leaf, tokens, old, behavior, ref, advantages, mask, rows, level, aggregation
            )
            loss.backward()
            rejected += stats["rejected_tokens"].item()
            kept += stats["kept_tokens"].item()
        assert rejected > 0 and kept > 0, "the window should exercise rejection"
        return leaf.grad

    whole = window_gradient([list(range(num_rows))])
    for partition in ([[0, 1], [2, 3, 4, 5, 6, 7]], [[7], [0, 3, 5], [6, 1], [4, 2]]):
        # float64; the terms only reorder a sum, so the tolerance is rounding, not approximation.
        torch.testing.assert_close(window_gradient(partition), whole, rtol=0.0, atol=1e-12)


# -- GSPO and CISPO --------------------------------------------------------------------------------


def naive_sequence_losses(kind, logprobs, old, advantages, mask, weights, low, high, denominator):
    """Row by row, token by token: (loss, d loss / d logprobs) of GSPO-token or CISPO, from the
    papers' formulas (GSPO: s = exp(mean action log-ratio), gradient s * A where unclipped;
    CISPO: -clip(ratio) * A * logprob, gradient -clip(ratio) * A everywhere)."""
    total, grads = 0.0, []
    for lp_row, old_row, adv_row, mask_row, w_row in zip(logprobs, old, advantages, mask, weights):
        actions = [clamp_log(lp - o) for lp, o, m in zip(lp_row, old_row, mask_row) if m]
        sequence = math.exp(sum(actions) / max(len(actions), 1))
        row = []
        for lp, o, adv, m, w in zip(lp_row, old_row, adv_row, mask_row, w_row):
            if not m:
                row.append(0.0)
                continue
            if kind == "gspo":
                clipped = min(max(sequence, 1 - low), 1 + high)
                loss = -min(sequence * adv, clipped * adv)
                takes_gradient = sequence * adv <= clipped * adv
                row.append(-w * sequence * adv / denominator if takes_gradient else 0.0)
            else:
                weight = min(max(math.exp(clamp_log(lp - o)), 1 - low), 1 + high)
                loss = -weight * adv * lp
                row.append(-w * weight * adv / denominator)
            total += w * loss
        grads.append(row)
    return total / denominator, grads


@pytest.mark.parametrize("kind", ["gspo", "cispo"])
def test_sequence_losses_match_naive_loops(kind):
    """Values and gradients of compute_gspo_loss / compute_cispo_loss against the naive loop, with
    importance weights and a band that clips some rows (GSPO) or tokens (CISPO) but not all."""
    old, behavior, mask = build_rows(seed=11)
    generator = torch.Generator().manual_seed(12)
    logprobs = (old + 0.5 * torch.randn(old.shape, generator=generator, dtype=torch.float64)).requires_grad_()
    advantages = (2 * torch.randn(old.shape[0], 1, generator=generator, dtype=torch.float64)) * mask
    weights, _ = compute_importance_weights(old, behavior, mask, level="token", mode="trunc", low=0.5, high=1.3)
    low, high = (0.02, 0.02) if kind == "gspo" else (0.2, 0.28)
    denominator = mask.sum().item()
    compute = compute_gspo_loss if kind == "gspo" else compute_cispo_loss
    loss, stats = compute(logprobs, old, advantages, mask, clip_eps_low=low, clip_eps_high=high,
                          denominator=denominator, importance_weights=weights)
    loss.backward()
    expected, expected_grads = naive_sequence_losses(kind, logprobs.tolist(), old.tolist(), advantages.tolist(),
                                                     mask.tolist(), weights.tolist(), low, high, denominator)
    assert math.isclose(loss.item(), expected, rel_tol=1e-12)
    torch.testing.assert_close(logprobs.grad, torch.tensor(expected_grads, dtype=torch.float64), rtol=1e-12,
                               atol=1e-15)
    assert 0 < stats["clipped_tokens"].item() < stats["action_tokens"].item() == denominator
    if kind == "cispo":  # a clipped token keeps its gradient
        assert (logprobs.grad[mask > 0] != 0).all()


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("kind", ["gspo", "cispo"])
def test_sequence_losses_are_invariant_to_micro_batch_partition(kind, aggregation):
    """Rows are whole sequences, so splitting the window's rows over micro-batches (denominators
    from the whole window's counts and each row's own tokens) leaves the gradient unchanged (float64)."""
    num_rows, seq, vocab = 8, 12, 6
    generator = torch.Generator().manual_seed(13)
    old, _, mask = build_rows(seed=14, num_rows=num_rows, seq=seq)
    logits = torch.randn(num_rows, seq, vocab, generator=generator, dtype=torch.float64)
    tokens = torch.randint(vocab, (num_rows, seq), generator=generator)
    advantages = 2 * torch.randn(num_rows, 1, generator=generator, dtype=torch.float64) * mask
    compute = compute_gspo_loss if kind == "gspo" else compute_cispo_loss

    def window_gradient(partition):
        leaf = logits.clone().requires_grad_()
        for rows in partition:
            logprobs = torch.log_softmax(leaf[rows], dim=-1).gather(-1, tokens[rows, :, None]).squeeze(-1)
            denominator = compute_loss_denominator(mask[rows], aggregation=aggregation, window_tokens=int(mask.sum()),
                                                   window_sequences=num_rows, constant_tokens=16)
            loss, _ = compute(logprobs, old[rows], advantages[rows], mask[rows], clip_eps_low=0.2, clip_eps_high=0.28,
                              denominator=denominator)
            loss.backward()
        return leaf.grad

    whole = window_gradient([list(range(num_rows))])
    assert whole.abs().max() > 0
    for partition in ([[0, 1], [2, 3, 4, 5, 6, 7]], [[7], [0, 3, 5], [6, 1], [4, 2]]):
        torch.testing.assert_close(window_gradient(partition), whole, rtol=0.0, atol=1e-12)


# -- loss aggregation ------------------------------------------------------------------------------


def naive_token_weights(mask_rows, aggregation, constant_tokens):
    """Row by row: the weight of each action token in the window's loss (0 elsewhere)."""
    lengths = [sum(1 for m in row if m) for row in mask_rows]
    sequences = sum(1 for n in lengths if n > 0)
    weights = []
    for row, n in zip(mask_rows, lengths):
        if aggregation == "token_mean":
            weight = 1 / sum(lengths)
        elif aggregation == "seq_mean_token_mean":
            weight = 1 / (n * sequences) if n else 0.0
        else:
            weight = 1 / (sequences * constant_tokens)
        weights.append([weight if m else 0.0 for m in row])
    return weights


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_loss_denominators_match_naive_token_weights(aggregation):
    _, _, mask = build_rows(seed=21, num_rows=6)
    mask[3] = 0.0  # a filler row: no action tokens, not a sequence
    assert count_sequences(mask) == 5
    denominator = compute_loss_denominator(mask, aggregation=aggregation, window_tokens=int(mask.sum()),
                                           window_sequences=count_sequences(mask), constant_tokens=16)
    weights = torch.where(mask > 0, 1 / torch.as_tensor(denominator, dtype=torch.float64), torch.zeros_like(mask))
    expected = torch.tensor(naive_token_weights(mask.tolist(), aggregation, 16), dtype=torch.float64)
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=0.0)
    if aggregation != "constant":  # a mean: the window's weights add up to 1
        assert math.isclose(weights.sum().item(), 1.0, rel_tol=1e-12)


def naive_ppo_row(logprobs, old, advantages, mask, weights, low, high):
    """One row of PPO-clip: (summed loss, d loss / d logprobs per token), token by token."""
    total, grads = 0.0, []
    for lp, olp, adv, m, w in zip(logprobs, old, advantages, mask, weights):
        if not m:
            grads.append(0.0)
            continue
        ratio = math.exp(clamp_log(lp - olp))
        clipped = min(max(ratio, 1 - low), 1 + high)
        total += -w * min(ratio * adv, clipped * adv)
        grads.append(-w * adv * ratio if ratio * adv <= clipped * adv else 0.0)
    return total, grads


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("kind", ["ppo", "gspo", "cispo"])
def test_aggregated_losses_match_naive_loops(kind, aggregation):
    """Value and gradient of each policy loss and of the entropy bonus under each aggregation, against
    loops that weight each row's token terms by the naive token weights (float64)."""
    old, behavior, mask = build_rows(seed=22)
    generator = torch.Generator().manual_seed(23)
    logprobs = (old + 0.5 * torch.randn(old.shape, generator=generator, dtype=torch.float64)).requires_grad_()
    advantages = (2 * torch.randn(old.shape[0], 1, generator=generator, dtype=torch.float64)) * mask
    weights, _ = compute_importance_weights(old, behavior, mask, level="token", mode="trunc", low=0.5, high=1.3)
    low, high = (0.02, 0.02) if kind == "gspo" else (0.2, 0.28)
    denominator = compute_loss_denominator(mask, aggregation=aggregation, window_tokens=int(mask.sum()),
                                           window_sequences=count_sequences(mask), constant_tokens=16)
    compute = {"ppo": compute_ppo_clip_loss, "gspo": compute_gspo_loss, "cispo": compute_cispo_loss}[kind]
    loss, _ = compute(logprobs, old, advantages, mask, clip_eps_low=low, clip_eps_high=high, denominator=denominator,
                      importance_weights=weights)
    loss.backward()

    token_weights = naive_token_weights(mask.tolist(), aggregation, 16)
    expected, expected_grads = 0.0, []
    rows = zip(logprobs.tolist(), old.tolist(), advantages.tolist(), mask.tolist(), weights.tolist(), token_weights)
    for lp_row, old_row, adv_row, mask_row, w_row, share_row in rows:
        share = max(share_row)  # every action token of a row weighs the same
        if kind == "ppo":
            row_loss, row_grads = naive_ppo_row(lp_row, old_row, adv_row, mask_row, w_row, low, high)
        else:
            row_loss, row_grads = naive_sequence_losses(kind, [lp_row], [old_row], [adv_row], [mask_row], [w_row],
                                                        low, high, 1.0)
            row_grads = row_grads[0]
        expected += share * row_loss
        expected_grads.append([share * g for g in row_grads])
    assert math.isclose(loss.item(), expected, rel_tol=1e-12)
    torch.testing.assert_close(logprobs.grad, torch.tensor(expected_grads, dtype=torch.float64), rtol=1e-12,
                               atol=1e-15)

    entropy = torch.rand(old.shape, generator=generator, dtype=torch.float64).requires_grad_()
    bonus, _ = compute_entropy_bonus(entropy, mask, coef=0.01, denominator=denominator)
    bonus.backward()
    naive_bonus = -0.01 * sum(h * s for h_row, s_row in zip(entropy.tolist(), token_weights)
                              for h, s in zip(h_row, s_row))
    assert math.isclose(bonus.item(), naive_bonus, rel_tol=1e-12)
    torch.testing.assert_close(entropy.grad, -0.01 * torch.tensor(token_weights, dtype=torch.float64))


def test_loss_aggregation_refuses_bad_options():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="loss aggregation must be one of .* got 'sum'"):
        compute_loss_denominator(mask, aggregation="sum", window_tokens=6, window_sequences=2)
    with pytest.raises(ValueError, match="constant_tokens >= 1, got 0"):
        compute_loss_denominator(mask, aggregation="constant", window_tokens=6, window_sequences=2)


# -- sequence trust region -------------------------------------------------------------------------


def naive_trust_region(old, behavior, mask, max_kl, cap, base_weights):
    """Row by row: per-token weights, and each row's mean k3 KL(behaviour || trainer) (None: no actions)."""
    weights, row_kls = [], []
    for old_row, behavior_row, mask_row, base_row in zip(old, behavior, mask, base_weights):
        gaps = [clamp_log(o - b) for o, b, m in zip(old_row, behavior_row, mask_row) if m]
        row_kl = sum(math.exp(d) - 1 - d for d in gaps) / len(gaps) if gaps else None
        row_kls.append(row_kl)
        keep = row_kl is not None and row_kl <= max_kl
        weights.append([min(base, cap) if m and keep else 0.0 for m, base in zip(mask_row, base_row)])
    return weights, row_kls


@pytest.mark.parametrize("with_importance", [False, True])
def test_trust_region_weights_match_naive_loop(with_importance):
    old, behavior, mask = build_rows(seed=24)  # behaviour noisier on later rows
    mask[5] = 0.0  # a row without action tokens is not a sequence
    importance = None
    if with_importance:
        importance, _ = compute_importance_weights(old, behavior, mask, level="token", mode="mask", low=0.8, high=1.5)
    ratio = torch.exp(old - behavior) * mask
    base = (importance if with_importance else ratio).tolist()
    weights, stats = compute_trust_region_weights(old, behavior, mask, max_kl=0.05, weight_cap=1.2,
                                                  importance_weights=importance)
    expected, row_kls = naive_trust_region(old.tolist(), behavior.tolist(), mask.tolist(), 0.05, 1.2, base)
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0.0)

    kls = [kl for kl in row_kls if kl is not None]
    rejected = [row for row, kl in enumerate(row_kls) if kl is not None and kl > 0.05]
    assert 0 < len(rejected) < len(kls), "inputs should reject some rows, keep some"
    assert all(weights[row].abs().sum() == 0 for row in rejected)
    assert stats["trust_region_sequences"].item() == len(kls) == 7
    assert stats["trust_region_rejected_sequences"].item() == len(rejected)
    assert stats["trust_region_rejected_tokens"].item() == sum(mask[row].sum().item() for row in rejected)
    assert math.isclose(stats["trust_region_kl_sum"].item(), sum(kls), rel_tol=1e-12)
    assert math.isclose(stats["trust_region_kl_max"].item(), max(kls), rel_tol=1e-12)
    k3 = (ratio - 1 - (old - behavior)) * mask
    assert math.isclose(stats["mismatch_kl_sum"].item(), k3.sum().item(), rel_tol=1e-12)


def test_trust_region_sees_the_divergence_that_the_mean_log_ratio_hides():
    """Row 0's log-ratios alternate +-0.2: its mean log-ratio is 0 (geo-mask keeps it) but its KL is
    ~0.02 > 1e-3; row 1's are all 0.01 (KL 5e-5), kept, its weights the token ratios."""
    behavior = torch.zeros(2, 4, dtype=torch.float64)
    old = torch.tensor([[0.2, -0.2, 0.2, -0.2], [0.01] * 4], dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.float64)
    geo, _ = compute_importance_weights(old, behavior, mask, level="geo", mode="mask", low=0.9, high=1.5)
    assert (geo[0] > 0).all()
    weights, stats = compute_trust_region_weights(old, behavior, mask, max_kl=1e-3, weight_cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.0] * 4, [math.exp(0.01)] * 4], dtype=torch.float64))
    assert stats["trust_region_rejected_sequences"].item() == 1
    row0 = (math.exp(0.2) - 1.2 + math.exp(-0.2) - 0.8) / 2
    assert math.isclose(stats["trust_region_kl_max"].item(), row0, rel_tol=1e-12)


@pytest.mark.parametrize(("max_kl", "cap"), [(0.0, 2.0), (-1e-3, 2.0), (1e-3, 0.0)])
def test_trust_region_refuses_bad_options(max_kl, cap):
    old, behavior, mask = build_rows(seed=4, num_rows=2)
    with pytest.raises(ValueError, match="max_kl > 0 and weight_cap > 0"):
        compute_trust_region_weights(old, behavior, mask, max_kl=max_kl, weight_cap=cap)
