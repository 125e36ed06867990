"""Evaluation end to end with the real vLLM CPU engine: eval samples against direct generations with
the same seeds, `python -m molt.eval`, and evaluation inside a real training job."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from molt.agents.base import SamplingParams
from molt.config import MoltConfig
from molt.controller.evaluation import eval_sample_seed
from molt.controller.prompts import load_prompt_rows
from molt.eval import run_eval_rollouts
from molt.rollout.engine import rollout_request_seed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.py")
ADDITION_AGENT = str(ROOT / "configs" / "agents" / "addition.py")


def _naive_avg_and_pass(samples: list[dict], labels: list[str], tokenizer) -> tuple[float, float]:
    """avg@k and pass@k recomputed from the sampled tokens with the addition agent's own rule."""
    total, solved = 0.0, {}
    for sample in samples:
        text = tokenizer.decode(sample["response_token_ids"], skip_special_tokens=True)
        reward = 1.0 if text.strip() == labels[sample["prompt_position"]] else 0.0
        total += reward
        solved[sample["prompt_position"]] = solved.get(sample["prompt_position"], False) or reward >= 1.0
    return total / len(samples), sum(solved.values()) / len(solved)


def test_eval_samples_are_the_engines_generations_with_their_seeds(engine, tiny_model_dir, demo_data_dir):
    """Eval rollouts through the agent workers on the shared engine: each sample's tokens are what a
    direct generation with its seed samples, and its reward is the agent's verdict on their text."""
    from molt.controller.evaluation import compute_eval_metrics

    cfg = MoltConfig(seed=5)
    cfg.model.path, cfg.agent.path = str(tiny_model_dir), ADDITION_AGENT
    cfg.rollout.max_length = 256
    cfg.eval.n_samples, cfg.eval.temperature, cfg.eval.max_response_tokens = 3, 1.0, 4
    rows = load_prompt_rows(Path(demo_data_dir) / "eval.jsonl")[:6]
    samples = engine.run(run_eval_rollouts(cfg, rows, engine.engine), 300)
    tokenizer = engine.engine.tokenizer
    assert [(s.prompt_position, s.sample_index) for s in samples] == [(p, i) for p in range(6) for i in range(3)]
    assert not any(s.failure for s in samples)

    async def direct(position: int, sample_index: int) -> list[int]:
        text = tokenizer.apply_chat_template(rows[position].messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        seed = rollout_request_seed(eval_sample_seed(cfg.seed, position, sample_index), ids)
        sampled = []
        async for delta in engine.engine.stream(ids, SamplingParams(max_tokens=4, temperature=1.0), seed=seed):
            sampled += delta.token_ids
        return sampled

    for sample in samples:
        assert sample.response_token_ids == engine.run(direct(sample.prompt_position, sample.sample_index)), sample
    records = [s.to_dict() for s in samples]
    avg, passed = _naive_avg_and_pass(records, [row.label for row in rows], tokenizer)
    metrics = compute_eval_metrics(samples, k=3, success_threshold=1.0)
    assert metrics["eval/avg@3"] == pytest.approx(avg) and metrics["eval/pass@3"] == pytest.approx(passed)
    # Not every sample of a prompt alike: the seeds differ per sample.
    assert len({tuple(s.response_token_ids) for s in samples}) > 6


def _run(args: list[str], timeout_seconds: float = 420) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout_seconds)


def test_molt_eval_evaluates_a_model_and_writes_each_sample(tmp_path, tiny_model_dir, demo_data_dir):
    out = tmp_path / "eval.json"
    sets = {"model.path": tiny_model_dir, "data.train_path": Path(demo_data_dir) / "train.jsonl",
            "eval.data_path": Path(demo_data_dir) / "eval.jsonl", "eval.max_prompts": 5, "eval.n_samples": 2,
            "eval.temperature": 1.0, "eval.max_response_tokens": 4}
    args = [sys.executable, "-m", "molt.eval", "--config", DEMO, "--checkpoint", str(tiny_model_dir), "--out", str(out)]
    done = _run(args + [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")])
    assert done.returncode == 0, done.stderr[-4000:]
    printed = json.loads(done.stdout)
    report = json.loads(out.read_text())
    assert report["metrics"] == printed and len(report["samples"]) == 10
    from transformers import AutoTokenizer

    labels = [row.label for row in load_prompt_rows(Path(demo_data_dir) / "eval.jsonl")[:5]]
    avg, passed = _naive_avg_and_pass(report["samples"], labels, AutoTokenizer.from_pretrained(tiny_model_dir))
    assert printed["eval/avg@2"] == pytest.approx(avg) and printed["eval/pass@2"] == pytest.approx(passed)
    assert all(sample["reward"] in (0.0, 1.0) for sample in report["samples"])
    assert "eval set: 5 prompts x 2 samples" in done.stderr


@pytest.mark.timeout(1200)  # two session jobs (tests/shared_jobs.py) of up to 420 s each, if this test starts them
def test_a_training_job_evaluates_at_the_due_steps_and_trains_as_without_eval(straight_run, evaluating_straight_run):
    """The session's straight run with evaluation at the start and every 2 steps evaluates at steps 0,
    2 and 4 and trains on the same prompts with the same numbers as the straight run without it."""
    from shared_jobs import EVAL_SAMPLES

    for job in (straight_run, evaluating_straight_run):
        assert job.returncode == 0, job.stderr[-4000:]
    evaluated, plain = (_rows(job.out) for job in (evaluating_straight_run, straight_run))
    avg, passed = f"eval/avg@{EVAL_SAMPLES}", f"eval/pass@{EVAL_SAMPLES}"
    evals = [row for row in evaluated if avg in row]
    assert [row["step"] for row in evals] == [row["eval/step"] for row in evals] == [0, 2, 4]
    for row in evals:
        # The straight run's agent (tests/agents/varied_reward.py) rewards 0, 1 or 2; solved means at
        # least 1 (eval.success_threshold). avg and pass against the samples: the molt.eval test above.
        assert 0.0 <= row[avg] <= 2.0 and 0.0 <= row[passed] <= 1.0, row
        assert (row["eval/num_prompts"], row["eval/num_samples"], row["eval/failed"]) == (8.0, 16.0, 0.0), row
        assert row["eval/policy_version"] == row["step"] and row["eval/seconds"] > 0
        assert math.isfinite(row["eval/response_length_mean"])
    assert not any(avg in row for row in plain)
    steps, plain_steps = ([row for row in rows if "train/loss" in row] for rows in (evaluated, plain))
    assert [row["step"] for row in steps] == [row["step"] for row in plain_steps] == [1, 2, 3, 4]
    for with_eval, without in zip(steps, plain_steps):
        # The same prompts, samples and update: eval neither took their seeds nor counted as rollouts.
        for key in ("reward/mean", "train/loss", "train/grad_norm", "rollout/num_rollouts",
                    "rollout/dispatched_total", "rollout/response_length_mean"):
            assert with_eval[key] == without[key], (key, with_eval[key], without[key])
    prompts = [(job.out / "prompts.jsonl").read_text() for job in (evaluating_straight_run, straight_run)]
    assert prompts[0] == prompts[1]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
