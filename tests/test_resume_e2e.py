"""Resume on another trainer world size (DCP resharding) and the stop signal Slurm sends before a
time limit or a pre-emption, end to end with real torchrun jobs (RELIABILITY 26, 30).

One 1-trainer job runs 4 steps straight, checkpointing each. A 2-trainer job resumes its step 2
(1 -> 2 ranks), gets SIGUSR1 as Slurm delivers it (every process of the job step; torchrun started
ignoring it, as launch/slurm.sbatch starts it), checkpoints step 3 and exits 0. A 1-trainer job
resumes that with checkpoint.resume=auto (2 -> 1 ranks) and runs step 4. The resumed steps train
the straight run's prompts with its losses, and their checkpoints hold its weights and AdamW moments
(sharded differently: each checkpoint is compared unsharded).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from test_checkpoint_e2e import NUM_PROMPTS, NUM_STEPS, SCHEDULE, _prompts, _rows, _sets
from test_train_e2e import DEMO, ROOT, _descendants, _kill_tree, _torchrun

pytestmark = pytest.mark.e2e  # starts vLLM engines or torchrun jobs: not in the unit tier


def _ignore_usr1() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _run_and_signal_once_resumed(sets: list[str], log: Path, timeout_seconds: float = 420) -> int:
    """Start a 2-trainer job whose torchrun ignores SIGUSR1 (launch/slurm.sbatch starts it so);
    once the trainer ranks have resumed, send SIGUSR1 to every process of the job, as Slurm signals
    a job step. Returns torchrun's exit code."""
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
            "-m", "molt.train", "--config", f"{DEMO}:two_trainers"]
    for item in sets:
        args += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with log.open("w") as output:
        process = subprocess.Popen(args, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                   start_new_session=True, preexec_fn=_ignore_usr1)
    deadline = time.monotonic() + timeout_seconds
    try:
        while "resumed from" not in log.read_text():
            assert process.poll() is None, f"the job ended before resuming:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no resume within {timeout_seconds}s"
            time.sleep(0.2)
        for pid in [process.pid, *_descendants(process.pid)]:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        return process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if process.poll() is None:
            _kill_tree(process.pid)
            process.wait()


def _state(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The actor's weights and AdamW state in a checkpoint, unsharded, flat: {'model.<fqn>': ...,
    'optimizer.<fqn>.exp_avg': ..., ...}."""
    target = tmp_path / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint / "model", target)
    actor = torch.load(target, weights_only=False)["actor"]
    flat = {f"model.{fqn}": tensor for fqn, tensor in actor["model"].items()}
    for fqn, moments in actor["optimizer"]["state"].items():
        flat.update({f"optimizer.{fqn}.{key}": torch.as_tensor(value) for key, value in moments.items()})
    return flat


def _check_same_state(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    assert any(key.endswith(".exp_avg_sq") for key in got)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-7, msg=lambda m: f"{key}: {m}")


@pytest.mark.timeout(1500)  # three torchrun jobs (one the session's straight run) of up to 420 s each
def test_resume_at_1_and_2_trainer_ranks_and_stop_on_sigusr1(tmp_path, tiny_model_dir, eight_prompts_data,
                                                             straight_run):
    # The straight run (tests/shared_jobs.py, 1 trainer rank) checkpoints every step, with SCHEDULE.
    straight, resumed = straight_run.out, tmp_path / "resumed"
    assert straight_run.returncode == 0, straight_run.stderr[-4000:]
    checkpoints = straight / "checkpoints"

    # 1 -> 2 trainer ranks, stopped by SIGUSR1 after the first resumed step.
    log = tmp_path / "signalled.log"
    code = _run_and_signal_once_resumed(_sets(tiny_model_dir, eight_prompts_data, resumed, **SCHEDULE, **{
        "checkpoint.interval_steps": 0, "checkpoint.resume": checkpoints / "step_00000002"}), log)
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert "step 3: stop requested (SIGUSR1); writing a checkpoint and exiting" in text
    assert [path.name for path in (resumed / "checkpoints").iterdir()] == ["step_00000003"]
    assert sorted(_rows(resumed)) == [3]
    _check_same_state(_state(resumed / "checkpoints" / "step_00000003", tmp_path),
                      _state(checkpoints / "step_00000003", tmp_path))

    # 2 -> 1 trainer ranks: the requeued job resumes where the signal stopped it.
    done = _torchrun(2, DEMO, _sets(tiny_model_dir, eight_prompts_data, resumed, **SCHEDULE, **{
        "checkpoint.interval_steps": 1, "checkpoint.resume": "auto"}))
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"resumed from {resumed / 'checkpoints' / 'step_00000003'}: step 3" in done.stderr
    _check_same_state(_state(resumed / "checkpoints" / "step_00000004", tmp_path),
                      _state(checkpoints / "step_00000004", tmp_path))

    # The prompt stream went on where it stopped: the straight run's prompts, none lost or repeated.
    expected, got = _prompts(straight), _prompts(resumed)
    assert sorted(got) == [3, 4]
    assert [got[step]["trained"] for step in (3, 4)] == [expected[step]["trained"] for step in (3, 4)]
    assert sorted(expected[1]["trained"] + expected[2]["trained"]) == list(range(NUM_PROMPTS))
    straight_rows, resumed_rows = _rows(straight), _rows(resumed)
    assert sorted(resumed_rows) == [3, 4]
    for step in (3, 4):
        for key in ("train/loss", "train/grad_norm", "reward/mean"):
            assert resumed_rows[step][key] == pytest.approx(straight_rows[step][key], rel=1e-4, abs=1e-6), (step, key)
