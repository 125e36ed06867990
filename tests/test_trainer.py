"""The per-step rollout metrics rank 0's feed logs (StepRollouts.metrics) and its evals (LeadFeed.evaluate;
the loop itself runs in tests/test_train_e2e.py)."""

from collections import Counter
from types import SimpleNamespace

from molt.config import MoltConfig
from molt.controller.pool import StepRollouts
from molt.trace.experience import Experience
from molt.trainer.feed import LeadFeed


def test_rollout_metrics_count_filtered_groups_by_reason_and_backfill_prompts():
    experiences = [Experience(token_ids=[1, 2], action_mask=[0, 1], behavior_logprobs=[0.0, -0.5],
                              policy_versions=[-1, 0], reward=float(i % 2), score=float(i % 2), group_id=0,
                              rollout_id=i) for i in range(2)]
    rollouts = StepRollouts(groups=[experiences], num_rollouts=10,
                            filtered_groups=Counter(all_high=3, all_low=1), backfill_prompts=4,
                            scored_rewards=[0.0, 1.0] + [1.0] * 6 + [0.0] * 2)
    metrics = rollouts.metrics(experiences)
    # reward/mean is the trained groups'; reward/scored_mean counts the filtered groups' rollouts too.
    assert (metrics["reward/mean"], metrics["reward/scored_mean"]) == (0.5, 0.7)
    assert (metrics["rollout/filtered_all_high"], metrics["rollout/filtered_all_low"]) == (3.0, 1.0)
    assert metrics["rollout/backfill_prompts"] == 4.0
    quiet = StepRollouts(groups=[experiences], num_rollouts=2).metrics(experiences)
    assert quiet["rollout/backfill_prompts"] == 0.0 and not any(k.startswith("rollout/filtered_") for k in quiet)


def test_rollout_metrics_carry_the_largest_event_loop_lag_of_the_step():
    rollouts = StepRollouts(groups=[], num_rollouts=0, loop_lag_max_seconds=1.5)
    rollouts.merge(StepRollouts(groups=[], loop_lag_max_seconds=0.25))  # a backfill round lagged less
    assert rollouts.metrics([])["rollout/loop_lag_max_seconds"] == 1.5


def test_the_lead_feed_runs_and_logs_an_eval_only_when_it_is_due():
    cfg = MoltConfig()
    cfg.eval.every_steps, cfg.eval.at_start, cfg.eval.n_samples = 2, False, 4
    metrics = {"eval/avg@4": 0.5, "eval/pass@4": 1.0, "eval/num_prompts": 2.0, "eval/seconds": 0.1}
    runs, rows = [], []
    controller = SimpleNamespace(payloads=None,
                                 run_eval=lambda step, version: runs.append((step, version)) or (metrics, []))
    logged = SimpleNamespace(log=lambda step, row: rows.append((step, row)))
    feed = LeadFeed(cfg, controller, metrics=logged, mesh=None, layout="padded")
    for step in range(5):
        feed.evaluate(step, policy_version=step)
    assert runs == [(2, 2), (4, 4)] and rows == [(2, metrics), (4, metrics)]
