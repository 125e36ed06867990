"""End to end: real torchrun jobs running molt.train with the real vLLM CPU engine."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from molt.trainer.optimizer import OptimizerSettings, lr_factor

# torchrun jobs: not in the unit tier; 600 s is above each job's own limit (420 s or less)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.py")
FLAKY_AGENT = str(Path(__file__).parent / "agents" / "flaky_first_attempt.py")
# tests/flaky_refit_receiver.py, imported by the engine's worker processes
FLAKY_RECEIVER_ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}


def _torchrun(nproc: int, config: str, sets: list[str], timeout_seconds: float = 420,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "molt.train", "--config", config]
    for item in sets:
        args += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    # On a timeout the whole job (torchrun and every process under it: ranks, engine cores, agent
    # workers) is killed, so a hung job cannot outlive the test.
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        _kill_tree(process.pid)
        stdout, stderr = process.communicate()
        raise AssertionError(f"torchrun job still running after {timeout_seconds}s; stderr:\n{stderr[-4000:]}")
    except BaseException:  # the test's own time limit, Ctrl-C: no job outlives the test either
        _kill_tree(process.pid)
        raise
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL torchrun and every process under it: its ranks run in sessions of their own, so
    killing torchrun's process group alone would leave them training."""
    for victim in [pid, *_descendants(pid)]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _job_sets(tiny_model_dir, demo_data_dir, output_dir, **fields) -> list[str]:
    # Synchronous unless a test says otherwise (the demo recipes stream): these tests count what
    # each step dispatched; tests/test_streaming_e2e.py covers streaming. Without the demo's
    # evaluation (tests/test_eval_e2e.py covers it), group filtering (which would backfill) and LR
    # warmup (longer than these runs).
    sets = {"model.path": tiny_model_dir, "data.train_path": Path(demo_data_dir) / "train.jsonl",
            "metrics.output_dir": output_dir, "train.num_steps": 3, "rollout.prompts_per_step": 4,
            "rollout.n_samples_per_prompt": 4, "refit.check_every_steps": 3, "algorithm.max_staleness": 0,
            "rollout.partial_rollout": False, "eval.every_steps": 0, "algorithm.filter_groups": False,
            "train.warmup_steps": 0, **fields}
    return [f"{key}={value}" for key, value in sets.items()]


def _metrics_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# A job takes ~40 s here, nearly all of it start-up and shut-down (its steps take ~0.2 s each), so
# some jobs below are module-scoped and read by several tests: a test of failure handling or of
# trainer options also runs one advantage estimator with its options (test_every_advantage_estimator_trains
# reads that job's rows), where the test's own assertions do not depend on the estimator.
VARIED_AGENT = str(Path(__file__).parent / "agents" / "varied_reward.py")
FAULTS_AGENT = str(Path(__file__).parent / "agents" / "worker_faults.py")
# Each estimator with some of the loss options, so every option runs in a real job without a job each.
OBJECTIVES = {
    "grpo": {"algorithm.importance_level": "token", "algorithm.importance_mode": "mask",
             "algorithm.importance_band": "[0.5,2.0]", "algorithm.dual_clip": 3.0},
    "dr_grpo": {"algorithm.kl_coef": 0.05, "algorithm.kl_estimator": "k3"},
    "group_mean": {"algorithm.entropy_coef": 0.01, "algorithm.importance_level": "token",
                   "algorithm.importance_mode": "trunc"},
    "rloo": {"algorithm.kl_coef": 0.05, "algorithm.kl_placement": "reward", "algorithm.kl_estimator": "k1",
             "algorithm.kl_target": 0.01},
    "reinforce_pp": {"algorithm.gamma": 0.99, "algorithm.kl_coef": 0.05, "algorithm.kl_placement": "reward",
                     "algorithm.kl_estimator": "k2", "algorithm.importance_level": "geo",
                     "algorithm.importance_mode": "mask"},
    "gae": {"algorithm.gae_lambda": 0.95, "algorithm.critic_learning_rate": 3e-3, "algorithm.value_clip": 0.5,
            "algorithm.importance_level": "seq", "algorithm.importance_mode": "mask",
            "algorithm.importance_band": "[0.1,10.0]", "train.num_steps": 4},
}


def _estimator(name: str) -> dict:
    return {"algorithm.advantage_estimator": name, **OBJECTIVES[name]}


def _shared_job(tmp_path_factory, tiny_model_dir, demo_data_dir, nproc: int, config: str, fields: dict,
                env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, list[dict], Path]:
    """A module-scoped job: the finished process, its metrics rows (none if it wrote none) and its run directory."""
    out = tmp_path_factory.mktemp("job") / "run"
    done = _torchrun(nproc, config, _job_sets(tiny_model_dir, demo_data_dir, out, **fields), env=env)
    return done, _metrics_rows(out) if (out / "metrics.jsonl").is_file() else [], out


@pytest.fixture(scope="module")
def two_trainers_job(tmp_path_factory, tiny_model_dir, demo_data_dir):
    """2 trainer ranks + 1 engine, the flaky agent refilling (test_two_trainers_and_one_engine...),
    GRPO with token importance masking and dual clip."""
    # The flaky agent fails sample 0 of one group per step once (a refill makes the group whole) and
    # of another group every time (its one refill fails too, so the group is dropped).
    return _shared_job(tmp_path_factory, tiny_model_dir, demo_data_dir, 3, f"{DEMO}:two_trainers", {
        "agent.path": FLAKY_AGENT, "agent.on_failed_rollout": "refill", "agent.max_refills_per_group": 1,
        "train.learning_rate": 1e-3, **_estimator("grpo")})


@pytest.fixture(scope="module")
def drop_job(tmp_path_factory, tiny_model_dir, demo_data_dir):
    """The flaky agent with the default agent.on_failed_rollout (test_failed_rollouts_drop...),
    Dr. GRPO with a k3 KL loss."""
    return _shared_job(tmp_path_factory, tiny_model_dir, demo_data_dir, 2, DEMO, {
        "agent.path": FLAKY_AGENT, "refit.check_every_steps": 0, "rollout.max_response_tokens": 8,
        "train.learning_rate": 1e-3, **_estimator("dr_grpo")})


@pytest.fixture(scope="module")
def faults_job(tmp_path_factory, tiny_model_dir, demo_data_dir):
    """The faults agent on one worker (test_agent_workers_survive...), RLOO with an adaptive KL in the reward."""
    faults = tmp_path_factory.mktemp("faults")
    done, rows, out = _shared_job(tmp_path_factory, tiny_model_dir, demo_data_dir, 2, DEMO, {
        "agent.path": FAULTS_AGENT, "rollout.num_agent_workers": 1, "agent.on_failed_rollout": "refill",
        "agent.max_refills_per_group": 8, "rollout.max_response_tokens": 8, "refit.check_every_steps": 0,
        "train.learning_rate": 1e-3, **_estimator("rloo")}, env={"MOLT_TEST_FAULTS_DIR": str(faults)})
    return done, rows, out, faults


@pytest.fixture(scope="module")
def scale_job(tmp_path_factory, tiny_model_dir, demo_data_dir):
    """Every trainer option on 2 FSDP2 ranks (test_trainer_scale_options...), the group-mean
    estimator with an entropy bonus and truncated token importance weights."""
    return _shared_job(tmp_path_factory, tiny_model_dir, demo_data_dir, 3, f"{DEMO}:two_trainers", {
        "agent.path": VARIED_AGENT, "rollout.max_response_tokens": 8, "train.learning_rate": 1e-3,
        "train.param_dtype": "float32", "train.compute_dtype": "bfloat16", "train.activation_checkpointing": "full",
        "train.logprob_chunk_tokens": 16, "train.packing": True, "train.mini_batches_per_step": 2,
        "train.ppo_epochs": 2, "train.lr_schedule": "cosine", "train.warmup_steps": 1, "train.min_lr_ratio": 0.1,
        "train.weight_decay": 0.01, "train.no_weight_decay_on": "norms,biases", **_estimator("group_mean")})


@pytest.fixture(scope="module")
def multi_turn_job(tmp_path_factory, tiny_model_dir, demo_data_dir):
    """The multi-turn Env recipe (test_multi_turn_env_recipe_runs), REINFORCE++ with a discount,
    a k2 KL in the reward and geometric-mean importance masking."""
    return _shared_job(tmp_path_factory, tiny_model_dir, demo_data_dir, 2, f"{DEMO}:multi_turn", {
        "train.num_steps": 3, "refit.check_every_steps": 0, **_estimator("reinforce_pp")})


# The job each estimator runs in (its fixture's docstring says which test it serves).
ESTIMATOR_JOBS = {"grpo": "two_trainers_job", "dr_grpo": "drop_job", "rloo": "faults_job",
                  "group_mean": "scale_job", "reinforce_pp": "multi_turn_job", "gae": "refit_faults_job"}


def test_two_trainers_and_one_engine_train_three_steps(two_trainers_job):
    done, rows, out = two_trainers_job
    assert done.returncode == 0, done.stderr[-4000:]
    # Every rank passed the CURVE handshake and nothing was dropped (ranks closing at the end is news only).
    assert "controller socket: refused" not in done.stderr and "malformed" not in done.stderr
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for row in steps:
        for key in ("reward/mean", "train/loss", "train/grad_norm", "time/step_seconds", "time/rollout",
                    "time/train", "time/refit", "throughput/tokens_per_second"):
            assert row[key] is not None and math.isfinite(row[key]), (key, row)
        assert row["rollout/num_rollouts"] == 16 + 2
        assert (row["rollout/num_groups"], row["rollout/dropped_groups"], row["rollout/refilled"]) == (3, 1, 2), row
        assert row["rollout/failed"] == row["rollout/failed_agent_error"] == 3, row
        assert row["train/num_action_tokens"] > 0 and row["train/grad_norm"] > 0
    # The refit check ran before training (step 0) and after step 3; weights changed in between.
    checks = [r["refit/max_abs_logprob_diff"] for r in rows if "refit/max_abs_logprob_diff" in r]
    assert len(checks) == 2 and all(gap <= 1e-4 for gap in checks), checks
    assert json.loads((out / "config.json").read_text())["layout"]["num_trainer_ranks"] == 2


# The refit fault job's refit.timeout_seconds: the window below (more than one timeout, less than
# two) then leaves 13 s past the 17 s hang for the rebuild and the retry, generous for a loaded machine.
REFIT_TIMEOUT_SECONDS = 15


@pytest.fixture(scope="module")
def refit_faults_job(tmp_path_factory, tiny_model_dir, demo_data_dir):
    """The engine's refit receiver fails version 2's first attempt and hangs in version 3's
    (test_a_failed_refit_names_the_engine...), 2 trainer ranks, GAE with a clipped critic and
    sequence-level importance masking on the varied-reward agent."""
    return _shared_job(tmp_path_factory, tiny_model_dir, demo_data_dir, 3, f"{DEMO}:two_trainers", {
        "agent.path": VARIED_AGENT, "train.num_steps": 4, "train.learning_rate": 1e-3,
        "rollout.max_response_tokens": 8, "refit.timeout_seconds": REFIT_TIMEOUT_SECONDS, "refit.check_every_steps": 1,
        "refit.receiver_cls": "flaky_refit_receiver.FlakyRefitReceiver", **_estimator("gae")}, env={
        **FLAKY_RECEIVER_ENV, "MOLT_TEST_REFIT_FAULTS": "2:raise,3:hang",
        "MOLT_TEST_REFIT_HANG_SECONDS": str(REFIT_TIMEOUT_SECONDS + 2)})


def test_a_failed_refit_names_the_engine_within_one_timeout_and_the_retry_loads_the_weights(refit_faults_job):
    """The engine fails version 2's first refit attempt (its load raises) and sleeps past
    refit.timeout_seconds in version 3's; each attempt is reported naming the engine, the refit
    group is rebuilt and the retry loads the weights: the refit check after every step matches."""
    done, rows, _ = refit_faults_job
    timeout = REFIT_TIMEOUT_SECONDS
    assert done.returncode == 0, done.stderr[-4000:]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["refit/failed_attempts"] for r in steps] == [0, 1, 2, 2]
    failed_load = re.search(r"ERROR refit v2 \(attempt 1\): the engine of rollout rank 2 failed: (.*); rebuilding "
                            r"the refit group and retrying \(attempt 2 of 2\)", done.stderr)
    assert failed_load and "injected load failure at version 2" in failed_load.group(1), done.stderr[-4000:]
    assert (f"refit v3 (attempt 1): the engine of rollout rank 2 did not confirm within "
            f"refit.timeout_seconds={timeout}; rebuilding") in done.stderr
    # One timeout covers the hung attempt: step 3's refit (the attempt, the rebuild, which waits
    # for the engine to wake, and the retry) takes longer than one timeout, not two.
    assert timeout < steps[2]["time/refit"] < 2 * timeout, steps[2]
    gaps = [r["refit/max_abs_logprob_diff"] for r in rows if "refit/max_abs_logprob_diff" in r]
    assert len(gaps) == 5 and all(gap <= 1e-4 for gap in gaps), gaps


def test_a_refit_that_fails_its_last_attempt_stops_the_job_naming_the_engine(tmp_path, tiny_model_dir, demo_data_dir):
    sets = _job_sets(tiny_model_dir, demo_data_dir, tmp_path / "run", **{
        "train.num_steps": 2, "rollout.max_response_tokens": 8, "refit.max_attempts": 1,
        "refit.check_every_steps": 0, "refit.receiver_cls": "flaky_refit_receiver.FlakyRefitReceiver"})
    done = _torchrun(2, DEMO, sets, env={**FLAKY_RECEIVER_ENV, "MOLT_TEST_REFIT_FAULTS": "1:raise"})
    assert done.returncode != 0
    fatal = re.search(r"RefitError: refit v1 \(attempt 1\): the engine of rollout rank 1 failed: (.*); gave up "
                      r"after refit.max_attempts=1", done.stderr)
    assert fatal and "injected load failure at version 1" in fatal.group(1), done.stderr[-4000:]


def test_failed_rollouts_drop_their_groups_by_default(drop_job):
    done, rows, _ = drop_job
    assert done.returncode == 0, done.stderr[-4000:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:  # agent.on_failed_rollout='drop_group': both groups with a failure are dropped
        assert (row["rollout/num_rollouts"], row["rollout/num_groups"], row["rollout/dropped_groups"],
                row["rollout/refilled"], row["rollout/failed_agent_error"]) == (16, 2, 2, 0, 2), row
        assert math.isfinite(row["train/loss"]) and math.isfinite(row["reward/mean"])
    assert "failed (agent_error): RuntimeError: flaky agent" in done.stderr


@pytest.mark.parametrize("estimator", list(OBJECTIVES))
def test_every_advantage_estimator_trains(request, estimator):
    done, rows, out, *_ = request.getfixturevalue(ESTIMATOR_JOBS[estimator])
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads((out / "config.json").read_text())["algorithm"]["advantage_estimator"] == estimator
    rows = [r for r in rows if r["step"] >= 1]  # without the refit check's step-0 row
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 3
    for row in rows:
        assert math.isfinite(row["train/loss"]) and row["train/grad_norm"] > 0, row
    options = OBJECTIVES[estimator]
    if "algorithm.kl_coef" in options:
        assert all(math.isfinite(r["train/ref_kl_behavior"]) and math.isfinite(r["train/kl_coef"]) for r in rows)
    if options.get("algorithm.kl_placement") != "reward" and "algorithm.kl_coef" in options:
        assert all(math.isfinite(r["train/ref_kl"]) for r in rows)
    if "algorithm.kl_target" in options:  # the adaptive coefficient moved
        assert rows[-1]["train/kl_coef"] != options["algorithm.kl_coef"]
    if "algorithm.entropy_coef" in options:
        assert all(r["train/entropy"] > 0 for r in rows)
    if options.get("algorithm.importance_mode") == "mask":
        assert all(0 <= r["train/importance_rejected_share"] <= 1 for r in rows)
    if estimator == "gae":  # the critic learns: its loss falls from its zero-initialised start
        losses = [r["train/value_loss"] for r in rows]
        assert losses[-1] < losses[0], losses


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited


def test_agent_workers_survive_a_killed_worker_and_report_a_blocked_loop(faults_job):
    """The faults agent SIGKILLs its worker on sample 0 of group 1 (step 1) and blocks its worker's
    loop for 1.5 s on sample 0 of group 4 (step 2), once each. One worker, so the refills and every
    later rollout must wait for its replacement (tests/test_agent_workers.py runs two)."""
    done, rows, _, faults = faults_job
    assert done.returncode == 0, done.stderr[-4000:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    killed_pid, blocked_pid = int((faults / "killed").read_text()), int((faults / "blocked").read_text())
    # Step 1: the rollouts in flight on the killed worker failed as agent_worker_died and were refilled.
    died = rows[0].get("rollout/failed_agent_worker_died", 0)
    assert died >= 1 and rows[0]["rollout/failed"] == rows[0]["rollout/refilled"] == died, rows[0]
    assert rows[0]["rollout/num_groups"] == 4
    assert f"agent worker 0 (pid {killed_pid}) died with exit code -9" in done.stderr
    assert "is back (restart 1)" in done.stderr
    for row in rows[1:]:
        assert row["rollout/failed"] == 0 and row["rollout/num_groups"] == 4, row
    # Step 2: the blocked worker's loop lag is the step's metric, and the worker warned, naming itself.
    assert rows[1]["rollout/loop_lag_max_seconds"] >= 1.4, rows[1]
    assert all(math.isfinite(r["rollout/loop_lag_max_seconds"]) for r in rows)
    assert f"of rollout rank 1 (pid {blocked_pid}): event loop blocked for 1." in done.stderr
    assert "user agent code is blocking the event loop" in done.stderr
    served = [tuple(int(x) for x in line.split()) for line in (faults / "served").read_text().splitlines()]
    assert killed_pid not in {pid for pid, group, _, _ in served if group >= 4}  # steps 2-3 ran on
    assert len({pid for pid, *_ in served}) == 2  # the replacement: one worker at a time, two in all
    assert all(vllm_imported == 0 for *_, vllm_imported in served)  # workers never import vLLM
    assert not [pid for pid in {pid for pid, *_ in served} if _alive(pid)], "an agent worker outlived the job"


def test_multi_turn_env_recipe_runs(multi_turn_job):
    done, rows, _ = multi_turn_job
    assert done.returncode == 0, done.stderr[-4000:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["reward/mean"]) for r in rows)


@pytest.mark.parametrize("nproc, extra, expected", [
    (3, {}, "but the job has 3 ranks"),
    (2, {"train.learnng_rate": "1"}, "did you mean 'train.learning_rate'"),
    (2, {"agent.path": "no/such/agent.py"}, "agent.path='no/such/agent.py' is not a file"),
])
def test_bad_input_stops_the_job_at_start_up(tmp_path, tiny_model_dir, demo_data_dir, nproc, extra, expected):
    done = _torchrun(nproc, DEMO, _job_sets(tiny_model_dir, demo_data_dir, tmp_path / "run", **extra),
                     timeout_seconds=120)
    assert done.returncode != 0
    assert expected in done.stderr


def test_an_agent_file_without_agent_runner_stops_the_job(tmp_path, tiny_model_dir, demo_data_dir):
    agent = tmp_path / "agent.py"
    agent.write_text("class NotARunner:\n    pass\n")
    sets = _job_sets(tiny_model_dir, demo_data_dir, tmp_path / "run", **{"agent.path": agent})
    done = _torchrun(2, DEMO, sets, timeout_seconds=300)
    assert done.returncode != 0
    assert "defines no AgentRunner" in done.stderr


def test_a_model_vllm_cannot_load_stops_the_job_naming_it(tmp_path, tiny_model_dir, demo_data_dir):
    broken = tmp_path / "broken-model"  # transformers loads it (by model_type); vLLM refuses the architecture
    shutil.copytree(tiny_model_dir, broken)
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    sets = _job_sets(tiny_model_dir, demo_data_dir, tmp_path / "run")
    done = _torchrun(2, DEMO, sets + [f"model.path={broken}"], timeout_seconds=300)
    assert done.returncode != 0
    assert f"model.path={str(broken)!r}" in done.stderr


CHAT_AGENTS_BY_GROUP = str(Path(__file__).parent / "agents" / "chat_agents_by_group.py")


def agents_by_group_env(log: Path, *agents) -> dict[str, str]:
    """tests/agents/chat_agents_by_group.py: group g runs agent g % len(agents) (a path, or
    PATH:ATTRIBUTE=VALUE), logging each finished rollout to `log`."""
    return {"MOLT_TEST_AGENTS": ",".join(str(agent) for agent in agents), "MOLT_TEST_AGENT_LOG": str(log)}


def finished_rollouts(log: Path) -> list[dict]:
    """tests/agents/chat_agents_by_group.py's log: agent, version (at dispatch), group, segments, ledger."""
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_the_seed_chat_agents_train_as_written(tmp_path, tiny_model_dir, demo_data_dir):
    """Issue 3's two seed programs, unchanged but for `grade`, drive a real training job: one job,
    half its groups through each (tests/agents/chat_agents_by_group.py)."""
    out, log, agents = tmp_path / "run", tmp_path / "finished", Path(__file__).parent / "agents"
    done = _torchrun(2, DEMO, _job_sets(tiny_model_dir, demo_data_dir, out, **{
        "agent.path": CHAT_AGENTS_BY_GROUP, "train.num_steps": 2, "rollout.prompts_per_step": 8,
        "rollout.max_response_tokens": 8, "refit.check_every_steps": 0}),
        env=agents_by_group_env(log, agents / "seed_openai.py", agents / "seed_anthropic.py"))
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # a reply whose first token ends the turn has no text block: that rollout fails
        assert row["drift/first_turn"] == row["rollout/num_rollouts"] == 32
        assert row["rollout/num_groups"] >= 4 and row["train/num_action_tokens"] > 0, row
    # Each program trained at least 2 whole groups of its 4 in each step (synchronous: step s
    # dispatches at policy version s - 1).
    finished = finished_rollouts(log)
    for sdk in ("seed_openai", "seed_anthropic"):
        for version in (0, 1):
            groups = [r["group"] for r in finished if (r["agent"], r["version"]) == (sdk, version)]
            assert sum(groups.count(group) == 4 for group in set(groups)) >= 2, (sdk, version, finished)


def test_chat_agent_recipes_train_through_the_sdks(tmp_path, tiny_model_dir, demo_data_dir):
    """The tool_agent recipe as shipped: streaming (max_staleness 1, partial rollout), sessions
    through the SDKs; half its groups run the OpenAI agent, half the Anthropic one, which is all the
    tool_agent_anthropic recipe changes (checked below): one job for both recipes."""
    from molt.config import load_config

    openai_recipe, anthropic_recipe = load_config(f"{DEMO}:tool_agent"), load_config(f"{DEMO}:tool_agent_anthropic")
    agent_files = [Path(openai_recipe.agent.path), Path(anthropic_recipe.agent.path)]
    anthropic_recipe.name, anthropic_recipe.agent.path = openai_recipe.name, openai_recipe.agent.path
    assert anthropic_recipe == openai_recipe and agent_files[1].name == "addition_tool_anthropic.py"
    out, log = tmp_path / "run", tmp_path / "finished"
    done = _torchrun(2, f"{DEMO}:tool_agent", _job_sets(tiny_model_dir, demo_data_dir, out, **{
        "agent.path": CHAT_AGENTS_BY_GROUP, "train.num_steps": 3, "rollout.max_response_tokens": 8,
        "algorithm.max_staleness": 1, "rollout.partial_rollout": True}), env=agents_by_group_env(log, *agent_files))
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for row in steps:
        assert row["rollout/failed"] == 0, row
        assert row["drift/first_turn"] == row["rollout/num_rollouts"] == 16  # one session per rollout
        assert row["train/num_action_tokens"] > 0 and math.isfinite(row["train/loss"])
        assert row["staleness/max"] <= 1, row
    assert [r["rollout/in_flight"] for r in steps] == [16, 16, 0]  # the next step's sessions ran meanwhile
    assert all(gap <= 1e-4 for gap in (r["refit/max_abs_logprob_diff"] for r in rows if "refit/max_abs_logprob_diff" in r))
    names = {record["agent"] for record in finished_rollouts(log)}
    assert names == {"addition_tool_openai", "addition_tool_anthropic"}, names


HUGE_REWARD_AGENT = str(Path(__file__).parent / "agents" / "huge_reward.py")


def test_non_finite_steps_push_no_weights_and_repeated_they_stop_the_job_naming_the_step(
        tmp_path, tiny_model_dir, demo_data_dir):
    """RELIABILITY 27: rewards of 1e30 make every step's gradient norm overflow. Each such step takes
    no optimizer step and pushes no weights (the policy version stays 0: the engine keeps the start
    weights, which the refit check confirms), and the second in a row stops the job naming it."""
    out = tmp_path / "run"
    sets = _job_sets(tiny_model_dir, demo_data_dir, out, **{
        "agent.path": HUGE_REWARD_AGENT, "algorithm.advantage_estimator": "dr_grpo", "train.num_steps": 4,
        "train.max_consecutive_nonfinite_steps": 2, "refit.check_every_steps": 1, "rollout.max_response_tokens": 8})
    done = _torchrun(2, DEMO, sets)
    assert done.returncode != 0
    assert re.search(r"NonFiniteTrainingError: step 2: 2 consecutive steps had a non-finite loss or gradient norm "
                     r"\(train.max_consecutive_nonfinite_steps=2\)", done.stderr), done.stderr[-4000:]
    assert "step 1: non-finite loss" in done.stderr and "no weights pushed" in done.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["step"] >= 1] == [1, 2]  # the step that stops the job is logged too
    assert rows[-1]["train/skipped_nonfinite_steps"] == 2.0 and rows[-1]["policy_version"] == 0.0
    step1 = next(r for r in rows if r["step"] == 1)
    assert step1["train/skipped_nonfinite_steps"] == 1.0 and step1["train/optimizer_steps"] == 0.0
    assert step1["train/grad_norm"] is None or not math.isfinite(step1["train/grad_norm"])  # JSON writes inf/nan as null
    assert step1["policy_version"] == 0.0 and "time/refit" not in step1
    # Checked after step 1: the engine still serves the initial weights, and so does the trainer.
    assert step1["refit/max_abs_logprob_diff"] <= 1e-4


def test_trainer_scale_options_run_in_a_real_job(scale_job):
    """Every trainer option selectable from a recipe in one job of 2 FSDP2 trainer ranks: float32
    master weights under bf16 compute (the engine serves float32: refit casts), every block
    checkpointed, small log-prob chunks, packing, 2 mini-batches x 2 epochs, a cosine schedule with
    warmup, no decay on norms and biases (and truncated token importance weights)."""
    done, rows, _ = scale_job
    assert done.returncode == 0, done.stderr[-4000:]
    assert "train.packing" not in done.stderr  # the packing check passed: no fallback warning
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    schedule = OptimizerSettings(lr=1e-3, schedule="cosine", num_steps=3, warmup_steps=1, min_lr_ratio=0.1)
    assert [r["train/lr"] for r in steps] == pytest.approx([1e-3 * lr_factor(s, schedule) for s in (1, 2, 3)])
    for row in steps:
        assert row["train/optimizer_steps"] == 4.0 and row["train/skipped_nonfinite_steps"] == 0.0, row
        assert 0.0 <= row["train/padding_share"] < 0.1  # packed: padding only at the ends of rows
        assert math.isfinite(row["train/loss"]) and row["train/grad_norm"] > 0
        assert row["policy_version"] == row["step"]
    assert any(r["train/clip_fraction"] > 0 or r["train/ratio_mean"] != 1.0 for r in steps)
    # bf16 compute against a float32 engine: close, not equal.
    gaps = [r["refit/max_abs_logprob_diff"] for r in rows if "refit/max_abs_logprob_diff" in r]
    assert len(gaps) == 2 and all(gap < 0.1 for gap in gaps), gaps
