import math

import torch

from molt.objectives import compute_grpo_advantages, compute_ppo_clip_loss


def naive_grpo(rewards: list[float], group_ids: list[int], eps: float) -> list[float]:
    out = []
    for reward, group in zip(rewards, group_ids):
        members = [r for r, g in zip(rewards, group_ids) if g == group]
        mean = sum(members) / len(members)
        if len(members) == 1 or all(m == members[0] for m in members):
            out.append(0.0)
            continue
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
        out.append((reward - mean) / (std + eps))
    return out


def test_grpo_matches_naive_loop():
    generator = torch.Generator().manual_seed(0)
    group_ids = torch.tensor([7, 3, 7, 3, 7, 11, 3, 7, 42, 42, 42, 5], dtype=torch.long)
    rewards = torch.randn(len(group_ids), generator=generator, dtype=torch.float64)
    rewards[8:11] = 0.1  # constant group: exactly zero
    advantages = compute_grpo_advantages(rewards, group_ids, eps=1e-6)
    expected = naive_grpo(rewards.tolist(), group_ids.tolist(), 1e-6)
    expected = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, rtol=1e-12, atol=1e-12)


def test_grpo_constant_and_singleton_groups_are_exactly_zero():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 1.0, 0.0], dtype=torch.float32)
    group_ids = torch.tensor([0, 0, 0, 1, 2, 2])
    advantages = compute_grpo_advantages(rewards, group_ids)
    assert advantages[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert advantages.dtype == torch.float32
    # Two members at 1 and 0: mean 0.5, unbiased std sqrt(0.5).
    torch.testing.assert_close(advantages[4:], torch.tensor([0.5, -0.5]) / (math.sqrt(0.5) + 1e-6))


def naive_ppo_clip(logprobs, behavior, advantages, mask, low, high, denominator):
    total, clipped_count = 0.0, 0
    for lp, blp, adv, m in zip(logprobs, behavior, advantages, mask):
        if not m:
            continue
        ratio = math.exp(lp - blp)
        unclipped = ratio * adv
        clipped = min(max(ratio, 1 - low), 1 + high) * adv
        total += -min(unclipped, clipped)
        clipped_count += clipped < unclipped
    return total / denominator, clipped_count


def test_ppo_clip_matches_naive_loop():
    generator = torch.Generator().manual_seed(1)
    shape = (3, 17)
    logprobs = -torch.rand(shape, generator=generator, dtype=torch.float64) * 3
    behavior = logprobs + 0.4 * torch.randn(shape, generator=generator, dtype=torch.float64)
    advantages = torch.randn(shape, generator=generator, dtype=torch.float64)
    mask = (torch.rand(shape, generator=generator) < 0.6).to(torch.float64)
    loss, stats = compute_ppo_clip_loss(
        logprobs, behavior, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.28, denominator=40.0
    )
    expected, clipped = naive_ppo_clip(
        logprobs.flatten().tolist(), behavior.flatten().tolist(), advantages.flatten().tolist(),
        mask.flatten().tolist(), 0.2, 0.28, 40.0,
    )
    assert math.isclose(loss.item(), expected, rel_tol=1e-12)
    assert clipped > 0, "the inputs should exercise the clip"
    assert stats["clipped_tokens"].item() == clipped
    assert stats["action_tokens"].item() == mask.sum().item()
    ratio = torch.exp(logprobs - behavior)
    assert math.isclose(stats["ratio_sum"].item(), (ratio * mask).sum().item(), rel_tol=1e-12)
    k3 = (ratio - 1) - (logprobs - behavior)
    assert math.isclose(stats["approx_kl_sum"].item(), (k3 * mask).sum().item(), rel_tol=1e-12)


def test_ppo_clip_gradient_matches_unclipped_tokens_only():
    generator = torch.Generator().manual_seed(2)
    logprobs = (-torch.rand(50, generator=generator, dtype=torch.float64)).requires_grad_()
    behavior = logprobs.detach() + 0.5 * torch.randn(50, generator=generator, dtype=torch.float64)
    advantages = torch.randn(50, generator=generator, dtype=torch.float64)
    mask = torch.ones(50, dtype=torch.float64)
    mask[::5] = 0
    loss, _ = compute_ppo_clip_loss(
        logprobs, behavior, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.2, denominator=10.0
    )
    loss.backward()
    ratio = torch.exp(logprobs.detach() - behavior)
    inside = ((ratio * advantages) <= (ratio.clamp(0.8, 1.2) * advantages))
    zeros = torch.zeros(50, dtype=torch.float64)
    expected = torch.where(inside & (mask > 0), -advantages * ratio / 10.0, zeros)
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-12, atol=1e-15)


def test_ppo_clip_finite_for_extreme_logprob_gaps():
    logprobs = torch.tensor([0.0, -1e4, -200.0, 0.0, -80.0], requires_grad=True)
    behavior = torch.tensor([-1e4, 0.0, 0.0, -300.0, -1.0])
    advantages = torch.tensor([1.0, -1.0, 2.0, -3.0, -1.0])
    mask = torch.ones(5)
    loss, stats = compute_ppo_clip_loss(
        logprobs, behavior, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.28, denominator=5
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logprobs.grad).all()
    assert all(torch.isfinite(value) for value in stats.values())


def test_ppo_clip_ignores_masked_tokens_even_when_nan():
    logprobs = torch.tensor([[-1.0, float("nan")]])
    behavior = torch.tensor([[-1.0, 0.0]])
    loss, stats = compute_ppo_clip_loss(
        logprobs, behavior, torch.tensor([[2.0, 1.0]]), torch.tensor([[1.0, 0.0]]),
        clip_eps_low=0.2, clip_eps_high=0.2, denominator=1,
    )
    assert loss.item() == -2.0
    assert stats["action_tokens"].item() == 1
