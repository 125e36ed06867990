import math

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

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
from molt.objectives.advantages import SegmentHeads, chain_segments, compute_segment_heads

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


# -- a rollout of several segments (experiences) chains into one episode ----------------------

# (rollout id, segment index, action mask, reward): batch order shuffles each rollout's segments.
# Rollout 7 has three segments, 8 one, 9 two whose last has no action token (the reward then sits
# on segment 0's last action token), 3 two, the second starting with an action token.
SEGMENTS = [
    (7, 2, [0, 1, 1, 1, 0, 0, 1, 0], 1.5),
    (9, 0, [0, 1, 0, 1, 1], -2.0),
    (7, 0, [0, 0, 1, 1, 0, 1], 1.5),
    (3, 1, [1, 0, 1, 0, 1, 1, 0], 0.25),
    (8, 0, [0, 1, 1, 0, 1], 3.0),
    (7, 1, [0, 0, 0, 1, 0, 1, 1], 1.5),
    (3, 0, [0, 1, 1], 0.25),
    (9, 1, [0, 0, 0], -2.0),
]
KL_COEF = 0.3


def segment_inputs(seed: int):
    """Per segment: random values and KL on every position (only the action tokens count)."""
    generator = torch.Generator().manual_seed(seed)
    values = [torch.randn(len(mask), generator=generator, dtype=torch.float64).tolist()
              for _, _, mask, _ in SEGMENTS]
    kl = [torch.rand(len(mask), generator=generator, dtype=torch.float64).tolist() for _, _, mask, _ in SEGMENTS]
    return values, kl


def naive_chained(values, kl, *, gamma, lam, kl_coef=KL_COEF):
    """Per segment, (advantages, returns) lists over its positions, unwhitened: each rollout's
    action tokens concatenated in segment order, the plain GAE recursion over the whole rollout
    (reward on its final action token, 0 value after it), then split back. REINFORCE++ returns are
    GAE with 0 values and lam 1."""
    advantages = [[0.0] * len(mask) for _, _, mask, _ in SEGMENTS]
    returns = [[0.0] * len(mask) for _, _, mask, _ in SEGMENTS]
    for rollout in sorted({rollout for rollout, *_ in SEGMENTS}):
        mine = sorted((segment, s) for s, (r, segment, _, _) in enumerate(SEGMENTS) if r == rollout)
        tokens = [(s, t) for _, s in mine for t, is_action in enumerate(SEGMENTS[s][2]) if is_action]
        next_value, next_advantage = 0.0, 0.0
        for k, (s, t) in enumerate(reversed(tokens)):
            reward = -kl_coef * kl[s][t] + (SEGMENTS[s][3] if k == 0 else 0.0)
            delta = reward + gamma * next_value - values[s][t]
            next_advantage = delta + gamma * lam * next_advantage
            next_value = values[s][t]
            advantages[s][t], returns[s][t] = next_advantage, next_advantage + values[s][t]
    return advantages, returns


def padded(rows: list[list[float]], fill: float) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([row + [fill] * (width - len(row)) for row in rows], dtype=torch.float64)


def chained_in_one_batch(values, kl, *, estimator, gamma, lam):
    """The chain on one process: all segments as one padded batch, heads, links, estimator."""
    mask = padded([m for _, _, m, _ in SEGMENTS], 0.0)
    action = mask > 0
    values = torch.where(action, padded(values, 0.0), torch.full_like(mask, 1e9))  # off actions: unread
    kl = torch.where(action, padded(kl, 0.0), torch.full_like(mask, float("nan")))
    rewards = torch.tensor([reward for *_, reward in SEGMENTS], dtype=torch.float64)
    is_gae = estimator == "gae"
    heads = compute_segment_heads(mask, gamma=gamma, lam=lam if is_gae else 1.0, values=values if is_gae else None,
                                  token_kl=kl, kl_coef=KL_COEF)
    links = chain_segments(heads, rewards, torch.tensor([r for r, *_ in SEGMENTS]),
                           torch.tensor([s for _, s, *_ in SEGMENTS]), gamma=gamma, lam=lam if is_gae else 1.0)
    if is_gae:
        return compute_gae_advantages(links.rewards, values, mask, gamma=gamma, lam=lam, token_kl=kl, kl_coef=KL_COEF,
                                      whiten_advantages=False, next_values=links.next_values,
                                      next_advantages=links.next_advantages)
    return compute_reinforce_pp_advantages(links.rewards, mask, gamma=gamma, token_kl=kl, kl_coef=KL_COEF,
                                           whiten_returns=False, next_returns=links.next_advantages), None


@pytest.mark.parametrize("estimator,gamma,lam", [("reinforce_pp", 0.9, 1.0), ("reinforce_pp", 1.0, 1.0),
                                                 ("gae", 0.9, 0.8), ("gae", 1.0, 0.95), ("gae", 0.7, 0.0)])
def test_segments_of_a_rollout_chain_like_one_concatenated_row(estimator, gamma, lam):
    values, kl = segment_inputs(seed=11)
    advantages, returns = chained_in_one_batch(values, kl, estimator=estimator, gamma=gamma, lam=lam)
    expected_advantages, expected_returns = naive_chained(
        values if estimator == "gae" else [[0.0] * len(v) for v in values], kl, gamma=gamma,
        lam=lam if estimator == "gae" else 1.0)
    torch.testing.assert_close(advantages, padded(expected_advantages, 0.0), rtol=1e-12, atol=1e-12)
    if returns is not None:
        torch.testing.assert_close(returns, padded(expected_returns, 0.0), rtol=1e-12, atol=1e-12)
    # The chain moves the earlier segments: rollout 7's segment 0 (row 2) differs from itself alone.
    _, _, mask, reward = SEGMENTS[2]
    alone, _ = naive_gae([reward], [values[2]], [mask], [kl[2]], KL_COEF, gamma, lam) if estimator == "gae" else \
        naive_gae([reward], [[0.0] * len(mask)], [mask], [kl[2]], KL_COEF, gamma, 1.0)
    last = max(t for t, m in enumerate(mask) if m)
    assert abs(advantages[2, last].item() - alone[0][last]) > 1e-3


@pytest.mark.parametrize("gamma,lam", [(0.9, 0.8), (1.0, 1.0)])
def test_single_segment_rollouts_chain_to_exactly_the_unchained_result(gamma, lam):
    rewards, values, mask, kl = token_inputs(seed=12)
    heads = compute_segment_heads(mask, gamma=gamma, lam=lam, values=values, token_kl=kl, kl_coef=0.2)
    links = chain_segments(heads, rewards, torch.arange(len(rewards)) * 5, torch.zeros(len(rewards), dtype=torch.long),
                           gamma=gamma, lam=lam)
    has_actions = mask.sum(dim=1) > 0  # a row without one has nowhere to put a reward, chained or not
    assert not has_actions.all() and torch.equal(links.rewards[has_actions], rewards[has_actions])
    assert (links.next_values == 0).all() and (links.next_advantages == 0).all()
    chained = compute_gae_advantages(links.rewards, values, mask, gamma=gamma, lam=lam, token_kl=kl, kl_coef=0.2,
                                     next_values=links.next_values, next_advantages=links.next_advantages)
    plain = compute_gae_advantages(rewards, values, mask, gamma=gamma, lam=lam, token_kl=kl, kl_coef=0.2)
    assert all(torch.equal(a, b) for a, b in zip(chained, plain))
    chained = compute_reinforce_pp_advantages(links.rewards, mask, gamma=gamma, token_kl=kl, kl_coef=0.2,
                                              next_returns=links.next_advantages)
    assert torch.equal(chained, compute_reinforce_pp_advantages(rewards, mask, gamma=gamma, token_kl=kl, kl_coef=0.2))


def test_chain_refuses_a_repeated_segment_index_and_mismatched_lengths():
    heads = SegmentHeads(*torch.ones(3, 3, dtype=torch.float64))
    rewards = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"rollout 4 has two experiences with the same segment index: \[0, 1, 1\]"):
        chain_segments(heads, rewards, torch.tensor([4, 4, 4]), torch.tensor([1, 0, 1]), gamma=1.0)
    with pytest.raises(ValueError, match="need one reward, segment index and head per experience"):
        chain_segments(heads, rewards[:2], torch.tensor([4, 5, 6]), torch.tensor([0, 0, 0]), gamma=1.0)
    with pytest.raises(ValueError, match="next_returns must be"):
        compute_reinforce_pp_advantages(torch.zeros(2), torch.ones(2, 3), gamma=1.0, next_returns=torch.zeros(3))


# Batch indices of each of 2 ranks: rollouts 7 and 3 have segments on both, 9 both on rank 1.
RANK_SHARES = [[0, 2, 4, 6], [1, 3, 5, 7]]
DISTRIBUTED_CASES = [("reinforce_pp", 0.9, 1.0, True), ("reinforce_pp", 1.0, 1.0, True), ("gae", 0.9, 0.8, True),
                     ("gae", 0.95, 0.9, False)]


def rows_of(per_experience: list[list[float]], micro_batch, own: list[int]) -> torch.Tensor:
    """[batch, seq] the micro-batch's rows of a per-position list of each experience of the batch."""
    width = micro_batch.action_mask.shape[1]
    return torch.tensor([(per_experience[own[index]] + [0.0] * width)[:width] for index in micro_batch.rows],
                        dtype=torch.float64)


def chained_rank(rank, world_size):
    """`set_token_advantages`, the learner's token path, with this rank's share of SEGMENTS in
    micro-batches of at most 16 tokens; per case, each own experience's advantages and returns."""
    # Imported here: molt.trainer.learner brings in the model stack, which the other tests here do not need.
    from molt.trainer.batch import build_micro_batches, count_micro_batches
    from molt.trace.experience import Experience
    from molt.trainer.learner import BatchInfo, set_token_advantages

    values, kl = segment_inputs(seed=13)
    experiences = [Experience(token_ids=[5] * len(mask), action_mask=mask, behavior_logprobs=[0.0] * len(mask),
                              policy_versions=[0 if m else -1 for m in mask], reward=reward, score=reward, group_id=0,
                              rollout_id=rollout, segment_index=segment)
                   for rollout, segment, mask, reward in SEGMENTS]
    own = RANK_SHARES[rank]
    info = BatchInfo(rollout_ids=[r for r, *_ in SEGMENTS], group_ids=[0] * len(SEGMENTS),
                     rewards=[reward for *_, reward in SEGMENTS], own=own,
                     segment_indices=[s for _, s, *_ in SEGMENTS])
    results = []
    for estimator, gamma, lam, whiten_advantages in DISTRIBUTED_CASES:
        mine = [experiences[i] for i in own]
        # One empty micro-batch more than needed: the filler row every rank may get must link to nothing.
        count = count_micro_batches(mine, max_tokens_per_micro_batch=16) + 1
        micro_batches = build_micro_batches(mine, max_tokens_per_micro_batch=16, pad_token_id=0,
                                            num_micro_batches=count)
        for micro_batch in micro_batches:  # as the learner sets them: 0 off the action tokens
            micro_batch.old_values = rows_of(values, micro_batch, own) * micro_batch.action_mask
        token_kls = [rows_of(kl, micro_batch, own) * micro_batch.action_mask for micro_batch in micro_batches]
        set_token_advantages(micro_batches, info, token_kls, estimator=estimator, gamma=gamma, lam=lam,
                             kl_coef=KL_COEF, whiten_advantages=whiten_advantages, group=dist.group.WORLD,
                             device=torch.device("cpu"))
        out = {}
        for micro_batch in micro_batches:
            for row, index in enumerate(micro_batch.rows):
                if index < 0:
                    assert (micro_batch.advantages[row] == 0).all()
                    continue
                length = len(SEGMENTS[own[index]][2])
                returns = None if micro_batch.returns is None else micro_batch.returns[row, :length]
                out[own[index]] = (micro_batch.advantages[row, :length].to(torch.float64), returns,
                                   len(micro_batches))
        results.append(out)
    return results


def test_chained_segments_on_different_ranks_match_the_naive_rollout():
    values, kl = segment_inputs(seed=13)
    per_rank = run_ranks(chained_rank, 2)
    for case, (estimator, gamma, lam, whiten_advantages) in enumerate(DISTRIBUTED_CASES):
        merged = {index: result for rank in per_rank for index, result in rank[case].items()}
        assert sorted(merged) == list(range(len(SEGMENTS)))
        assert max(result[2] for result in merged.values()) > 1  # several micro-batches on a rank
        is_gae = estimator == "gae"
        expected, expected_returns = naive_chained(values if is_gae else [[0.0] * len(v) for v in values], kl,
                                                   gamma=gamma, lam=lam if is_gae else 1.0)
        actions = [(s, t) for s, (_, _, mask, _) in enumerate(SEGMENTS) for t, m in enumerate(mask) if m]
        if whiten_advantages:
            flat = python_whiten([expected[s][t] for s, t in actions])
            expected = [[0.0] * len(row) for row in expected]
            for (s, t), value in zip(actions, flat):
                expected[s][t] = value
        for index, (advantages, returns, _) in merged.items():
            # The micro-batch keeps its advantages in the action mask's float32.
            torch.testing.assert_close(advantages, torch.tensor(expected[index], dtype=torch.float64),
                                       rtol=1e-6, atol=1e-6, msg=lambda m: f"{estimator} experience {index}: {m}")
            if is_gae:
                torch.testing.assert_close(returns, torch.tensor(expected_returns[index], dtype=torch.float64),
                                           rtol=1e-12, atol=1e-12)
        if is_gae and not whiten_advantages:
            # Rollout 8 has one segment: exactly what the unchained estimator gives its row.
            mask = torch.tensor([SEGMENTS[4][2]], dtype=torch.float32)
            alone, _ = compute_gae_advantages(torch.tensor([SEGMENTS[4][3]], dtype=torch.float64),
                                              torch.tensor([values[4]], dtype=torch.float64) * mask, mask,
                                              gamma=gamma, lam=lam, token_kl=torch.tensor([kl[4]]).double() * mask,
                                              kl_coef=KL_COEF, whiten_advantages=False)
            assert torch.equal(merged[4][0], alone[0].float().double())
