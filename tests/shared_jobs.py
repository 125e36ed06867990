"""Session-scoped torchrun jobs that tests of several files read (tests/conftest.py imports the
fixtures). A job takes ~40 s here, nearly all of it start-up and shut-down, so a reference run that
several tests compare against runs once."""

from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class FinishedJob:
    returncode: int
    stderr: str
    out: Path  # the run directory: metrics.jsonl, prompts.jsonl, checkpoints/


@pytest.fixture(scope="session")
def eight_prompts_data(tmp_path_factory, demo_data_dir) -> Path:
    """A data directory whose train.jsonl holds the demo's first 8 prompts (tests/test_checkpoint_e2e.py)."""
    from test_checkpoint_e2e import write_eight_prompts

    return write_eight_prompts(tmp_path_factory.mktemp("eight-prompts"), demo_data_dir)


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory, tiny_model_dir, eight_prompts_data) -> FinishedJob:
    """The uninterrupted synchronous run (test_checkpoint_e2e.straight_sets: 4 steps on the 8 prompts,
    a checkpoint after every step) that the kill -9 resume, the resume across trainer world sizes
    (tests/test_resume_e2e.py) and the reproducibility test (tests/test_streaming_e2e.py) compare with."""
    from test_checkpoint_e2e import straight_sets
    from test_train_e2e import DEMO, _torchrun

    out = tmp_path_factory.mktemp("straight") / "run"
    done = _torchrun(2, DEMO, straight_sets(tiny_model_dir, eight_prompts_data, out))
    return FinishedJob(done.returncode, done.stderr, out)


EVAL_SAMPLES = 2  # eval/avg@2, eval/pass@2


@pytest.fixture(scope="session")
def evaluating_straight_run(tmp_path_factory, tiny_model_dir, eight_prompts_data, demo_data_dir) -> FinishedJob:
    """The straight run again, evaluating 8 eval prompts x 2 samples at the start and every 2 steps.
    Evaluation takes no training seed and no prompt, so it trains exactly as the straight run: the
    eval-in-a-job test (tests/test_eval_e2e.py) and the reproducibility test (tests/test_streaming_e2e.py)
    compare the two."""
    from test_checkpoint_e2e import straight_sets
    from test_train_e2e import DEMO, _torchrun

    out = tmp_path_factory.mktemp("straight-eval") / "run"
    evaluation = {"eval.every_steps": 2, "eval.at_start": True, "eval.data_path": Path(demo_data_dir) / "eval.jsonl",
                  "eval.max_prompts": 8, "eval.n_samples": EVAL_SAMPLES, "eval.temperature": 1.0}
    sets = [item for item in straight_sets(tiny_model_dir, eight_prompts_data, out) if not item.startswith("eval.")]
    sets += [f"{key}={value}" for key, value in evaluation.items()]
    done = _torchrun(2, DEMO, sets)
    return FinishedJob(done.returncode, done.stderr, out)
