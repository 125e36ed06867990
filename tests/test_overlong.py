"""DAPO's overlong handling: the soft overlong penalty and its response lengths against naive loops,
and in the learner, the penalty counted once per rollout across ranks and overlong filtering."""

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from test_actor import PAD, TEMPERATURE, make_actor
from test_learner import grouped_experiences, learner_config, weights, windows_of

from molt.distributed.parallelize import TrainerMesh
from molt.objectives.overlong import compute_longest_response, compute_overlong_penalty
from molt.trace.experience import Experience
from molt.trainer.batch import build_micro_batches
from molt.trainer.learner import BatchInfo, Learner

CPU = torch.device("cpu")


def naive_longest_run(mask: list[int]) -> int:
    longest = run = 0
    for is_action in mask:
        run = run + 1 if is_action else 0
        longest = max(longest, run)
    return longest


def naive_penalty(length: int, max_tokens: int, buffer: int, factor: float) -> float:
    """DAPO eq. 13, case by case."""
    if buffer == 0 or length <= max_tokens - buffer:
        return 0.0
    if length <= max_tokens:
        return ((max_tokens - buffer) - length) / buffer * factor
    return -factor


def test_longest_response_matches_a_loop():
    rng = random.Random(0)
    masks = [[int(rng.random() < p) for _ in range(37)] for p in (0.0, 0.3, 0.7, 0.95, 1.0) for _ in range(6)]
    got = compute_longest_response(torch.tensor(masks, dtype=torch.float32))
    assert got.tolist() == [naive_longest_run(mask) for mask in masks]
    assert compute_longest_response(torch.zeros(3, 0)).tolist() == [0, 0, 0]


@pytest.mark.parametrize(("max_tokens", "buffer", "factor"), [(10, 4, 1.0), (10, 4, 0.5), (16, 16, 2.0),
                                                              (8, 1, 1.0), (12, 0, 1.0)])
def test_overlong_penalty_matches_dapo_case_by_case(max_tokens, buffer, factor):
    lengths = list(range(0, max_tokens + 6))
    got = compute_overlong_penalty(torch.tensor(lengths), max_response_tokens=max_tokens, buffer_tokens=buffer,
                                   factor=factor)
    expected = torch.tensor([naive_penalty(n, max_tokens, buffer, factor) for n in lengths], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)
    if buffer:
        assert got[max_tokens].item() == -factor and got[max_tokens - buffer].item() == 0.0


@pytest.mark.parametrize("fields", [dict(buffer_tokens=11), dict(buffer_tokens=-1), dict(factor=-0.5)])
def test_overlong_penalty_refuses_bad_settings(fields):
    with pytest.raises(ValueError, match="buffer_tokens <= max_response_tokens and factor >= 0"):
        compute_overlong_penalty(torch.tensor([3]), **{"max_response_tokens": 10, "buffer_tokens": 4, **fields})


# Rollouts of two groups of 4; each segment is a list of action runs, with context around them.
# max_response_tokens 10, buffer 4, factor 0.5: a longest response of 7..10 costs 0.125..0.5.
ROLLOUTS = [  # (group, reward, segments)
    (0, 1.0, [[3, 5]]),
    (0, 0.0, [[7]]),
    (0, 1.0, [[2, 9], [4]]),  # longest 9, in its first segment: both segments pay for it
    (0, 0.0, [[10]]),
    (1, 1.0, [[12]]),  # beyond the limit (an agent's own cap): the full penalty
    (1, 1.0, [[6]]),  # exactly L_max - L_cache: none
    (1, 0.0, [[1, 1], [8]]),
    (1, 1.0, [[1]]),
]
MAX_TOKENS, BUFFER, FACTOR = 10, 4, 0.5


def penalty_batch() -> list[Experience]:
    rng = random.Random(3)
    experiences = []
    for rollout_id, (group, reward, segments) in enumerate(ROLLOUTS):
        for index, runs in enumerate(segments):
            mask = [0, 0]
            for run in runs:
                mask += [1] * run + [0] * rng.randint(1, 3)
            experiences.append(Experience(
                token_ids=[rng.randint(1, 63) for _ in mask], action_mask=mask,
                behavior_logprobs=[-4.0 * a for a in mask], policy_versions=[0 if a else -1 for a in mask],
                reward=reward, score=reward, group_id=group, rollout_id=rollout_id, segment_index=index))
    return experiences


def penalty_rank(rank, world_size, model_path):
    """Every other experience on each rank, so rollout 2's segments sit on different ranks."""
    cfg = learner_config(model_path)
    cfg.rollout.max_response_tokens = MAX_TOKENS
    cfg.algorithm.overlong_buffer_tokens, cfg.algorithm.overlong_penalty_factor = BUFFER, FACTOR
    learner = Learner(cfg, make_actor(model_path, dist.group.WORLD, torch.float64, lr=1e-2),
                      mesh=TrainerMesh.from_group(dist.group.WORLD, "cpu"), device=CPU)
    experiences = penalty_batch()
    own = [i for i in range(len(experiences)) if i % world_size == rank]
    info = BatchInfo(rollout_ids=[e.rollout_id for e in experiences], group_ids=[e.group_id for e in experiences],
                     rewards=[e.reward for e in experiences], own=own)
    micro_batches = build_micro_batches([experiences[i] for i in own], max_tokens_per_micro_batch=10_000,
                                        pad_token_id=PAD, temperature=TEMPERATURE)
    shaped, truncated, metrics = learner._shape_overlong(micro_batches, info)
    learner._set_advantages(micro_batches, shaped)
    advantages, rewards = {}, {}
    for micro_batch in micro_batches:
        for row, index in enumerate(micro_batch.rows):
            if index >= 0:
                values = micro_batch.advantages[row][micro_batch.action_mask[row] > 0].unique()
                assert len(values) == 1
                advantages[own[index]], rewards[own[index]] = values.item(), micro_batch.rewards[row].item()
    return {"advantages": advantages, "rewards": rewards, "info_rewards": shaped.rewards, "truncated": truncated,
            "metrics": metrics}


def test_the_penalty_is_each_rollouts_once_across_ranks_and_enters_the_advantages(model_path):
    experiences = penalty_batch()
    longest = {}
    for e in experiences:  # a rollout's length: its longest response over all its segments
        longest[e.rollout_id] = max(longest.get(e.rollout_id, 0), naive_longest_run(e.action_mask))
    assert longest == {0: 5, 1: 7, 2: 9, 3: 10, 4: 12, 5: 6, 6: 8, 7: 1}
    penalty = {r: naive_penalty(n, MAX_TOKENS, BUFFER, FACTOR) for r, n in longest.items()}
    shaped = {r: reward + penalty[r] for r, (_, reward, _) in enumerate(ROLLOUTS)}
    expected_advantage = {}
    for group in (0, 1):  # GRPO, each rollout once: (r - mean) / (unbiased std + 1e-6)
        members = [r for r, (g, _, _) in enumerate(ROLLOUTS) if g == group]
        mean = sum(shaped[r] for r in members) / len(members)
        std = (sum((shaped[r] - mean) ** 2 for r in members) / (len(members) - 1)) ** 0.5
        for r in members:
            expected_advantage[r] = (shaped[r] - mean) / (std + 1e-6)

    results = run_ranks(penalty_rank, 2, model_path)
    for result in results:
        assert result["info_rewards"] == pytest.approx([shaped[e.rollout_id] for e in experiences], abs=1e-12)
        assert result["truncated"] == set()
        metrics = result["metrics"]
        assert metrics["overlong_penalty_mean"] == pytest.approx(sum(penalty.values()) / len(penalty), abs=1e-12)
        assert metrics["overlong_penalized_share"] == 5 / 8
    seen = {}
    for result in results:
        seen.update(result["advantages"])
        for index, reward in result["rewards"].items():  # what the token estimators read
            assert reward == pytest.approx(shaped[experiences[index].rollout_id], abs=1e-12)
    assert sorted(seen) == list(range(len(experiences)))
    for index, advantage in seen.items():
        assert advantage == pytest.approx(expected_advantage[experiences[index].rollout_id], abs=1e-5)
    assert penalty[2] == -0.375 and seen[2] == seen[3], "both segments of rollout 2 have its advantage"


TRUNCATED = (1, 6)  # experiences (single-segment rollouts) cut at the length limit


def filter_rank(rank, world_size, model_path):
    """One step with overlong filtering; the same step, filter off, with the truncated experiences'
    action tokens removed by hand (their rewards still in the batch); and the step unfiltered."""
    experiences, info = grouped_experiences(seed=5, count=8)
    cut = [dataclasses.replace(e, truncated=i in TRUNCATED) for i, e in enumerate(experiences)]
    by_hand = [dataclasses.replace(e, action_mask=[0] * e.num_tokens, behavior_logprobs=[0.0] * e.num_tokens,
                                   policy_versions=[-1] * e.num_tokens) if i in TRUNCATED else e
               for i, e in enumerate(experiences)]
    results = {}
    for name, batch, overlong_filter in (("filtered", cut, True), ("by_hand", by_hand, False),
                                         ("unfiltered", cut, False)):
        cfg = learner_config(model_path, learning_rate=1e-2)
        cfg.algorithm.overlong_filter = overlong_filter
        actor = make_actor(model_path, dist.group.WORLD, torch.float64, lr=1e-2)
        learner = Learner(cfg, actor, mesh=TrainerMesh.from_group(dist.group.WORLD, "cpu"), device=CPU)
        metrics = learner.train_step(windows_of(batch, 1), info)
        results[name] = {"weights": weights(actor.model), "metrics": metrics}
    return results


def test_overlong_filtering_zeroes_exactly_the_truncated_samples_loss(model_path):
    results = run_ranks(filter_rank, 1, model_path)[0]
    filtered, by_hand, unfiltered = results["filtered"], results["by_hand"], results["unfiltered"]
    experiences, info = grouped_experiences(seed=5, count=8)
    kept_tokens = sum(e.num_action_tokens for i, e in enumerate(experiences) if i not in TRUNCATED)
    assert filtered["metrics"]["num_action_tokens"] == kept_tokens == by_hand["metrics"]["num_action_tokens"]
    assert filtered["metrics"]["overlong_truncated_share"] == 2 / 8
    assert filtered["metrics"]["loss"] == by_hand["metrics"]["loss"]
    for name, tensor in filtered["weights"].items():
        assert torch.equal(tensor, by_hand["weights"][name]), name
    assert unfiltered["metrics"]["num_action_tokens"] == sum(e.num_action_tokens for e in experiences)
    assert any(not torch.equal(tensor, unfiltered["weights"][name]) for name, tensor in filtered["weights"].items())
