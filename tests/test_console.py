"""The console (molt.console): step progress on a terminal and in a log file, heartbeats while a step
waits for rollouts, and the job stopping when every rollout of agent.max_failed_steps steps fails."""

import io
import json
import logging
import re
import threading
import time
from pathlib import Path

import pytest

from molt.agents.base import RolloutOutcome
from molt.config import ConfigError, MoltConfig, validate_config
from molt.console import Heartbeat, StepProgress, ToolProgress
from molt.controller.pool import FailedStepStreak, RolloutController, StepRollouts, gather_groups
from molt.trace.experience import Experience
from molt.transport.dispatch import encode_outcome
from molt.transport.mailbox import Mailbox
from molt.transport.wire import Router, connect_dealer, pack, unpack

ALWAYS_FAILS_AGENT = str(Path(__file__).parent / "agents" / "always_fails.py")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


STEP = {"reward/mean": 0.25, "throughput/tokens_per_second": 1234.4, "staleness/mean": 0.5, "time/step_seconds": 1.5}


def test_a_log_file_gets_one_line_per_step_with_an_eta_and_no_carriage_return(caplog):
    stream = io.StringIO()  # not a terminal, like a Slurm output file
    progress = StepProgress(total_steps=4, stream=stream)
    with caplog.at_level(logging.INFO, logger="molt"):
        progress.start(first_step=2)  # resumed after step 1
        progress.update(2, STEP)
        progress.update(3, {**STEP, "reward/mean": float("nan")})
        progress.update(4, STEP)
        progress.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("step 2/4 | reward 0.250 | tokens/s 1234 | staleness 0.50 | step 1.50s | ETA 00:0")
    assert lines[1].startswith("step 3/4 | reward nan |") and "ETA" in lines[1]
    assert lines[2] == "step 4/4 | reward 0.250 | tokens/s 1234 | staleness 0.50 | step 1.50s"  # nothing left
    assert stream.getvalue() == ""  # no bar


def test_a_terminal_gets_a_bar_and_log_lines_above_it(caplog):
    stream = Terminal()
    progress = StepProgress(total_steps=3, stream=stream)
    progress.start(first_step=1)
    progress.update(1, STEP)
    progress.update(2, STEP)
    progress.close()
    bar = stream.getvalue()
    assert "\r" in bar and "2/3" in bar and "reward 0.250 | tokens/s 1234 | staleness 0.50" in bar
    assert "step 1/3" not in bar  # no log line per step on a terminal


def test_disabled_progress_writes_nothing(caplog):
    stream = Terminal()
    progress = StepProgress(total_steps=3, stream=stream, enabled=False)
    with caplog.at_level(logging.INFO, logger="molt"):
        progress.start(1)
        progress.update(1, STEP)
        progress.close()
    assert stream.getvalue() == "" and caplog.records == []


def test_tool_progress_in_a_log_file_writes_lines_at_its_interval_and_the_last():
    stream = io.StringIO()
    progress = ToolProgress(5, desc="warm start", stream=stream, interval_seconds=3600)
    for step in range(5):
        progress.update(loss=1.0 / (step + 1))
    progress.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert [line.split(" [")[0] for line in lines] == ["warm start: 1/5 loss 1", "warm start: 5/5 loss 0.2"]


def test_heartbeat_is_due_every_interval(caplog):
    heartbeat = Heartbeat(interval_seconds=0.05)
    assert heartbeat.due_at > time.monotonic() - 0.01
    with caplog.at_level(logging.INFO, logger="molt"):
        time.sleep(0.06)
        heartbeat.beat("waiting for x")
    assert heartbeat.due_at >= time.monotonic() + 0.0  # pushed one interval on
    assert caplog.records[0].getMessage().startswith("waiting for x (waiting 0 s)")


# -- agent.max_failed_steps -----------------------------------------------------------------


def _outcome(rollout_id: int, group_id: int, failure: str = "", error: str = "") -> RolloutOutcome:
    experiences = [] if failure else [Experience(
        token_ids=[1, 2], action_mask=[0, 1], behavior_logprobs=[0.0, -0.5], policy_versions=[-1, 0],
        reward=1.0, score=1.0, group_id=group_id, rollout_id=rollout_id)]
    return RolloutOutcome(rollout_id=rollout_id, group_id=group_id, experiences=experiences, failure=failure,
                          error=error)


def _step(failures: list[str], first_id: int = 0) -> StepRollouts:
    """One step of one group: a rollout per entry, failed with that reason ('' succeeds)."""
    outcomes = [_outcome(first_id + i, 0, reason, f"{reason} of rollout {first_id + i}" if reason else "")
                for i, reason in enumerate(failures)]
    return gather_groups(outcomes, {0: len(failures)})


def test_failed_step_streak_stops_after_the_limit_naming_the_most_common_reason_and_an_example():
    streak = FailedStepStreak(max_failed_steps=3)
    assert streak.record(_step(["agent_error", "timeout"], 0)) is None
    assert streak.record(_step(["agent_error", "agent_error"], 2)) is None
    reason = streak.record(_step(["agent_error", "timeout"], 4))
    assert reason is not None
    assert reason.startswith("every rollout of the last 3 steps failed (6 rollouts; agent.max_failed_steps=3): "
                             "most often 'agent_error' (4 rollouts), e.g. rollout 0: agent_error of rollout 0; "
                             "also timeout (2)")
    assert "agent.max_failed_steps=0" in reason


def test_one_good_rollout_ends_the_streak_and_zero_never_stops():
    streak = FailedStepStreak(max_failed_steps=2)
    assert streak.record(_step(["agent_error"])) is None
    assert streak.record(_step(["agent_error", ""])) is None  # one rollout succeeded: the count starts again
    assert streak.record(_step(["agent_error"])) is None
    assert streak.record(_step(["timeout"])) is not None
    never = FailedStepStreak(max_failed_steps=0)
    assert all(never.record(_step(["agent_error"])) is None for _ in range(10))


def test_failure_examples_survive_merge_and_long_errors_are_cut():
    first, later = _step(["agent_error"], 0), _step(["timeout", "agent_error"], 1)
    first.merge(later)
    assert first.failure_examples == {"agent_error": "rollout 0: agent_error of rollout 0",
                                      "timeout": "rollout 1: timeout of rollout 1"}
    long = gather_groups([_outcome(0, 0, "agent_error", "x" * 5000)], {0: 1})
    reason = FailedStepStreak(max_failed_steps=1).record(long)
    example = reason.split("e.g. ")[1].split(". Fix")[0]
    assert example == ("rollout 0: " + "x" * 5000)[:500] + "..."


@pytest.mark.parametrize("value, ok", [(0, True), (3, True), (-1, False)])
def test_max_failed_steps_is_validated(tmp_path, value, ok):
    cfg = MoltConfig()
    cfg.agent.max_failed_steps = value
    try:
        validate_config(cfg, require_files=False)
        problems = ""
    except ConfigError as error:
        problems = str(error)
    assert (f"agent.max_failed_steps={value}: must be >= 0" in problems) is not ok


# -- the heartbeat of a step waiting for rollouts, over real sockets ------------------------


def _slow_rollout_rank(address: str, identity: str, delay_seconds: float) -> None:
    """Answers every rollout after `delay_seconds`, all at once."""
    socket = connect_dealer(address, identity)
    socket.send(pack({"type": "ready", "rank": 1}))
    requests = []
    socket.RCVTIMEO = int(delay_seconds * 1000)
    while True:
        try:
            message = unpack(socket.recv())
        except Exception:  # zmq.Again: the delay is over, answer
            for request in requests:
                socket.send(pack(encode_outcome(_outcome(request["rollout_id"], request["group_id"]))))
            requests = []
            continue
        if message["type"] == "shutdown":
            break
        requests.append(message["request"])
    socket.close(0)


def test_a_step_waiting_for_rollouts_says_what_it_waits_for(tmp_path, caplog):
    rows = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(2)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = MoltConfig()
    cfg.data.train_path = str(tmp_path / "train.jsonl")
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 2, 2
    router = Router("127.0.0.1")
    rank = threading.Thread(target=_slow_rollout_rank, args=(router.address, "rollout-1", 1.5), daemon=True)
    rank.start()
    controller = RolloutController(cfg, Mailbox(router, [1]))
    controller.mailbox.heartbeat_seconds = 0.3
    try:
        controller.wait_for_ranks(num_trainer_ranks=1)
        with caplog.at_level(logging.INFO, logger="molt"):
            result = controller.collect_step(policy_version=0, step=1)
    finally:
        controller.shutdown()
        rank.join(10)
        router.close()
    assert len(result.groups) == 2
    beats = [r.getMessage() for r in caplog.records if "waits for rollouts" in r.getMessage()]
    assert len(beats) >= 2, beats  # 1.5 s of waiting at a 0.3 s interval
    assert beats[0].startswith("step 1 waits for rollouts: 0 of 2 groups kept; queued groups: 0 complete, 2 in flight "
                               "(4 rollouts running; the oldest, rollout 0 on rollout rank 1, started ")
    assert re.search(r"started [01] s ago\) \(waiting [01] s\)$", beats[0]), beats[0]


# -- end to end: an agent whose every request gets a 404 -------------------------------------


@pytest.mark.e2e
def test_a_job_whose_every_rollout_fails_stops_cleanly_naming_the_reason(tmp_path, tiny_model_dir, demo_data_dir):
    from test_train_e2e import DEMO, _job_sets, _torchrun

    out = tmp_path / "run"
    sets = _job_sets(tiny_model_dir, demo_data_dir, out, **{
        "agent.path": ALWAYS_FAILS_AGENT, "agent.max_failed_steps": 2, "train.num_steps": 5,
        "rollout.max_response_tokens": 8, "refit.check_every_steps": 0})
    done = _torchrun(2, DEMO, sets)
    assert done.returncode != 0
    stop = re.search(r"ERROR step 2: every rollout of the last 2 steps failed \(32 rollouts; "
                     r"agent.max_failed_steps=2\): most often 'agent_error' \(32 rollouts\), e.g. rollout \d+: (.*)\. "
                     r"Fix the agent", done.stderr)
    assert stop and "404" in stop.group(1), done.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # the step that stops the job is logged, none after it
    assert all(r["rollout/failed"] == r["rollout/num_rollouts"] == 16 and r["reward/mean"] is None for r in rows)
    # Cleanly: no rank died with a traceback; the rollout rank stopped its engine (and said so) before
    # rank 0 exited, and vLLM did not have to kill its engine core.
    assert not re.search(r"\[rank\d\]: Traceback", done.stderr), done.stderr[-4000:]
    assert "did not say they stopped" not in done.stderr and "force killing" not in done.stderr, done.stderr[-4000:]
    assert "Root Cause" in done.stderr and "exitcode  : 1" in done.stderr  # torchrun's report: rank 0 exited 1
