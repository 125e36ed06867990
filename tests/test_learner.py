"""A training step on the trainer ranks: PPO mini-batches and epochs (decoupled ratio against the
proximal policy), sequence packing against padding, and the non-finite guard."""

import math

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from test_actor import PAD, TEMPERATURE, full_gradients, make_actor, make_experiences, with_turn_temperatures

from molt.config import MoltConfig
from molt.distributed.parallelize import ShardingPlan, TrainerMesh
from molt.trainer.actor import PolicyLoss
from molt.trainer.batch import build_micro_batches, build_windows, count_window_micro_batches
from molt.trainer.critic import Critic, build_value_model
from molt.trainer.learner import BatchInfo, Learner
from molt.trainer.optimizer import OptimizerSettings

CPU = torch.device("cpu")
DECOUPLED = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.2, importance=("token", "trunc", 0.0, 2.0))


def learner_config(model_path, **train) -> MoltConfig:
    cfg = MoltConfig()
    cfg.model.path = model_path
    cfg.rollout.temperature = TEMPERATURE
    cfg.algorithm.importance_level, cfg.algorithm.importance_mode = "token", "trunc"
    for name, value in train.items():
        setattr(cfg.train, name, value)
    return cfg


def grouped_experiences(seed: int, count: int):
    """Experiences in groups of 4 with varied rewards, so GRPO advantages are nonzero."""
    experiences, _ = make_experiences(seed=seed, count=count)
    for index, experience in enumerate(experiences):
        experience.group_id, experience.reward = index // 4, float(index % 3)
    info = BatchInfo(rollout_ids=[e.rollout_id for e in experiences], group_ids=[e.group_id for e in experiences],
                     rewards=[e.reward for e in experiences], own=list(range(len(experiences))))
    return experiences, info


def windows_of(experiences, num_windows: int, layout: str = "padded", budget: int = 10_000):
    counts = count_window_micro_batches(experiences, num_windows=num_windows, max_tokens_per_micro_batch=budget,
                                       layout=layout)
    return build_windows(experiences, num_windows=num_windows, micro_batch_counts=[max(1, c) for c in counts],
                         max_tokens_per_micro_batch=budget, pad_token_id=PAD, layout=layout,
                         temperature=TEMPERATURE)


def weights(model) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def one_window_rank(rank, world_size, model_path):
    """Two steps through the Learner with 1 mini-batch and 1 epoch, and the same two steps as one
    `train_window` each with the advantages set as before windows existed: bit for bit."""
    cfg = learner_config(model_path, learning_rate=1e-2)
    steps = [grouped_experiences(seed, 8) for seed in (1, 2)]
    actor = make_actor(model_path, dist.group.WORLD, torch.float64, lr=1e-2)
    learner = Learner(cfg, actor, mesh=TrainerMesh.from_group(dist.group.WORLD, "cpu"), device=CPU)
    for experiences, info in steps:
        metrics = learner.train_step(windows_of(experiences, 1), info)
    windowed = weights(actor.model)

    direct = make_actor(model_path, dist.group.WORLD, torch.float64, lr=1e-2)
    plain = Learner(cfg, direct, mesh=TrainerMesh.from_group(dist.group.WORLD, "cpu"), device=CPU)
    for experiences, info in steps:
        micro_batches = build_micro_batches(experiences, max_tokens_per_micro_batch=10_000, pad_token_id=PAD,
                                            temperature=TEMPERATURE)
        plain._set_advantages(micro_batches, info)
        direct.train_window(micro_batches, plain.policy_loss())
    return {"windowed": windowed, "direct": weights(direct.model), "optimizer_steps": metrics["optimizer_steps"],
            "ratio_mean": metrics["ratio_mean"]}


def test_one_mini_batch_and_one_epoch_train_exactly_as_one_window(model_path):
    result = run_ranks(one_window_rank, 1, model_path)[0]
    assert result["optimizer_steps"] == 1.0 and result["ratio_mean"] == 1.0  # the current policy is the proximal one
    for name, tensor in result["windowed"].items():
        assert torch.equal(tensor, result["direct"][name]), name


def proximal_rank(rank, world_size, model_path):
    """Two windows against proximal log-probs recorded before the first update."""
    actor = make_actor(model_path, dist.group.WORLD, torch.float64, lr=3e-2)
    experiences, advantages = make_experiences(seed=3, count=8)
    first, second = (build_micro_batches(experiences[part], advantages[part], max_tokens_per_micro_batch=10_000,
                                         pad_token_id=PAD, temperature=TEMPERATURE)
                     for part in (slice(0, 4), slice(4, 8)))
    for micro_batch in first + second:
        micro_batch.proximal_logprobs = actor.score(micro_batch) * micro_batch.action_mask
    return [actor.train_window(window, DECOUPLED).totals for window in (first, second)]


def test_the_second_window_ratio_moves_off_one_and_clips(model_path):
    """Decoupled PPO: the first window's ratio to the proximal policy is exactly 1 (nothing clipped);
    after its update the second window's is not, and the clip fires."""
    first, second = run_ranks(proximal_rank, 1, model_path)[0]
    assert first["ratio_sum"] == first["action_tokens"] and first["clipped_tokens"] == 0
    assert abs(second["ratio_sum"] / second["action_tokens"] - 1) > 1e-3
    assert second["clipped_tokens"] > 0


def epochs_rank(rank, world_size, model_path):
    cfg = learner_config(model_path, learning_rate=3e-2, mini_batches_per_step=2, ppo_epochs=2)
    actor = make_actor(model_path, dist.group.WORLD, torch.float64, lr=3e-2)
    learner = Learner(cfg, actor, mesh=TrainerMesh.from_group(dist.group.WORLD, "cpu"), device=CPU)
    experiences, info = grouped_experiences(seed=4, count=8)
    windows = windows_of(experiences, 2)
    metrics = learner.train_step(windows, info)
    return {"metrics": metrics, "window_sizes": [sum(len(m.rows) for m in w) for w in windows]}


def test_mini_batches_and_epochs_take_one_optimizer_step_each(model_path):
    result = run_ranks(epochs_rank, 1, model_path)[0]
    metrics = result["metrics"]
    assert result["window_sizes"] == [4, 4]
    assert metrics["optimizer_steps"] == 4.0 and metrics["skipped_nonfinite"] == 0.0
    # Against the current policy the ratio would be 1 everywhere; the proximal pass makes it move.
    assert metrics["clip_fraction"] > 0 and metrics["ratio_mean"] != 1.0
    assert metrics["num_action_tokens"] == sum(e.num_action_tokens for e in grouped_experiences(4, 8)[0])


def packing_rank(rank, world_size, model_path, layout):
    """Window gradients and entropy-bearing loss terms packed and padded (fp64), and critic values."""
    loss = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, entropy_coef=0.01,
                      importance=("token", "mask", 0.9, 1.1))
    experiences, advantages = make_experiences(seed=6, count=9)
    experiences = with_turn_temperatures(experiences)  # packed rows must keep each token's temperature too
    results = {}
    for name in ("padded", layout):
        actor = make_actor(model_path, dist.group.WORLD, torch.float64, lr=1e-3)
        # 160 tokens: the padded layout needs two micro-batches; packed, 18 + 18 and 16 + 11 share rows.
        micro_batches = build_micro_batches(experiences, advantages, max_tokens_per_micro_batch=160,
                                            pad_token_id=PAD, layout=name, temperature=TEMPERATURE)
        sums = actor.compute_window_gradients(micro_batches, loss)
        logprobs = [actor.score(m) for m in micro_batches]
        rows = [(row, m, lp) for m, lp in zip(micro_batches, logprobs) for row in range(len(m.rows))]
        per_experience = {m.rows[row]: lp[row, :experiences[m.rows[row]].num_tokens] for row, m, lp in rows}
        critic = Critic(build_value_model(model_path, mesh=TrainerMesh.from_group(dist.group.WORLD, "cpu"),
                                          device=CPU, plan=ShardingPlan(param_dtype=torch.float64)),
                        group=dist.group.WORLD, device=CPU, optimizer=OptimizerSettings(lr=1e-3))
        with torch.no_grad():
            for parameter in critic.model.value_head.parameters():
                parameter.fill_(0.01)
        values = {m.rows[row]: critic.compute_values(m)[row, :experiences[m.rows[row]].num_tokens]
                  for m in micro_batches for row in range(len(m.rows))}
        shared = max((int(((m.position_ids == 0) & (m.packed_index.view(m.position_ids.shape) >= 0)).sum(dim=1).max())
                      for m in micro_batches if m.position_ids is not None), default=0)  # most sequences in a packed row
        results[name] = {"grads": full_gradients(actor.model), "sums": {k: v.item() for k, v in sums.items()},
                         "logprobs": per_experience, "values": values, "num_micro_batches": len(micro_batches),
                         "model_tokens": sum(m.num_model_tokens for m in micro_batches), "shared_row": shared}
    return results


@pytest.mark.parametrize("layout", ["rows", "row"])
def test_packed_log_probs_gradients_and_values_equal_padded(model_path, layout):
    results = run_ranks(packing_rank, 1, model_path, layout)[0]
    padded, packed = results["padded"], results[layout]
    assert packed["shared_row"] >= 2, "some packed row must hold several sequences"
    assert packed["num_micro_batches"] <= padded["num_micro_batches"]
    assert packed["model_tokens"] < padded["model_tokens"]  # less padding computed
    for index, logprobs in padded["logprobs"].items():
        torch.testing.assert_close(packed["logprobs"][index], logprobs, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(packed["values"][index], padded["values"][index], rtol=1e-10, atol=1e-12)
    for name, value in padded["sums"].items():
        assert math.isclose(packed["sums"][name], value, rel_tol=1e-9, abs_tol=1e-12), name
    assert padded["sums"]["rejected_tokens"] > 0 and padded["sums"]["entropy_sum"] > 0
    for name, grad in padded["grads"].items():
        torch.testing.assert_close(packed["grads"][name], grad, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}\n{m}")


def nonfinite_rank(rank, world_size, model_path):
    """A NaN behaviour log-prob on rank 1 only: neither rank steps; the next clean window does."""
    actor = make_actor(model_path, dist.group.WORLD, torch.float64, lr=1e-2)
    experiences, advantages = make_experiences(seed=rank, count=3)
    if rank == 1:
        action = experiences[0].action_mask.index(1)
        experiences[0].behavior_logprobs[action] = float("nan")
    micro_batches = build_micro_batches(experiences, advantages, max_tokens_per_micro_batch=10_000, pad_token_id=PAD,
                                        temperature=TEMPERATURE)
    before = weights(actor.model)
    poisoned = actor.train_window(micro_batches, DECOUPLED)
    untouched = all(torch.equal(t, before[n]) for n, t in weights(actor.model).items())
    no_grads = all(p.grad is None for p in actor.model.parameters())
    clean, _ = make_experiences(seed=10 + rank, count=3)
    clean_batches = build_micro_batches(clean, [1.0, -1.0, 0.5], max_tokens_per_micro_batch=10_000, pad_token_id=PAD,
                                        temperature=TEMPERATURE)
    recovered = actor.train_window(clean_batches, DECOUPLED)
    moved = any(not torch.equal(t, before[n]) for n, t in weights(actor.model).items())
    return {"poisoned": poisoned.stepped, "loss": poisoned.totals["loss"], "untouched": untouched,
            "no_grads": no_grads, "recovered": recovered.stepped, "moved": moved}


def test_a_nonfinite_loss_on_one_rank_skips_the_update_on_every_rank(model_path):
    results = run_ranks(nonfinite_rank, 2, model_path)
    for result in results:
        assert not result["poisoned"] and math.isnan(result["loss"])
        assert result["untouched"] and result["no_grads"]
        assert result["recovered"] and result["moved"]
