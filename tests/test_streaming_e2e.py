"""Streaming with bounded staleness, end to end: real torchrun jobs with the real vLLM CPU engine
(algorithm.max_staleness, rollout.partial_rollout; DESIGN section 6)."""

import json
import math
import os
from pathlib import Path

import pytest
from test_train_e2e import DEMO, _job_sets, _torchrun

# torchrun jobs: not in the unit tier; 600 s is above each job's own limit (420 s or less)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SLOW_AGENT = str(Path(__file__).parent / "agents" / "slow_two_turn.py")
DROP_REASONS = ("failed", "failed_group", "filtered", "stale")


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _check_accounting(row: dict) -> None:
    dropped = sum(row[f"rollout/dropped_{reason}_total"] for reason in DROP_REASONS)
    assert row["rollout/dropped_total"] == dropped, row
    assert row["rollout/dispatched_total"] == row["rollout/consumed_total"] + dropped + row["rollout/in_flight"], row


@pytest.mark.timeout(1200)  # two session jobs (tests/shared_jobs.py) of up to 420 s each, if this test starts them
def test_max_staleness_zero_is_synchronous_and_reproducible(straight_run, evaluating_straight_run):
    # max_staleness=0 is the synchronous trainer (tests/test_controller.py pins its dispatches and
    # batches): with fixed seeds two jobs train on the same samples and log the same numbers. They
    # are the session's straight run (tests/shared_jobs.py: varied rewards, 4 steps on 8 prompts,
    # synchronous from _job_sets) and the same run evaluating between steps, which takes no training
    # seed (tests/test_eval_e2e.py reads the pair for that).
    from test_checkpoint_e2e import NUM_STEPS

    for job in (straight_run, evaluating_straight_run):
        assert job.returncode == 0, job.stderr[-4000:]
        config = json.loads((job.out / "config.json").read_text())
        assert (config["algorithm"]["max_staleness"], config["rollout"]["partial_rollout"]) == (0, False)
    # Training rows only: without the refit check's step-0 row and the eval rows.
    runs = [[row for row in _rows(job.out) if row["step"] >= 1 and "train/loss" in row]
            for job in (straight_run, evaluating_straight_run)]
    keys = ("reward/mean", "rollout/tokens", "train/loss", "train/grad_norm", "train/mismatch_kl")
    first, second = ([{key: row[key] for key in keys} for row in rows] for rows in runs)
    assert len(first) == NUM_STEPS and first == second
    assert len({row["reward/mean"] for row in first}) > 1  # the steps differ, so the match is not trivial
    for row in runs[0]:
        assert row["rollout/in_flight"] == 0 and row["staleness/max"] == 0
        _check_accounting(row)


def _streaming_job(tmp_path, tiny_model_dir, demo_data_dir, **fields) -> list[dict]:
    out = tmp_path / "run"
    done = _torchrun(2, f"{DEMO}:multi_turn", _job_sets(tiny_model_dir, demo_data_dir, out, **{
        "agent.path": SLOW_AGENT, "rollout.prompts_per_step": 2, "rollout.n_samples_per_prompt": 2,
        "rollout.max_response_tokens": 4, "refit.check_every_steps": 0, "algorithm.max_staleness": 1,
        "algorithm.importance_level": "token", "algorithm.importance_mode": "trunc", **fields}))
    assert done.returncode == 0, done.stderr[-4000:]
    return _rows(out)


def test_streaming_with_partial_rollout_keeps_the_bound_and_the_accounting_every_step(
        tmp_path, tiny_model_dir, demo_data_dir):
    num_steps = 50
    rows = _streaming_job(tmp_path, tiny_model_dir, demo_data_dir, **{
        "rollout.partial_rollout": True, "train.num_steps": num_steps})
    assert [r["step"] for r in rows] == list(range(1, num_steps + 1))
    for row in rows:
        _check_accounting(row)
        # Every trained action token: at most max_staleness versions behind the version trained.
        assert 0 <= row["staleness/max"] <= 1, row
        assert math.isfinite(row["train/loss"]) and row["rollout/num_groups"] == 2
    # It streamed: the next step's groups were in flight while the trainer trained, some tokens were
    # a version behind, and some rollouts kept running across a refit (turns of two versions).
    assert all(r["rollout/in_flight"] == 4 for r in rows[:-1]) and rows[-1]["rollout/in_flight"] == 0
    assert max(r["staleness/max"] for r in rows) == 1
    assert sum(r["staleness/multi_version_experiences"] for r in rows) > 0
    assert rows[-1]["rollout/dispatched_total"] == rows[-1]["rollout/consumed_total"] == num_steps * 4


def test_streaming_without_partial_rollout_never_mixes_versions_in_an_experience(
        tmp_path, tiny_model_dir, demo_data_dir):
    rows = _streaming_job(tmp_path, tiny_model_dir, demo_data_dir, **{
        "rollout.partial_rollout": False, "train.num_steps": 12})
    assert [r["step"] for r in rows] == list(range(1, 13))
    for row in rows:
        _check_accounting(row)
        assert row["staleness/multi_version_experiences"] == 0 and row["staleness/max"] <= 1, row
    # Rollouts whose second turn ran after a refit were split there (the first turn became context).
    assert sum(r.get("drift/version_change", 0) for r in rows) > 0
    assert max(r["rollout/segments_per_rollout"] for r in rows) > 1
    # Short experiences (payloads.inline_bytes) travel whole in their records, none through the store.
    assert rows[-1]["payloads/inlined"] > 0 and rows[-1]["payloads/offloaded"] == 0, rows[-1]


@pytest.mark.soak
@pytest.mark.timeout(900)  # one torchrun job of 300 steps, limited to 600 s
def test_300_streaming_steps_move_every_payload_through_the_store_and_leak_nothing(
        tmp_path, tiny_model_dir, demo_data_dir):
    """Trainer ranks fetch their experiences from the rollout rank's payload store; a small budget
    makes payloads spill to files too. The controller sees references only, payloads are freed
    once trained on, memory, descriptors and segments stay flat after warm-up, and the job leaves
    no shared-memory segment or spill file behind (RELIABILITY 17)."""
    out, spill, node = tmp_path / "run", tmp_path / "spill", f"e2e-{os.getpid()}"
    num_steps, warmup, budget = 300, 50, 0.008 * 2**20  # room for one 4 KiB segment
    done = _torchrun(2, DEMO, _job_sets(tiny_model_dir, demo_data_dir, out, **{
        "train.num_steps": num_steps, "rollout.prompts_per_step": 2, "rollout.n_samples_per_prompt": 2,
        "rollout.max_response_tokens": 4, "refit.check_every_steps": 0, "algorithm.max_staleness": 1,
        "rollout.partial_rollout": True, "algorithm.importance_level": "token", "algorithm.importance_mode": "trunc",
        "payloads.budget_megabytes": budget / 2**20, "payloads.spill_dir": spill, "payloads.node_id": node,
        "payloads.inline_bytes": 0}),  # these experiences are short: without this they would travel inline
        timeout_seconds=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [r for r in _rows(out) if r["step"] >= 1]
    assert [r["step"] for r in rows] == list(range(1, num_steps + 1))
    trained = [r["rollout/consumed"] * r["rollout/segments_per_rollout"] for r in rows]
    for index, row in enumerate(rows):
        assert row["controller/token_values_received_total"] == 0, row  # references only
        assert row["payloads/offloaded"] >= sum(trained[:index + 1]), row
        # The store reports with each outcome, so the frees of the last step or two may not show yet.
        assert row["payloads/freed"] >= sum(trained[:max(0, index - 1)]), row
        assert row["payloads/segment_bytes"] <= budget and row["payloads/live"] <= 3 * 4, row
    assert rows[-1]["payloads/spilled"] > 0 and rows[-1]["payloads/segments"] > 0  # both kinds of storage
    steady = rows[warmup:]
    for role in ("trainer_rank0", "rollout_rank"):
        rss = [r[f"process/{role}_rss_bytes"] for r in steady]
        fds = [r[f"process/{role}_open_fds"] for r in steady]
        assert max(rss[-20:]) - min(rss[:20]) < 16 * 2**20, (role, rss[:20], rss[-20:])
        assert max(fds) - min(fds) <= 4, (role, fds)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"molt-{node}-")]
    assert not os.listdir(spill)
