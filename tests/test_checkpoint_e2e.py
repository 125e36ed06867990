"""Checkpoint and resume of the whole pipeline, end to end: real torchrun jobs killed with SIGKILL
mid-run and resumed with checkpoint.resume=auto (RELIABILITY 13-16)."""

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_train_e2e import DEMO, ROOT, _alive, _descendants, _job_sets, _kill_tree, _torchrun

from molt.trainer.optimizer import OptimizerSettings, lr_factor

# torchrun jobs: not in the unit tier; 600 s is above each job's own limit (420 s or less)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

VARIED_AGENT = str(Path(__file__).parent / "agents" / "varied_reward.py")  # rewards vary: losses are not 0
# 8 prompts, 4 a step: the checkpoint after step 2 ends epoch 0 exactly (RELIABILITY 13), and the
# resumed steps 3-4 run epoch 1.
NUM_STEPS, INTERVAL, NUM_PROMPTS, PROMPTS_PER_STEP = 4, 2, 8, 4


def _rows(out: Path) -> dict[int, dict]:
    """Each step's metrics; a step logged twice (before a kill and after the resume) keeps its last row."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if row["step"] >= 1}


def _prompts(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def _run_and_kill_after_checkpoint(sets: list[str], marker: Path, timeout_seconds: float = 300) -> None:
    """Start the job and SIGKILL its ranks once `marker` exists: what they started (the engine core and
    its vLLM worker, the agent workers) must die with them (molt/distributed/lifetime.py), as when the OOM killer
    takes a rank, and within seconds. The rest (torchrun, stragglers) is killed after."""
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "molt.train", "--config", DEMO]
    for item in sets:
        args += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               env=env, start_new_session=True)
    deadline, spawned = time.monotonic() + timeout_seconds, {}
    try:
        while not marker.exists():
            if process.poll() is not None:
                raise AssertionError(f"the job ended (exit {process.returncode}) before writing {marker}:\n"
                                     f"{process.stderr.read()[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {marker} within {timeout_seconds}s")
            time.sleep(0.05)
        started = _descendants(process.pid)
        ranks = [pid for pid in started if _parent(pid) == process.pid]
        spawned = {pid: _command(pid) for pid in started if pid not in ranks}
        assert len(ranks) == 2 and any("VLLM::EngineCore" in name for name in spawned.values()), spawned
        for rank in ranks:
            os.kill(rank, signal.SIGKILL)
        deadline = time.monotonic() + 30  # they go within a few seconds; generous for a loaded machine
        while [pid for pid in spawned if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = {pid: name for pid, name in spawned.items() if _alive(pid)}
        assert not survivors, f"processes outlived their rank killed with SIGKILL: {survivors}"
    finally:
        for pid, name in spawned.items():  # survivors are orphans now, outside the tree _kill_tree kills
            if _command(pid) == name:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        _kill_tree(process.pid)
        process.communicate()  # returns once nothing holds the job's stderr pipe open


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:100].decode(errors="replace")
    except FileNotFoundError:
        return "(gone)"


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except FileNotFoundError:
        return None


SCHEDULE = {"train.lr_schedule": "cosine", "train.warmup_steps": 1, "train.min_lr_ratio": 0.1}


def _sets(tiny_model_dir, data_dir, out, **fields) -> list[str]:
    return _job_sets(tiny_model_dir, data_dir, out, **{
        "train.num_steps": NUM_STEPS, "checkpoint.interval_steps": INTERVAL, "refit.check_every_steps": 1000,
        "rollout.prompts_per_step": PROMPTS_PER_STEP, "rollout.max_response_tokens": 8,
        "train.learning_rate": 1e-3, "agent.path": VARIED_AGENT, **fields})


def straight_sets(tiny_model_dir, data_dir, out) -> list[str]:
    """The uninterrupted run that tests/shared_jobs.py's straight_run makes once for the session:
    the schedule, a checkpoint after every step (tests/test_resume_e2e.py resumes from them)."""
    # Colocated (layout.colocate): on CPU it changes nothing the comparisons see, which the resumed,
    # not colocated, runs check; it runs the colocated control flow (placement, refit backend, engine
    # memory) end to end in CI without a job of its own.
    return _sets(tiny_model_dir, data_dir, out, **SCHEDULE, **{"checkpoint.interval_steps": 1,
                                                               "checkpoint.keep_last": NUM_STEPS,
                                                               "layout.colocate": True})


def write_eight_prompts(data: Path, demo_data_dir) -> Path:
    """`data`/train.jsonl: the demo's first 8 prompts (one epoch = 2 steps)."""
    rows = (Path(demo_data_dir) / "train.jsonl").read_text().splitlines()[:NUM_PROMPTS]
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    return data


@pytest.fixture
def eight_prompts(tmp_path, demo_data_dir) -> Path:
    """A data directory whose train.jsonl holds the demo's first 8 prompts (one epoch = 2 steps)."""
    data = tmp_path / "data"
    data.mkdir()
    return write_eight_prompts(data, demo_data_dir)


def _check_each_epoch_trains_every_prompt_once(prompts: dict[int, dict]) -> None:
    assert sorted(prompts) == list(range(1, NUM_STEPS + 1))
    steps_per_epoch = NUM_PROMPTS // PROMPTS_PER_STEP
    for first in range(1, NUM_STEPS + 1, steps_per_epoch):
        epoch = [i for step in range(first, first + steps_per_epoch) for i in prompts[step]["trained"]]
        assert sorted(epoch) == list(range(NUM_PROMPTS)), prompts  # none lost, none twice


@pytest.mark.timeout(1500)  # three torchrun jobs (one the session's straight run): 420 + 300 + 420 s limits
def test_kill_9_and_resume_trains_the_prompts_and_losses_of_a_straight_run(tmp_path, tiny_model_dir,
                                                                           eight_prompts_data, straight_run):
    """Synchronous: N steps straight, and N/2 + SIGKILL of the whole job + resume + N/2, train on the
    same prompts in the same steps with the same losses, across the epoch boundary the checkpoint
    sits on; the resumed engines carry the checkpoint's weights before the first new rollout (the
    refit check right after the resume). The straight run (tests/shared_jobs.py) checkpoints every
    step, this one every INTERVAL steps."""
    straight, killed = straight_run.out, tmp_path / "killed"
    assert straight_run.returncode == 0, straight_run.stderr[-4000:]
    _run_and_kill_after_checkpoint(_sets(tiny_model_dir, eight_prompts_data, killed, **SCHEDULE),
                                   killed / "checkpoints" / f"step_{INTERVAL:08d}" / "COMPLETE")
    assert max(_rows(killed)) < NUM_STEPS  # it was killed mid-run
    resumed = _torchrun(2, DEMO, _sets(tiny_model_dir, eight_prompts_data, killed, **SCHEDULE,
                                       **{"checkpoint.resume": "auto"}))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {killed / 'checkpoints' / f'step_{INTERVAL:08d}'}: step {INTERVAL}" in resumed.stderr

    expected, got = _prompts(straight), _prompts(killed)
    _check_each_epoch_trains_every_prompt_once(got)
    assert [got[s]["trained"] for s in sorted(got)] == [expected[s]["trained"] for s in sorted(expected)]
    straight_rows, killed_rows = _rows(straight), _rows(killed)
    assert sorted(killed_rows) == list(range(1, NUM_STEPS + 1))
    assert any(abs(row["train/loss"]) > 1e-4 for row in straight_rows.values())  # the comparison is not trivial
    for step in range(1, NUM_STEPS + 1):
        for key in ("train/loss", "train/grad_norm", "reward/mean"):
            assert killed_rows[step][key] == pytest.approx(straight_rows[step][key], abs=1e-6), (step, key)
    # The LR schedule's state came back with the checkpoint: every step ran at its scheduled rate.
    schedule = OptimizerSettings(lr=1e-3, schedule="cosine", num_steps=NUM_STEPS, warmup_steps=1, min_lr_ratio=0.1)
    expected_lr = [1e-3 * lr_factor(step, schedule) for step in range(1, NUM_STEPS + 1)]
    assert [killed_rows[s]["train/lr"] for s in range(1, NUM_STEPS + 1)] == pytest.approx(expected_lr, rel=1e-12)
    assert [straight_rows[s]["train/lr"] for s in range(1, NUM_STEPS + 1)] == pytest.approx(expected_lr, rel=1e-12)
    # The resumed engines were refitted from the checkpoint before any rollout and score like the trainer.
    assert killed_rows[INTERVAL + 1]["refit/max_abs_logprob_diff"] <= 1e-4


@pytest.mark.timeout(1200)  # two torchrun jobs: 300 + 420 s limits
def test_kill_9_and_resume_while_streaming_loses_and_repeats_no_prompt(tmp_path, tiny_model_dir, eight_prompts):
    """Streaming (the next step's rollouts in flight at the checkpoint): the resumed run
    re-dispatches their prompts; every prompt of each epoch is trained once."""
    out = tmp_path / "run"
    streaming = {"algorithm.max_staleness": 1, "rollout.partial_rollout": True, "algorithm.importance_level": "token",
                 "algorithm.importance_mode": "trunc"}
    _run_and_kill_after_checkpoint(_sets(tiny_model_dir, eight_prompts, out, **streaming),
                                   out / "checkpoints" / f"step_{INTERVAL:08d}" / "COMPLETE")
    assert max(_rows(out)) < NUM_STEPS  # it was killed mid-run
    done = _torchrun(2, DEMO, _sets(tiny_model_dir, eight_prompts, out, **streaming, **{"checkpoint.resume": "auto"}))
    assert done.returncode == 0, done.stderr[-4000:]
    prompts, rows = _prompts(out), _rows(out)
    _check_each_epoch_trains_every_prompt_once(prompts)
    assert sorted(rows) == list(range(1, NUM_STEPS + 1))
    total = NUM_STEPS * PROMPTS_PER_STEP * 4
    assert rows[NUM_STEPS]["rollout/dispatched_total"] == rows[NUM_STEPS]["rollout/consumed_total"] == total
    assert rows[INTERVAL + 1]["rollout/in_flight"] == PROMPTS_PER_STEP * 4  # it streamed after the resume too


def test_a_fresh_job_into_an_old_runs_checkpoint_directory_fails_fast_and_keeps_them(tmp_path, tiny_model_dir,
                                                                                      eight_prompts):
    """Without checkpoint.resume, a job whose checkpoint.dir holds an earlier run's checkpoints stops
    before starting anything, names the directory and the ways out, and deletes nothing."""
    out = tmp_path / "run"
    old = out / "checkpoints" / f"step_{INTERVAL:08d}"
    old.mkdir(parents=True)
    (old / "COMPLETE").write_text(json.dumps({"step": INTERVAL, "run_id": "old"}))  # all the start-up check reads
    started = time.monotonic()
    done = _torchrun(2, DEMO, _sets(tiny_model_dir, eight_prompts, out), timeout_seconds=120)
    assert done.returncode != 0
    assert time.monotonic() - started < 60  # no engine, model or process group was started
    assert (f"checkpoint.dir={str(out / 'checkpoints')!r} holds 1 complete checkpoint(s) of an earlier run "
            f"(steps {INTERVAL})") in done.stderr
    assert "checkpoint.resume=auto" in done.stderr and "checkpoint.overwrite=true" in done.stderr
    assert (old / "COMPLETE").is_file()


def test_the_straight_run_trains_colocated(straight_run):
    """The session's straight run is colocated: it trained every step and refit over gloo."""
    assert straight_run.returncode == 0, straight_run.stderr[-4000:]
    assert "colocated (layout.colocate): on CPU trainer and engine share the cores" in straight_run.stderr
    assert "refit backend: gloo (refit.backend=auto)" in straight_run.stderr
    rows = [json.loads(line) for line in (straight_run.out / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row.get("step", 0) >= 1 and "train/loss" in row]
    assert len(steps) == NUM_STEPS and all(math.isfinite(row["reward/mean"]) for row in steps)
    assert steps[-1]["policy_version"] == NUM_STEPS  # every step's weights reached the engine
