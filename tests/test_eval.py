"""Evaluation (molt.controller.evaluation, molt.controller.pool.run_eval, molt.eval): the eval set, its requests and
seeds, avg@k / pass@k against naive loops, and eval rollouts kept out of training."""

import itertools
import json
import math
import threading

import pytest

from molt.agents.base import RolloutOutcome
from molt.config import ConfigError, MoltConfig
from molt.controller.evaluation import (EvalSample, build_eval_requests, compute_eval_metrics, pass_at,
                                        sample_from_outcome, split_eval_rows)
from molt.controller.pool import RolloutController
from molt.controller.prompts import PromptDataset, PromptRow, load_prompt_rows
from molt.eval import read_eval_rows, resolve_model_dir
from molt.trace.experience import Experience
from molt.transport.dispatch import encode_outcome
from molt.transport.mailbox import Mailbox
from molt.transport.wire import Router, connect_dealer, pack, unpack


def _write_rows(path, count: int) -> str:
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(count)))
    return str(path)


def _config(tmp_path, num_rows: int = 10, **eval_fields) -> MoltConfig:
    cfg = MoltConfig(seed=3)
    cfg.data.train_path = _write_rows(tmp_path / "train.jsonl", num_rows)
    cfg.data.shuffle = False
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 2, 2
    for name, value in eval_fields.items():
        setattr(cfg.eval, name, value)
    return cfg


@pytest.mark.parametrize("every, at_start, due", [
    (0, True, []), (2, True, [0, 2, 4, 6]), (2, False, [2, 4, 6]), (3, True, [0, 3, 6])])
def test_eval_is_due_every_n_steps_and_at_the_start(every, at_start, due):
    cfg = MoltConfig()
    cfg.eval.every_steps, cfg.eval.at_start = every, at_start
    assert [step for step in range(7) if cfg.eval.due(step)] == due


def _naive_pass_at(results: list[bool], j: int) -> float:
    """The share of all j-subsets of the samples with at least one correct one."""
    subsets = list(itertools.combinations(results, j))
    return sum(any(subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("results", [[True, False, False, True], [False] * 4, [True] * 3, [False, True, False]])
def test_pass_at_is_the_unbiased_estimate(results):
    for j in range(1, len(results) + 1):
        assert pass_at(len(results), sum(results), j) == pytest.approx(_naive_pass_at(results, j), abs=1e-12)


def test_eval_metrics_equal_naive_loops():
    rewards = {0: [1.0, 0.0, 0.0, 1.0], 1: [0.0, 0.0, 0.0, 0.0], 2: [0.5, 1.0, 1.0, 0.25]}
    samples = [EvalSample(prompt_position=p, sample_index=i, reward=r, num_response_tokens=p + i,
                          truncated=i == 3, failure="timeout" if (p, i) == (1, 2) else "")
               for p, rs in rewards.items() for i, r in enumerate(rs)]
    metrics = compute_eval_metrics(samples, k=4, success_threshold=1.0)
    total, count, solved_prompts, correct_samples = 0.0, 0, 0, 0
    for rs in rewards.values():
        solved = False
        for r in rs:
            total, count = total + r, count + 1
            correct_samples += r >= 1.0
            solved = solved or r >= 1.0
        solved_prompts += solved
    assert metrics["eval/avg@4"] == pytest.approx(total / count)
    assert metrics["eval/pass@4"] == pytest.approx(solved_prompts / 3)
    assert metrics["eval/pass@1"] == pytest.approx(correct_samples / 12)  # pass@1 is the mean success
    assert metrics["eval/response_length_mean"] == pytest.approx(sum(p + i for p in range(3) for i in range(4)) / 12)
    assert (metrics["eval/truncated_share"], metrics["eval/failed"]) == (0.25, 1.0)
    assert (metrics["eval/num_prompts"], metrics["eval/num_samples"]) == (3.0, 12.0)


def test_a_failed_eval_rollout_scores_zero_and_a_good_one_its_reward_and_tokens():
    experience = Experience(token_ids=[5, 6, 7, 8], action_mask=[0, 1, 0, 1], behavior_logprobs=[0.0] * 4,
                            policy_versions=[-1, 0, -1, 0], reward=0.75, score=0.75, group_id=4, rollout_id=-3)
    good = sample_from_outcome(RolloutOutcome(rollout_id=-3, group_id=4, experiences=[experience]), sample_index=1)
    assert (good.prompt_position, good.sample_index, good.reward, good.response_token_ids) == (4, 1, 0.75, [6, 8])
    failed = sample_from_outcome(RolloutOutcome(rollout_id=-4, group_id=4, experiences=[], failure="timeout"), 2)
    assert (failed.reward, failed.failure, failed.num_response_tokens) == (0.0, "timeout", 0)


def test_holdout_rows_leave_training_disjoint_keep_file_indices_and_follow_the_seed(tmp_path):
    cfg = _config(tmp_path, num_rows=10, every_steps=1, holdout_rows=3)
    rows = load_prompt_rows(cfg.data.train_path)
    training, held = split_eval_rows(cfg, rows)
    assert len(training) == 7 and len(held) == 3
    assert {r.index for r in training} | {r.index for r in held} == set(range(10))
    assert not {r.index for r in training} & {r.index for r in held}
    assert all(row.label == str(row.index + 1) for row in training + held)  # each keeps its own file index
    assert [r.index for r in PromptDataset(training).rows] == [r.index for r in training]  # the loader keeps them too
    assert [r.index for r in split_eval_rows(cfg, rows)[1]] == [r.index for r in held]  # the same split each time
    cfg.seed = 4
    assert [r.index for r in split_eval_rows(cfg, rows)[1]] != [r.index for r in held]


def test_an_eval_file_leaves_training_whole_and_max_prompts_keeps_the_first(tmp_path):
    cfg = _config(tmp_path, num_rows=4, every_steps=1, max_prompts=2,
                  data_path=_write_rows(tmp_path / "eval.jsonl", 5))
    training, eval_rows = split_eval_rows(cfg, load_prompt_rows(cfg.data.train_path))
    assert len(training) == 4 and [r.label for r in eval_rows] == ["1", "2"]
    assert [r.label for r in read_eval_rows(cfg)] == ["1", "2"]


def test_a_holdout_that_leaves_too_few_training_rows_is_refused(tmp_path):
    cfg = _config(tmp_path, num_rows=4, every_steps=1, holdout_rows=3)
    with pytest.raises(ConfigError, match=r"eval.holdout_rows=3 leaves 1 of data.train_path's 4 rows"):
        split_eval_rows(cfg, load_prompt_rows(cfg.data.train_path))


def test_eval_requests_carry_the_eval_sampling_and_one_seed_per_sample_whatever_the_step(tmp_path):
    cfg = _config(tmp_path, n_samples=3, temperature=0.6, top_p=0.9, max_response_tokens=5)
    rows = load_prompt_rows(cfg.data.train_path)[:2]
    requests = build_eval_requests(cfg, rows, policy_version=7)
    assert [(r["group_id"], r["sample_index"]) for r in requests] == [(p, i) for p in range(2) for i in range(3)]
    assert all(r["sampling"]["temperature"] == 0.6 and r["sampling"]["top_p"] == 0.9
               and r["sampling"]["max_tokens"] == 5 and r["policy_version"] == 7 for r in requests)
    seeds = [r["sampling"]["seed"] for r in requests]
    assert len(set(seeds)) == 6 and all(0 <= seed < 2**63 for seed in seeds)
    assert [r["sampling"]["seed"] for r in build_eval_requests(cfg, rows, policy_version=9)] == seeds
    cfg.eval.max_response_tokens = 0  # unset: training's
    assert build_eval_requests(cfg, rows, 0)[0]["sampling"]["max_tokens"] == cfg.rollout.max_response_tokens


def _stand_in_rank(address: str, received: list[dict]) -> None:
    """A rollout rank that answers each request at once, reward = the sum of its digits' parity."""
    socket = connect_dealer(address, "rollout-1")
    socket.send(pack({"type": "ready", "rank": 1}))
    while (message := unpack(socket.recv()))["type"] != "shutdown":
        request = message["request"]
        received.append({**request, "eval": bool(message.get("eval"))})
        reward = float(int(request["label"]) % 2) if request["sample_index"] % 2 == 0 else 0.0
        experience = Experience(token_ids=[1, 2, 3], action_mask=[0, 1, 1], behavior_logprobs=[0.0, -0.1, -0.2],
                                policy_versions=[-1, 0, 0], reward=reward, score=reward,
                                group_id=request["group_id"], rollout_id=request["rollout_id"])
        outcome = RolloutOutcome(rollout_id=request["rollout_id"], group_id=request["group_id"],
                                 experiences=[experience])
        socket.send(pack(encode_outcome(outcome)))
    socket.close(0)


def _run_controller(cfg: MoltConfig, eval_at: set[int]) -> tuple[list[dict], list, list[dict]]:
    """Two streaming steps (max_staleness 1), with an eval before each step in `eval_at`: the
    training requests, each step's accounting, and the eval results."""
    router, received = Router("127.0.0.1"), []
    rank = threading.Thread(target=_stand_in_rank, args=(router.address, received), daemon=True)
    rank.start()
    controller = RolloutController(cfg, Mailbox(router, [1]))
    accounting, evals = [], []
    try:
        controller.wait_for_ranks(num_trainer_ranks=1)
        for step in (1, 2):
            if step - 1 in eval_at:
                evals.append(controller.run_eval(step - 1, policy_version=step - 1))
            result = controller.collect_step(policy_version=step - 1, step=step)
            accounting.append(result.accounting)
    finally:
        controller.shutdown()
        rank.join(10)
        router.close()
    return received, accounting, evals


def test_eval_rollouts_stay_out_of_training_and_its_accounting(tmp_path):
    cfg = _config(tmp_path, num_rows=10, every_steps=1, holdout_rows=3, n_samples=2)
    cfg.algorithm.max_staleness, cfg.train.num_steps = 1, 2
    without, accounting_without, _ = _run_controller(cfg, eval_at=set())
    received, accounting, evals = _run_controller(cfg, eval_at={0, 1})
    training = [r for r in received if not r["eval"]]
    strip = lambda requests: [{k: v for k, v in r.items() if k != "eval"} for r in requests]  # noqa: E731
    assert strip(training) == strip(without)  # the same training requests, ids and seeds alike
    assert accounting == accounting_without  # eval rollouts are not dispatched training rollouts
    eval_requests = [r for r in received if r["eval"]]
    assert len(eval_requests) == 2 * 3 * 2 and all(r["rollout_id"] < 0 for r in eval_requests)
    held_labels = {row.label for row in split_eval_rows(cfg, load_prompt_rows(cfg.data.train_path))[1]}
    assert {r["label"] for r in eval_requests} == held_labels
    assert not held_labels & {r["label"] for r in training}  # held-out prompts never train
    for step, (metrics, samples) in enumerate(evals):
        assert (metrics["eval/step"], metrics["eval/policy_version"]) == (step, step)
        assert len(samples) == 6
        # Recomputed from what the stand-in rank answered: odd labels score on even samples.
        expected = [float(int(r["label"]) % 2) if r["sample_index"] % 2 == 0 else 0.0
                    for r in eval_requests[6 * step:6 * step + 6]]
        assert metrics["eval/avg@2"] == pytest.approx(sum(expected) / 6)
        assert metrics["eval/pass@2"] == pytest.approx(sum(expected[i] > 0 for i in range(0, 6, 2)) / 3)
        assert metrics["eval/response_length_mean"] == 2.0


def test_resolve_model_dir_takes_a_model_directory_and_refuses_anything_else(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path / "hf"), MoltConfig(), str(tmp_path)) == str(tmp_path / "hf")
    (tmp_path / "junk").mkdir()
    with pytest.raises(ConfigError, match="neither a Hugging Face model directory"):
        resolve_model_dir(str(tmp_path / "junk"), MoltConfig(), str(tmp_path))


def test_read_eval_rows_needs_an_eval_set(tmp_path):
    with pytest.raises(ConfigError, match="no eval set"):
        read_eval_rows(_config(tmp_path))
    assert math.isnan(compute_eval_metrics([], k=2, success_threshold=1.0)["eval/avg@2"])
