"""RELIABILITY case 19: a trainer rank given no experience (fewer experiences than ranks, or a step
whose groups were all filtered) runs the step's collectives with the others, on real gloo ranks;
with one optimizer window a step, the step trains exactly what one rank trains on the whole batch."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from test_actor import PAD, TEMPERATURE, make_actor
from test_learner import grouped_experiences, learner_config, weights

from molt.distributed.parallelize import TrainerMesh
from molt.trainer.batch import build_windows, share_step_batch
from molt.trainer.learner import BatchInfo, Learner

CPU = torch.device("cpu")
BUDGET = 10_000  # tokens per micro-batch
# 2 experiences of one group (rewards 0 and 1: nonzero advantages): with 3 ranks, one rank gets
# none; then a step whose groups were all filtered; then a full step, whose collectives must still
# line up with every rank's.
STEP_SIZES = [2, 0, 9]


def uneven_steps_rank(rank, world_size, model_path, num_windows, ppo_epochs, kl_coef):
    """The trainer's per-rank path (share_step_batch, build_windows, Learner.train_step) over STEP_SIZES."""
    cfg = learner_config(model_path, learning_rate=1e-2, mini_batches_per_step=num_windows, ppo_epochs=ppo_epochs)
    cfg.algorithm.kl_coef = kl_coef
    cfg.train.param_dtype = cfg.train.compute_dtype = "float64"  # the reference model's, as the actor's
    actor = make_actor(model_path, dist.group.WORLD, torch.float64, lr=1e-2)
    learner = Learner(cfg, actor, mesh=TrainerMesh.from_group(dist.group.WORLD, "cpu"), device=CPU)
    own_sizes, metrics = [], []
    for seed, size in enumerate(STEP_SIZES):
        experiences, _ = grouped_experiences(seed, size)
        shares, micro_batch_counts = share_step_batch(experiences, num_ranks=world_size, num_windows=num_windows,
                                                      max_tokens_per_micro_batch=BUDGET, layout="padded")
        own = shares[rank]
        info = BatchInfo(rollout_ids=[e.rollout_id for e in experiences], group_ids=[e.group_id for e in experiences],
                         rewards=[e.reward for e in experiences], own=own)
        windows = build_windows([experiences[i] for i in own], num_windows=num_windows,
                                micro_batch_counts=micro_batch_counts, max_tokens_per_micro_batch=BUDGET,
                                pad_token_id=PAD, layout="padded", temperature=TEMPERATURE)
        metrics.append(learner.train_step(windows, info))
        own_sizes.append(len(own))
    return {"weights": weights(actor.model), "own_sizes": own_sizes, "metrics": metrics}


def test_a_rank_with_no_experience_joins_every_collective_and_changes_nothing(model_path):
    """2 PPO epochs (a proximal pass first) and the KL to a reference model (its forwards and
    all-reduce), on 3 ranks, against 1 rank training on the same batches: the same weights (fp64)."""
    settings = dict(num_windows=1, ppo_epochs=2, kl_coef=0.05)
    ranks = run_ranks(uneven_steps_rank, 3, model_path, *settings.values())
    (alone,) = run_ranks(uneven_steps_rank, 1, model_path, *settings.values())
    assert [result["own_sizes"] for result in ranks] == [[1, 0, 3], [1, 0, 3], [0, 0, 3]]
    for shared, single in zip(ranks[0]["metrics"], alone["metrics"]):
        assert shared["num_action_tokens"] == single["num_action_tokens"]
        assert shared["optimizer_steps"] == single["optimizer_steps"] == 2.0
        assert shared["loss"] == pytest.approx(single["loss"], rel=1e-9, abs=1e-12)
        assert shared["ref_kl_behavior"] == pytest.approx(single["ref_kl_behavior"], rel=1e-9, abs=1e-12)
    assert alone["metrics"][0]["loss"] != 0.0  # the first step's advantages move the weights
    for name, tensor in alone["weights"].items():
        for rank, result in enumerate(ranks):
            torch.testing.assert_close(result["weights"][name], tensor, rtol=1e-9, atol=1e-11,
                                       msg=f"rank {rank}: {name}")


def test_empty_windows_on_some_ranks_keep_the_ranks_in_step(model_path):
    """2 PPO mini-batches a step: a rank with one experience has an empty second window, a rank
    with none two. Every rank takes the same optimizer steps over the batch's tokens and ends
    with the same weights."""
    ranks = run_ranks(uneven_steps_rank, 3, model_path, 2, 1, 0.0)
    assert [result["own_sizes"] for result in ranks] == [[1, 0, 3], [1, 0, 3], [0, 0, 3]]
    for size, metrics in zip(STEP_SIZES, ranks[0]["metrics"]):
        experiences, _ = grouped_experiences(STEP_SIZES.index(size), size)
        assert metrics["num_action_tokens"] == sum(e.num_action_tokens for e in experiences)
        assert metrics["optimizer_steps"] == 2.0
    for name, tensor in ranks[0]["weights"].items():
        for result in ranks[1:]:
            assert torch.equal(result["weights"][name], tensor), name
