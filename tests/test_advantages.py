import math

import pytest
import torch

from molt.objectives import (
    compute_dr_grpo_advantages,
    compute_gae_advantages,
    compute_group_mean_advantages,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_rloo_advantages,
    compute_value_loss,
    whiten,
)

GROUP_ESTIMATORS = [
    compute_group_mean_advantages,
    compute_dr_grpo_advantages,
    compute_rloo_advantages,
    compute_grpo_advantages,
]

# Unsorted, non-contiguous, negative ids, one singleton (5).
GROUP_IDS = [7, 3, 7, -3, 7, 11, 3, 7, 42, 42, 42, 5, 11, -3]


def naive_group_mean(rewards: list[float], group_ids: list[int]) -> list[float]:
    out = []
    for reward, group in zip(rewards, group_ids):
        members = [r for r, g in zip(rewards, group_ids) if g == group]
        out.append(reward - sum(members) / len(members))
    return out


def naive_rloo(rewards: list[float], group_ids: list[int]) -> list[float]:
    out = []
    for i, (reward, group) in enumerate(zip(rewards, group_ids)):
        others = [r for j, (r, g) in enumerate(zip(rewards, group_ids)) if g == group and j != i]
        out.append(reward - sum(others) / len(others) if others else reward)
    return out


def random_rewards(num: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("estimator", [compute_group_mean_advantages, compute_dr_grpo_advantages])
def test_group_mean_and_dr_grpo_match_naive_loop(estimator):
    rewards = random_rewards(len(GROUP_IDS), seed=0)
    advantages = estimator(rewards, torch.tensor(GROUP_IDS))
    expected = torch.tensor(naive_group_mean(rewards.tolist(), GROUP_IDS), dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, rtol=1e-12, atol=1e-12)


def test_rloo_matches_naive_loop():
    rewards = random_rewards(len(GROUP_IDS), seed=1)
    advantages = compute_rloo_advantages(rewards, torch.tensor(GROUP_IDS))
    expected = torch.tensor(naive_rloo(rewards.tolist(), GROUP_IDS), dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, rtol=1e-12, atol=1e-12)


def test_group_estimators_hand_numbers():
    rewards = torch.tensor([1.0, 0.0, 0.0, 4.0, 2.0, 3.0])
    group_ids = torch.tensor([9, 9, 9, 2, 2, 0])
    # Group 9 = {1, 0, 0}: mean 1/3. Group 2 = {4, 2}: mean 3. Group 0 = {3}: a singleton.
    torch.testing.assert_close(
        compute_group_mean_advantages(rewards, group_ids),
        torch.tensor([2 / 3, -1 / 3, -1 / 3, 1.0, -1.0, 0.0]),
    )
    # Mean of the others: 1 -> {0, 0} = 0; 0 -> {1, 0} = 0.5; 4 -> {2}; 2 -> {4}; 3 keeps 3.
    torch.testing.assert_close(
        compute_rloo_advantages(rewards, group_ids),
        torch.tensor([1.0, -0.5, -0.5, 2.0, -2.0, 3.0]),
    )
    # Dr. GRPO does not divide by the std: scaling rewards scales advantages.
    torch.testing.assert_close(
        compute_dr_grpo_advantages(10 * rewards, group_ids),
        torch.tensor([20 / 3, -10 / 3, -10 / 3, 10.0, -10.0, 0.0]),
    )


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_constant_groups_are_exactly_zero(estimator):
    # 0.1 * 3 / 3 != 0.1 in floating point: through the mean these would be ~1e-17, not 0.
    rewards = torch.tensor([0.1, 0.7, 0.1, 0.7, 0.1, 1.0, 0.0], dtype=torch.float64)
    group_ids = torch.tensor([4, 8, 4, 8, 4, 1, 1])
    advantages = estimator(rewards, group_ids)
    assert advantages[:5].tolist() == [0.0] * 5
    assert (advantages[5:] != 0).all()


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_group_of_one(estimator):
    advantages = estimator(torch.tensor([0.3, 0.9, 0.1]), torch.tensor([0, 1, 2]))
    if estimator is compute_rloo_advantages:
        # No other rollout to baseline against: the reward is kept.
        assert advantages.tolist() == torch.tensor([0.3, 0.9, 0.1]).tolist()
    else:
        assert advantages.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_group_estimators_empty_dtype_and_shape_errors(estimator):
    empty = estimator(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0,) and empty.dtype == torch.float32
    out = estimator(torch.tensor([1.0, 0.0], dtype=torch.float32), torch.tensor([0, 0]))
    assert out.dtype == torch.float32
    with pytest.raises(ValueError, match="same length"):
        estimator(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="1-D"):
        estimator(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long))


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_group_estimators_finite_for_extreme_rewards(estimator):
    # Large enough that float32 sums or squares would overflow; every true advantage fits.
    rewards = torch.tensor([1e30, -1e30, 1e-30, 0.0, 1e37, -1e37], dtype=torch.float32)
    advantages = estimator(rewards, torch.tensor([0, 0, 1, 1, 2, 2]))
    assert torch.isfinite(advantages).all()
    assert advantages[0] > 0 > advantages[1]


# Token estimators. Rows below: action ranges separated by observation tokens, right padding.
MASK_ROWS = [
    [0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 0],  # prompt, 3 actions, observation, 2, observation, 1, pad
    [0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0],  # one action range, right padding
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # no action token at all
    [1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 1],  # alternating, ends on actions
]


def python_whiten(values: list[float]) -> list[float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return [(v - mean) / (std + 1e-8) for v in values]


def naive_token_rewards(reward, mask_row, kl_row, kl_coef):
    """[(position, reward)] over the row's action tokens, in order."""
    positions = [t for t, m in enumerate(mask_row) if m]
    rewards = [-kl_coef * kl_row[t] for t in positions]
    if positions:
        rewards[-1] += reward
    return positions, rewards


def naive_returns(token_rewards: list[float], gamma: float) -> list[float]:
    out, running = [], 0.0
    for r in reversed(token_rewards):
        running = r + gamma * running
        out.append(running)
    return out[::-1]


def naive_reinforce_pp(rewards, mask, kl, kl_coef, gamma):
    rows = [naive_token_rewards(r, m, k, kl_coef) for r, m, k in zip(rewards, mask, kl)]
    returns = [naive_returns(token_rewards, gamma) for _, token_rewards in rows]
    flat = python_whiten([g for row in returns for g in row])
    out = [[0.0] * len(mask[0]) for _ in mask]
    for b, (positions, _) in enumerate(rows):
        for t in positions:
            out[b][t] = flat.pop(0)
    return out


def naive_gae(rewards, values, mask, kl, kl_coef, gamma, lam):
    advantages = [[0.0] * len(mask[0]) for _ in mask]
    returns = [[0.0] * len(mask[0]) for _ in mask]
    for b, (reward, mask_row) in enumerate(zip(rewards, mask)):
        positions, token_rewards = naive_token_rewards(reward, mask_row, kl[b], kl_coef)
        next_value, next_advantage = 0.0, 0.0
        for t, r in zip(reversed(positions), reversed(token_rewards)):
            delta = r + gamma * next_value - values[b][t]
            next_advantage = delta + gamma * lam * next_advantage
            next_value = values[b][t]
            advantages[b][t] = next_advantage
            returns[b][t] = next_advantage + values[b][t]
    return advantages, returns


def token_inputs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.tensor(MASK_ROWS, dtype=torch.float32)
    rewards = torch.randn(len(MASK_ROWS), generator=generator, dtype=torch.float64)
    values = torch.randn(mask.shape, generator=generator, dtype=torch.float64)
    kl = torch.rand(mask.shape, generator=generator, dtype=torch.float64)
    # Whatever sits off the action tokens must not be read.
    values = torch.where(mask > 0, values, torch.full_like(values, 1e9))
    kl = torch.where(mask > 0, kl, torch.full_like(kl, float("nan")))
    return rewards, values, mask, kl


@pytest.mark.parametrize("gamma", [0.9, 1.0])
def test_reinforce_pp_matches_naive_loop(gamma):
    rewards, _, mask, kl = token_inputs(seed=2)
    advantages = compute_reinforce_pp_advantages(
        rewards, mask, gamma=gamma, token_kl=kl, kl_coef=0.3
    )
    expected = naive_reinforce_pp(rewards.tolist(), mask.tolist(), kl.tolist(), 0.3, gamma)
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-10, atol=1e-10)


def test_reinforce_pp_gamma_one_without_kl_is_whitened_terminal_reward():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 0, 1, 1, 0]])
    advantages = compute_reinforce_pp_advantages(rewards, mask, gamma=1.0)
    # Action tokens carry 1, 1, 0, 0, 0: mean 0.4, population std sqrt(0.24).
    high, low = 0.6 / (math.sqrt(0.24) + 1e-8), -0.4 / (math.sqrt(0.24) + 1e-8)
    expected = torch.tensor([[0, high, high, 0, 0], [low, 0, low, low, 0]])
    torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=1e-6)


def test_reinforce_pp_kl_penalty_on_action_tokens_and_reward_on_the_last():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0]])
    kl = torch.tensor([[5.0, 1.0, 2.0, 7.0, 3.0, float("nan")]])  # 5, 7, nan: not actions
    advantages = compute_reinforce_pp_advantages(
        torch.tensor([10.0], dtype=torch.float64), mask, gamma=0.5, token_kl=kl, kl_coef=0.5
    )
    # Token rewards at 1, 2, 4: -0.5, -1, -1.5 + 10. Returns, the gap at 3 costs no discount:
    # at 4: 8.5; at 2: -1 + 0.5 * 8.5 = 3.25; at 1: -0.5 + 0.5 * 3.25 = 1.125.
    a1, a2, a4 = python_whiten([1.125, 3.25, 8.5])
    expected = torch.tensor([[0, a1, a2, 0, a4, 0]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gamma,lam", [(0.9, 0.8), (1.0, 1.0), (0.7, 0.0), (1.0, 0.95)])
def test_gae_matches_naive_loop(gamma, lam):
    rewards, values, mask, kl = token_inputs(seed=3)
    advantages, returns = compute_gae_advantages(
        rewards, values, mask, gamma=gamma, lam=lam, token_kl=kl, kl_coef=0.2,
        whiten_advantages=False,
    )
    expected_advantages, expected_returns = naive_gae(
        rewards.tolist(), values.tolist(), mask.tolist(), kl.tolist(), 0.2, gamma, lam
    )
    expected_advantages = torch.tensor(expected_advantages, dtype=torch.float64)
    torch.testing.assert_close(advantages, expected_advantages, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(returns, torch.tensor(expected_returns, dtype=torch.float64),
                               rtol=1e-10, atol=1e-10)

    whitened, same_returns = compute_gae_advantages(
        rewards, values, mask, gamma=gamma, lam=lam, token_kl=kl, kl_coef=0.2
    )
    torch.testing.assert_close(same_returns, returns, rtol=0, atol=0)
    flat = python_whiten([a for row, m in zip(expected_advantages.tolist(), MASK_ROWS)
                          for a, keep in zip(row, m) if keep])
    assert whitened[mask > 0].tolist() == pytest.approx(flat, rel=1e-9, abs=1e-9)
    assert (whitened[mask == 0] == 0).all()


def test_gae_hand_numbers_across_observation_gap_and_padding():
    mask = torch.tensor([[1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0]])
    values = torch.tensor([[0.5, 9.0, 9.0, 0.25, 1.0, 9.0], [0.5, 1.0, 7.0, 7.0, 7.0, 7.0]])
    rewards = torch.tensor([2.0, -1.0])
    advantages, returns = compute_gae_advantages(
        rewards, values, mask, gamma=0.5, lam=0.5, whiten_advantages=False
    )
    # Row 0, actions at 0, 3, 4 with values 0.5, 0.25, 1.0; the 9s are observations and padding.
    #   delta: 2 - 1 = 1;  0.5 * 1 - 0.25 = 0.25;  0.5 * 0.25 - 0.5 = -0.375
    #   A:     1;          0.25 + 0.25 * 1 = 0.5;  -0.375 + 0.25 * 0.5 = -0.25
    # Row 1, actions at 0, 1: delta -1 - 1 = -2, 0.5 * 1 - 0.5 = 0; A -2, 0 + 0.25 * -2 = -0.5.
    expected = torch.tensor([[-0.25, 0, 0, 0.5, 1.0, 0], [-0.5, -2.0, 0, 0, 0, 0]])
    torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=1e-6)
    expected_returns = torch.tensor([[0.25, 0, 0, 0.75, 2.0, 0], [0.0, -1.0, 0, 0, 0, 0]])
    torch.testing.assert_close(returns, expected_returns, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gamma", [0.95, 1.0])
def test_gae_lambda_one_is_monte_carlo_return_minus_value(gamma):
    rewards, values, mask, _ = token_inputs(seed=4)
    advantages, returns = compute_gae_advantages(
        rewards, values, mask, gamma=gamma, lam=1.0, whiten_advantages=False
    )
    for b, mask_row in enumerate(MASK_ROWS):
        positions = [t for t, m in enumerate(mask_row) if m]
        discounted = [gamma ** (len(positions) - 1 - k) * rewards[b].item()
                      for k in range(len(positions))]
        for t, monte_carlo in zip(positions, discounted):
            assert advantages[b, t].item() == pytest.approx(monte_carlo - values[b, t].item(),
                                                            rel=1e-12, abs=1e-12)
            assert returns[b, t].item() == pytest.approx(monte_carlo, rel=1e-12, abs=1e-12)


def test_token_estimators_empty_and_shape_errors():
    for batch, seq in [(0, 5), (3, 0), (0, 0)]:
        rewards, mask = torch.zeros(batch), torch.zeros(batch, seq)
        assert compute_reinforce_pp_advantages(rewards, mask, gamma=0.9).shape == (batch, seq)
        advantages, returns = compute_gae_advantages(
            rewards, torch.zeros(batch, seq), mask, gamma=0.9, lam=0.9
        )
        assert advantages.shape == returns.shape == (batch, seq)
    with pytest.raises(ValueError, match="rewards must be"):
        compute_reinforce_pp_advantages(torch.zeros(3), torch.zeros(2, 4), gamma=1.0)
    with pytest.raises(ValueError, match="values must be"):
        compute_gae_advantages(torch.zeros(2), torch.zeros(2, 3), torch.zeros(2, 4),
                               gamma=1.0, lam=1.0)


def test_token_estimators_finite_for_extreme_inputs():
    generator = torch.Generator().manual_seed(5)
    mask = (torch.rand(4, 2000, generator=generator) < 0.7).float()
    rewards = torch.tensor([1e6, -1e6, 0.0, 1e-6])
    kl = torch.rand(4, 2000, generator=generator) * 1e4
    values = torch.randn(4, 2000, generator=generator) * 1e6
    advantages = compute_reinforce_pp_advantages(rewards, mask, gamma=0.999, token_kl=kl,
                                                 kl_coef=1.0)
    assert torch.isfinite(advantages).all()
    advantages, returns = compute_gae_advantages(rewards, values, mask, gamma=0.999, lam=0.95,
                                                 token_kl=kl, kl_coef=1.0)
    assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()
    # float32 rewards whose squares overflow float32: whitening must still see their signs.
    huge = compute_reinforce_pp_advantages(torch.tensor([1e30, -1e30, 0.0, 1e-30]), mask,
                                           gamma=1.0)
    assert torch.isfinite(huge).all()
    assert (huge[0][mask[0] > 0] > 0).all() and (huge[1][mask[1] > 0] < 0).all()
    # All rewards equal, no KL: every token's return is the same, so exactly 0 after whitening.
    rewards = torch.full((4,), 0.1, dtype=torch.float64)
    same = compute_reinforce_pp_advantages(rewards, mask, gamma=1.0)
    assert (same == 0).all()


def test_whiten_over_masked_entries_only():
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, -7.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    out = whiten(values, mask)
    a, b, c, d = python_whiten([1.0, 2.0, 4.0, 3.0])
    torch.testing.assert_close(out, torch.tensor([[a, b, 0], [c, 0, d]], dtype=torch.float64),
                               rtol=1e-12, atol=1e-12)
    # 3 * 0.1 / 3 != 0.1 in float64: through the mean these would be ~1e-9, not 0.
    constant = whiten(torch.tensor([0.1, 0.1, 0.1, 5.0], dtype=torch.float64),
                      torch.tensor([1, 1, 1, 0]))
    assert constant.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert whiten(values, torch.zeros(2, 3)).tolist() == [[0.0] * 3] * 2
    assert whiten(torch.zeros(0, 4), torch.zeros(0, 4)).shape == (0, 4)


# Value loss. clip_range 0.2 around old_values:
#   a: old 1.0, v 1.5, R 2.0: unclipped 0.25, clipped (1.2 - 2)^2 = 0.64 -> clipped, no gradient
#   b: old 1.0, v 1.5, R 0.0: unclipped 2.25, clipped 1.2^2 = 1.44 -> unclipped, grad v - R = 1.5
#   c: old 0.0, v 0.1, R 1.0: inside the range, both 0.81, grad -0.9
#   d: old 1.0, v 0.5, R 0.0: unclipped 0.25, clipped 0.8^2 = 0.64 -> clipped below, no gradient
#   e: masked (v 100, R 0): nothing
VALUE_CASE = dict(
    values=[1.5, 1.5, 0.1, 0.5, 100.0],
    old_values=[1.0, 1.0, 0.0, 1.0, 0.0],
    returns=[2.0, 0.0, 1.0, 0.0, 0.0],
    mask=[1, 1, 1, 1, 0],
)


def run_value_loss(clip_range, denominator=5.0):
    values = torch.tensor(VALUE_CASE["values"], dtype=torch.float64, requires_grad=True)
    loss, stats = compute_value_loss(
        values,
        torch.tensor(VALUE_CASE["old_values"], dtype=torch.float64),
        torch.tensor(VALUE_CASE["returns"], dtype=torch.float64),
        torch.tensor(VALUE_CASE["mask"]),
        clip_range=clip_range,
        denominator=denominator,
    )
    loss.backward()
    return loss, stats, values.grad


def test_value_loss_clipped_hand_numbers():
    loss, stats, grad = run_value_loss(clip_range=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 2.25 + 0.81 + 0.64) / 5, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([0.0, 1.5 / 5, -0.9 / 5, 0.0, 0.0],
                                                  dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert stats["value_clipped_tokens"].item() == 2
    assert stats["value_error_sum"].item() == pytest.approx(0.25 + 2.25 + 0.81 + 0.25)
    assert stats["value_sum"].item() == pytest.approx(3.6)
    assert stats["return_sum"].item() == pytest.approx(3.0)
    assert stats["return_square_sum"].item() == pytest.approx(5.0)


def test_value_loss_without_clipping_hand_numbers():
    loss, stats, grad = run_value_loss(clip_range=None)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 2.25 + 0.81 + 0.25) / 5, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([-0.5 / 5, 1.5 / 5, -0.9 / 5, 0.5 / 5, 0.0],
                                                  dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert stats["value_clipped_tokens"].item() == 0


def test_value_loss_split_window_adds_up():
    generator = torch.Generator().manual_seed(6)
    values, old, returns = torch.randn(3, 4, 9, generator=generator, dtype=torch.float64)
    mask = (torch.rand(4, 9, generator=generator) < 0.6).double()
    denominator = mask.sum()
    whole, whole_stats = compute_value_loss(values, old, returns, mask, clip_range=0.1,
                                            denominator=denominator)
    halves = [compute_value_loss(values[rows], old[rows], returns[rows], mask[rows],
                                 clip_range=0.1, denominator=denominator)
              for rows in (slice(0, 1), slice(1, 4))]
    assert whole.item() == pytest.approx(sum(loss.item() for loss, _ in halves), rel=1e-12)
    for key, value in whole_stats.items():
        assert value.item() == pytest.approx(sum(stats[key].item() for _, stats in halves))


def test_whiten_with_summed_moments_of_parts_equals_whitening_the_whole():
    from molt.objectives.advantages import Moments, masked_moments

    generator = torch.Generator().manual_seed(3)
    values = torch.randn(6, 9, generator=generator, dtype=torch.float64) * 5 + 2
    mask = (torch.rand(6, 9, generator=generator) > 0.4).to(torch.float64)
    parts = [(values[:2], mask[:2]), (values[2:5], mask[2:5]), (values[5:], mask[5:])]
    moments = Moments(*(sum(m) for m in zip(*(masked_moments(v, k) for v, k in parts))))
    assert moments.count == mask.sum()
    pieced = torch.cat([whiten(v, k, moments=moments) for v, k in parts])
    torch.testing.assert_close(pieced, whiten(values, mask), atol=1e-12, rtol=0)
    constant = torch.full((2, 3), 0.1, dtype=torch.float64)
    ones = torch.ones_like(constant)
    assert whiten(constant, ones, moments=masked_moments(constant, ones)).abs().max() == 0
