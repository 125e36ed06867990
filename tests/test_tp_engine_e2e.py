"""Tensor parallelism end to end: a real torchrun job whose two trainer ranks form one
tensor-parallel group (layout.trainer_tensor_parallel_size=2) and whose engine runs two CPU workers
(layout.engine_tensor_parallel_size=2), each with its own refit rank (DESIGN section 6)."""

import json
import re

import pytest

from test_train_e2e import DEMO, FLAKY_RECEIVER_ENV, VARIED_AGENT, _job_sets, _torchrun

# a torchrun job (not in the unit tier) with a 600 s limit
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def test_tensor_parallel_trainer_and_engine_train_and_serve_the_trainers_weights(
        tmp_path, tiny_tp_model_dir, demo_data_dir):
    """Two trainer ranks of one tensor-parallel group (both train on the same experiences, each
    holding half of every projection; the payloads are freed once both hold them) and one rollout
    rank whose engine has two tensor-parallel workers, one core each (RolloutEngine.start sets
    VLLM_CPU_OMP_THREADS_BIND). The refit group has 3 ranks: the trainer's sender and the two
    workers, each receiving every weight (gathered whole from the trainer's DTensors), bucket by
    bucket into one reused buffer, and loading its own slice. The refit check after every step
    compares the engine's log-probs with the trainer's.

    Version 2's first attempt: the engine does not acknowledge the pause within the timeout, so the
    trainer broadcasts nothing, names the engine, rebuilds the group (both workers join again) and
    the retry loads the weights."""
    out, timeout = tmp_path / "run", 10
    sets = _job_sets(tiny_tp_model_dir, demo_data_dir, out, **{
        "agent.path": VARIED_AGENT, "layout.num_trainer_ranks": 2, "layout.trainer_tensor_parallel_size": 2, "layout.engine_tensor_parallel_size": 2, "train.learning_rate": 1e-3, "rollout.max_response_tokens": 8,
        "refit.bucket_megabytes": 0.25, "refit.check_every_steps": 1, "refit.timeout_seconds": timeout,
        "refit.receiver_cls": "flaky_refit_receiver.FlakyRefitReceiver"})
    done = _torchrun(3, DEMO, sets, timeout_seconds=600, env={
        **FLAKY_RECEIVER_ENV, "MOLT_TEST_REFIT_FAULTS": "2:stall", "MOLT_TEST_REFIT_HANG_SECONDS": str(timeout + 2)})
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["policy_version"] for r in steps] == [1, 2, 3]
    assert [r["refit/failed_attempts"] for r in steps] == [0, 1, 1]
    group = re.search(r"engines ready; gloo refit group of 3 ranks, (\d+) buckets", done.stderr)
    assert group and int(group.group(1)) > 1, done.stderr[-4000:]
    assert ("refit v2 (attempt 1): the engine of rollout rank 2 did not acknowledge the pause within "
            f"refit.timeout_seconds={timeout}; nothing was broadcast; rebuilding the refit group and retrying "
            "(attempt 2 of 2)") in done.stderr, done.stderr[-4000:]
    # The check before training (step 0) and after every step: the engine's two workers, together,
    # compute the trainer's log-probs; the weights changed (learning rate 1e-3), so a stale engine
    # would show.
    gaps = [r["refit/max_abs_logprob_diff"] for r in rows if "refit/max_abs_logprob_diff" in r]
    assert len(gaps) == 4 and all(gap <= 1e-4 for gap in gaps), gaps
    for row in steps:  # both tensor-parallel ranks train on one share: the batch's tokens count once
        experiences = row["rollout/num_groups"] * 4 * row["rollout/segments_per_rollout"]
        assert row["train/num_action_tokens"] == pytest.approx(experiences * row["rollout/response_length_mean"]), row
        assert row["train/num_action_tokens"] > 0 and row["train/grad_norm"] > 0
