import math

import pytest
import torch

from molt.objectives.kl import (
                                AdaptiveKLController,
                                compute_kl_estimate,
                                compute_kl_loss,
                                compute_kl_reward_penalty,
                                )

# logprobs - ref_logprobs = 0.5, -1, 0
LOGPROBS = torch.tensor([-1.0, -2.0, -0.3], dtype=torch.float64)
REF_LOGPROBS = torch.tensor([-1.5, -1.0, -0.3], dtype=torch.float64)
HAND_VALUES = {
    "k1": [0.5, -1.0, 0.0],
    "k2": [0.125, 0.5, 0.0],
    "k3": [math.exp(-0.5) - 0.5, math.e - 2.0, 0.0],  # exp(-d) - 1 + d
}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_hand_numbers(estimator):
    values = compute_kl_estimate(LOGPROBS, REF_LOGPROBS, estimator=estimator)
    torch.testing.assert_close(values, torch.tensor(HAND_VALUES[estimator], dtype=torch.float64))


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_k2_and_k3_are_nonnegative_and_finite_for_extreme_gaps(estimator):
    generator = torch.Generator().manual_seed(0)
    logprobs = -5 * torch.rand(1000, generator=generator)
    ref = -5 * torch.rand(1000, generator=generator)
    logprobs[:4] = torch.tensor([0.0, -1e4, 0.0, -1e4])
    ref[:4] = torch.tensor([-1e4, 0.0, 0.0, -1e4])
    values = compute_kl_estimate(logprobs, ref, estimator=estimator)
    assert torch.isfinite(values).all()
    assert (values >= 0).all()
    assert (values[4:] > 0).any()


def test_k1_and_k3_average_to_the_exact_kl():
    # Samples from p = softmax(current), KL(p || q) computed exactly: unbiased estimators agree.
    generator = torch.Generator().manual_seed(1)
    current = torch.log_softmax(torch.randn(5, generator=generator, dtype=torch.float64), dim=0)
    ref = torch.log_softmax(torch.randn(5, generator=generator, dtype=torch.float64), dim=0)
    exact = (current.exp() * (current - ref)).sum()
    probs = current.exp()
    for estimator in ("k1", "k3"):
        expectation = (probs * compute_kl_estimate(current, ref, estimator=estimator)).sum()
        torch.testing.assert_close(expectation, exact, rtol=1e-12, atol=1e-12)


def test_unknown_estimator_is_refused():
    with pytest.raises(ValueError, match="'k4'"):
        compute_kl_estimate(LOGPROBS, REF_LOGPROBS, estimator="k4")


@pytest.mark.parametrize(
    ("estimator", "gradient"),
    [
        ("k1", [1.0, 1.0]),  # d k1 / d logp = 1
        ("k2", [0.5, -1.0]),  # d k2 / d logp = d
        ("k3", [1 - math.exp(-0.5), 1 - math.e]),  # d k3 / d logp = 1 - exp(-d)
    ],
)
def test_kl_loss_is_masked_sum_over_denominator(estimator, gradient):
    logprobs = LOGPROBS.clone().requires_grad_()
    mask = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    loss, stats = compute_kl_loss(
        logprobs, REF_LOGPROBS, mask, estimator=estimator, coef=0.2, denominator=4.0
    )
    expected_sum = sum(HAND_VALUES[estimator][:2])
    assert math.isclose(loss.item(), 0.2 * expected_sum / 4.0, rel_tol=1e-12)
    assert math.isclose(stats["ref_kl_sum"].item(), expected_sum, rel_tol=1e-12)
    loss.backward()
    expected_grad = torch.tensor([*gradient, 0.0], dtype=torch.float64) * 0.2 / 4.0
    torch.testing.assert_close(logprobs.grad, expected_grad, rtol=1e-12, atol=1e-15)


def test_kl_reward_penalty_is_masked_and_carries_no_gradient():
    logprobs = LOGPROBS.clone().requires_grad_()
    mask = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)
    penalty = compute_kl_reward_penalty(logprobs, REF_LOGPROBS, mask, estimator="k1", coef=0.05)
    torch.testing.assert_close(penalty, torch.tensor([0.0, -0.05, 0.0], dtype=torch.float64))
    assert not penalty.requires_grad


def test_adaptive_controller_follows_ziegler_update():
    controller = AdaptiveKLController(coef=0.1, target_kl=6.0, horizon=10000)
    # 9 / 6 - 1 = 0.5, clipped to 0.2: coef * (1 + 0.2 * 512 / 10000)
    assert math.isclose(controller.update(9.0, 512), 0.1 * 1.01024, rel_tol=1e-12)
    # 5 / 6 - 1 = -1/6, inside the clip
    assert math.isclose(controller.update(5.0, 512), 0.101024 * (1 - 0.0512 / 6), rel_tol=1e-12)
    # 0 / 6 - 1 = -1, clipped to -0.2
    assert math.isclose(
        controller.update(0.0, 512), 0.101024 * (1 - 0.0512 / 6) * 0.98976, rel_tol=1e-12
    )
    assert controller.coef == controller.update(6.0, 512), "on target the coefficient stays"


@pytest.mark.parametrize(
    "fields",
    [
        {"coef": -0.1, "target_kl": 6.0, "horizon": 10000},
        {"coef": 0.1, "target_kl": 0.0, "horizon": 10000},
        {"coef": 0.1, "target_kl": 6.0, "horizon": 0},
    ],
)
def test_adaptive_controller_refuses_bad_fields(fields):
    with pytest.raises(ValueError, match="AdaptiveKLController"):
        AdaptiveKLController(**fields)


def naive_clamped_k3(d: float, clamp: float) -> tuple[float, float]:
    """(value, d value / d logp) of k3 capped at `clamp`, one token at a time; d already within +-20."""
    value = math.exp(-d) - 1 + d
    if value > clamp:
        return clamp, 0.0
    return value, 1 - math.exp(-d)


def test_k3_clamp_matches_a_naive_loop_in_value_and_gradient():
    generator = torch.Generator().manual_seed(2)
    logprobs = (-6 * torch.rand(200, generator=generator, dtype=torch.float64)).requires_grad_()
    ref = -6 * torch.rand(200, generator=generator, dtype=torch.float64)
    values = compute_kl_estimate(logprobs, ref, estimator="k3", clamp=2.0)
    values.sum().backward()
    expected = [naive_clamped_k3(d, 2.0) for d in (logprobs - ref).tolist()]
    torch.testing.assert_close(values.detach(), torch.tensor([v for v, _ in expected], dtype=torch.float64))
    torch.testing.assert_close(logprobs.grad, torch.tensor([g for _, g in expected], dtype=torch.float64))
    capped = sum(v == 2.0 for v, _ in expected)
    assert 0 < capped < 200, "the draw must hold tokens on both sides of the cap"


def test_a_huge_log_ratio_gives_a_bounded_k3_value_and_gradient():
    # logp far below the reference (d = -1e4, clamped to -20): k3 = exp(20) - 21 ~ 4.9e8 uncapped.
    logprobs = torch.tensor([-1e4, 0.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([0.0, -1e4, -1.0], dtype=torch.float64)
    mask = torch.ones(3, dtype=torch.float64)
    uncapped, _ = compute_kl_loss(logprobs, ref, mask, estimator="k3", coef=1.0, denominator=1.0)
    assert uncapped.item() > 4e8
    loss, stats = compute_kl_loss(logprobs, ref, mask, estimator="k3", coef=1.0, denominator=1.0, clamp=10.0)
    loss.backward()
    # Both extreme tokens sit at the cap (the second: 20 - 1 + exp(-20) = 19 > 10), the third at 0.
    assert loss.item() == 20.0 and stats["ref_kl_sum"].item() == 20.0
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad.abs().max().item() == 0.0
    # Below the cap the gradient is 1 - exp(-d), largest in size where k3 meets the cap: d ~ -2.63.
    d = torch.linspace(-20, 20, 4001, dtype=torch.float64, requires_grad=True)
    compute_kl_estimate(d, torch.zeros_like(d), estimator="k3", clamp=10.0).sum().backward()
    assert d.grad.abs().max().item() < 14.0


@pytest.mark.parametrize("estimator", ["k1", "k2"])
def test_the_clamp_leaves_k1_and_k2_alone(estimator):
    logprobs = torch.tensor([-1e4, 0.0, -1.0], dtype=torch.float64)
    ref = torch.tensor([0.0, -1e4, -1.0], dtype=torch.float64)
    torch.testing.assert_close(compute_kl_estimate(logprobs, ref, estimator=estimator, clamp=1.0),
                               compute_kl_estimate(logprobs, ref, estimator=estimator))


def test_the_clamp_reaches_the_reward_penalty():
    logprobs = torch.tensor([-1e4, -1.0, -0.3], dtype=torch.float64)
    ref = torch.tensor([0.0, -2.0, -0.3], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    penalty = compute_kl_reward_penalty(logprobs, ref, mask, estimator="k3", coef=0.5, clamp=10.0)
    expected = [0.5 * naive_clamped_k3(-20.0, 10.0)[0], 0.5 * naive_clamped_k3(1.0, 10.0)[0], 0.0]
    torch.testing.assert_close(penalty, torch.tensor(expected, dtype=torch.float64))
