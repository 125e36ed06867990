"""The rollout controller: which groups a step keeps, refilling failed rollouts (agent.on_failed_rollout),
and filtering groups without signal with backfill from the prompt stream (algorithm.filter_groups)."""

import json
import logging
import threading
from collections import Counter

import pytest

from molt.agents.base import RolloutOutcome
from molt.config import AgentConfig, MoltConfig
from molt.controller.pool import (Accounting, AccountingError, RolloutController, StepRollouts, compute_staleness,
                                  filter_groups_by_score, gather_groups, group_filter_reason, should_refill)
from molt.rollout.rank import split_by_version
from molt.trace.experience import Experience
from molt.transport.dispatch import decode_outcome, encode_outcome
from molt.transport.mailbox import Mailbox
from molt.transport.wire import Router, connect_dealer, pack, unpack


def _outcome(rollout_id: int, group_id: int, failure: str = "", reward: float | None = None) -> RolloutOutcome:
    reward = float(rollout_id) if reward is None else reward
    experiences = [] if failure else [Experience(
        token_ids=[1, 2], action_mask=[0, 1], behavior_logprobs=[0.0, -0.5], policy_versions=[-1, 0],
        reward=reward, score=reward, group_id=group_id, rollout_id=rollout_id)]
    return RolloutOutcome(rollout_id=rollout_id, group_id=group_id, experiences=experiences, failure=failure,
                          error="boom" if failure else "")


@pytest.mark.parametrize("policy, max_refills, num_refills, expected", [
    ("drop_group", 2, 0, False),
    ("refill", 2, 0, True),
    ("refill", 2, 1, True),
    ("refill", 2, 2, False),  # the group used its refills: it is dropped, never retried forever
    ("refill", 0, 0, False),
])
def test_should_refill_follows_the_policy_and_the_cap(policy, max_refills, num_refills, expected):
    agent = AgentConfig(on_failed_rollout=policy, max_refills_per_group=max_refills)
    assert should_refill(num_refills, agent) is expected


def test_gather_keeps_groups_whose_failed_rollouts_were_made_up_and_counts_every_failure():
    outcomes = [
        _outcome(0, group_id=10), _outcome(1, group_id=10, failure="timeout"), _outcome(4, group_id=10),  # refilled
        _outcome(2, group_id=11), _outcome(3, group_id=11, failure="agent_error"),  # not made up
        _outcome(5, group_id=12), _outcome(6, group_id=12),
    ]
    result = gather_groups(outcomes, {10: 2, 11: 2, 12: 2})
    assert [[e.rollout_id for e in group] for group in result.groups] == [[0, 4], [5, 6]]
    assert result.dropped_groups == 1
    assert result.failures == {"timeout": 1, "agent_error": 1}
    assert result.num_rollouts == 7


def test_gather_keeps_the_largest_loop_lag_of_its_outcomes_failed_ones_included():
    outcomes = [_outcome(0, group_id=10), _outcome(1, group_id=10, failure="agent_worker_died")]
    outcomes[0].loop_lag_max_seconds, outcomes[1].loop_lag_max_seconds = 0.5, 2.0
    assert gather_groups(outcomes, {10: 2}).loop_lag_max_seconds == 2.0
    decoded = decode_outcome(encode_outcome(outcomes[0]))  # it survives the wire
    assert decoded.loop_lag_max_seconds == 0.5


def _serve_rollouts(address: str, identity: str, received: list[dict], answer, max_requests: int = 100) -> None:
    """A stand-in rollout rank: records each request and sends back `answer(request, attempt)`,
    attempt counting the requests for the same (group, sample) so far, this one included. Past
    `max_requests` it reports an error, so a controller that never stops dispatching fails the test
    instead of hanging it."""
    socket = connect_dealer(address, identity)
    socket.send(pack({"type": "ready", "rank": 1}))
    while (message := unpack(socket.recv()))["type"] != "shutdown":
        request = message["request"]
        received.append(request)
        if len(received) > max_requests:
            socket.send(pack({"type": "error", "during": "rollout", "error": f"over {max_requests} requests"}))
            continue
        attempt = sum(r["group_id"] == request["group_id"] and r["sample_index"] == request["sample_index"]
                      for r in received)
        socket.send(pack(encode_outcome(answer(request, attempt))))
    socket.close(0)


def _stand_in_rollout_rank(address: str, identity: str, received: list[dict]) -> None:
    """Sample 0 of group 0 fails on its first attempt only, sample 0 of group 1 fails on every
    attempt, everything else succeeds."""
    def answer(request: dict, attempt: int) -> RolloutOutcome:
        group_id = request["group_id"]
        fails = request["sample_index"] == 0 and (group_id == 1 or attempt == 1 and group_id == 0)
        return _outcome(request["rollout_id"], group_id, failure="agent_error" if fails else "")
    _serve_rollouts(address, identity, received, answer)


@pytest.mark.parametrize("policy, num_groups, dropped, refilled, failed", [
    ("drop_group", 0, 2, 0, 2),
    ("refill", 1, 1, 2, 3),  # group 0 made whole by one refill; group 1 fails its one refill too
])
def test_collect_step_refills_or_drops_over_real_sockets(tmp_path, policy, num_groups, dropped, refilled, failed):
    rows = [{"prompt": f"{i}+1=", "label": str(i + 1), "metadata": {"row": i}} for i in range(2)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = MoltConfig()
    cfg.data.train_path, cfg.data.shuffle = str(tmp_path / "train.jsonl"), False
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 2, 3
    cfg.agent.on_failed_rollout, cfg.agent.max_refills_per_group = policy, 1
    router, received = Router("127.0.0.1"), []
    rank = threading.Thread(target=_stand_in_rollout_rank, args=(router.address, "rollout-1", received), daemon=True)
    rank.start()
    controller = RolloutController(cfg, Mailbox(router, [1]))
    try:
        controller.wait_for_ranks(num_trainer_ranks=1)
        result = controller.collect_step(policy_version=7)
    finally:
        controller.shutdown()
        rank.join(10)
        router.close()
    assert (len(result.groups), result.dropped_groups, result.refilled_rollouts) == (num_groups, dropped, refilled)
    assert result.failures == {"agent_error": failed} and result.num_rollouts == 6 + refilled
    if policy == "refill":
        assert [len(group) for group in result.groups] == [3]  # complete, the refill in place of the failure
        originals, refills = {(r["group_id"], r["sample_index"]): r for r in received[:6]}, received[6:]
        assert [(r["group_id"], r["sample_index"]) for r in refills] == [(0, 0), (1, 0)]
        for refill in refills:  # the same request (prompt, metadata, policy version 7), a new rollout_id
            assert refill == {**originals[refill["group_id"], refill["sample_index"]], "rollout_id": refill["rollout_id"]}
        assert len({r["rollout_id"] for r in received}) == len(received) == 8


# -- filtering groups without signal (DAPO dynamic sampling) --------------------------------


def _group(scores: list[float], segments: list[int] | None = None) -> list[Experience]:
    """One group: rollout i has score scores[i] on each of its segments[i] segments (default one)."""
    segments = segments or [1] * len(scores)
    return [Experience(token_ids=[1, 2], action_mask=[0, 1], behavior_logprobs=[0.0, -0.5], policy_versions=[-1, 0],
                       reward=0.0, score=score, group_id=0, rollout_id=i, segment_index=k)
            for i, (score, num_segments) in enumerate(zip(scores, segments)) for k in range(num_segments)]


@pytest.mark.parametrize("scores, band, expected", [
    ([0, 0, 0], (0.0, 1.0), "all_low"),  # 0/1 rewards: all wrong
    ([1, 1, 1], (0.0, 1.0), "all_high"),  # all right
    ([0, 1, 0], (0.0, 1.0), ""),
    ([-0.5, 0.0], (0.0, 1.0), "all_low"),  # the band edges belong to the band's outside: <= low
    ([1.0, 2.0], (0.0, 1.0), "all_high"),  # >= high
    ([0.0, 1.0], (0.0, 1.0), ""),  # one at each edge: a spread, kept
    ([0.5, 0.5, 0.5], (0.0, 1.0), ""),  # equal but inside the band: kept (the rule is the band, not equality)
    ([0.2, 0.3], (0.3, 0.9), "all_low"),
    ([0.2, 0.4], (0.3, 0.9), ""),
    ([0.9, 0.95], (0.3, 0.9), "all_high"),
    ([0.85, 0.95], (0.3, 0.9), ""),
    ([1.0], (0.0, 1.0), "all_high"),
])
def test_group_filter_reason_follows_the_band(scores, band, expected):
    assert group_filter_reason(_group(scores), band) == expected


def test_group_filter_counts_each_rollout_once_whatever_its_segments():
    # Rollout 0 (score 0) has three segments, rollout 1 (score 0.5) one: taking experiences for
    # rollouts (say the first n_samples_per_prompt = 2 of them) would see only rollout 0 and call
    # the group all_low; per rollout, one score is inside the band, so the group is kept...
    assert group_filter_reason(_group([0.0, 0.5], segments=[3, 1]), (0.0, 1.0)) == ""
    # ...and a group whose every rollout sits at high is dropped however its segments split.
    assert group_filter_reason(_group([1.0, 1.0], segments=[1, 4]), (0.0, 1.0)) == "all_high"


def test_filter_groups_by_score_keeps_order_and_counts_reasons():
    groups = [_group([1, 1]), _group([0, 1]), _group([0, 0]), _group([1, 0]), _group([1, 1])]
    groups[1][0].reward, groups[3][0].reward = 11.0, 33.0  # tags to tell the kept ones apart
    kept, filtered = filter_groups_by_score(groups, (0.0, 1.0))
    assert [group[0].reward for group in kept] == [11.0, 33.0]
    assert filtered == Counter(all_high=2, all_low=1)


def test_step_rollouts_merge_appends_groups_and_adds_counts():
    first = StepRollouts(groups=[_group([0, 1])], failures=Counter(timeout=1), dropped_groups=1, num_rollouts=4,
                         filtered_groups=Counter(all_high=1), refilled_rollouts=1)
    later = StepRollouts(groups=[_group([1, 0])], failures=Counter(timeout=2, agent_error=1), num_rollouts=5,
                         filtered_groups=Counter(all_high=1, all_low=2), backfill_prompts=3)
    first.merge(later)
    assert [[e.score for e in g] for g in first.groups] == [[0, 1], [1, 0]]
    assert first.failures == Counter(timeout=3, agent_error=1)
    assert first.filtered_groups == Counter(all_high=2, all_low=2)
    assert (first.dropped_groups, first.num_rollouts, first.refilled_rollouts, first.backfill_prompts) == (1, 9, 1, 3)


def _scored_rollout_rank(address: str, identity: str, received: list[dict]) -> None:
    """Each prompt row says the reward of each sample (metadata 'rewards'); a row with 'flaky' fails
    sample 0 on its first attempt, one with 'broken' on every attempt."""
    def answer(request: dict, attempt: int) -> RolloutOutcome:
        metadata, sample = request["metadata"], request["sample_index"]
        if sample == 0 and (metadata.get("flaky") and attempt == 1 or metadata.get("broken")):
            return _outcome(request["rollout_id"], request["group_id"], failure="agent_error")
        return _outcome(request["rollout_id"], request["group_id"], reward=float(metadata["rewards"][sample]))
    _serve_rollouts(address, identity, received, answer)


def _run_steps(tmp_path, rows: list[dict], num_steps: int, **algorithm) -> tuple[list[StepRollouts], list[dict]]:
    """Run `num_steps` collect_steps (3 prompts x 2 samples, refill on) against the scored stand-in rank."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = MoltConfig()
    cfg.data.train_path, cfg.data.shuffle = str(tmp_path / "train.jsonl"), False
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 3, 2
    cfg.agent.on_failed_rollout, cfg.agent.max_refills_per_group = "refill", 1
    for key, value in algorithm.items():
        setattr(cfg.algorithm, key, value)
    router, received = Router("127.0.0.1"), []
    rank = threading.Thread(target=_scored_rollout_rank, args=(router.address, "rollout-1", received), daemon=True)
    rank.start()
    controller = RolloutController(cfg, Mailbox(router, [1]))
    try:
        controller.wait_for_ranks(num_trainer_ranks=1)
        steps = [controller.collect_step(policy_version=step) for step in range(num_steps)]
    finally:
        controller.shutdown()
        rank.join(10)
        router.close()
    return steps, received


def _rows(rewards: list[list[float]], flaky: tuple[int, ...] = (), broken: tuple[int, ...] = ()) -> list[dict]:
    return [{"prompt": f"q{i}", "label": "", "metadata": {"row": i, "rewards": r, "flaky": i in flaky,
                                                           "broken": i in broken}}
            for i, r in enumerate(rewards)]


def _dispatched_rows(received: list[dict]) -> list[int]:
    """The prompt row of each group, in dispatch order (a refill repeats its group, not its row)."""
    return [row for _, row in dict.fromkeys((r["group_id"], r["metadata"]["row"]) for r in received)]


def _kept_rows(step: StepRollouts, received: list[dict]) -> list[int]:
    row_of_group = {r["group_id"]: r["metadata"]["row"] for r in received}
    return [row_of_group[group[0].group_id] for group in step.groups]


def test_filtered_groups_are_backfilled_and_unused_rows_wait_for_the_next_step(tmp_path):
    rows = _rows([[0, 1], [1, 1], [1, 0],  # step 1: row 1 all right
                  [0, 0], [1, 0], [0, 1],  # backfill: row 3 all wrong, row 4 (flaky) fills the step; 5 waits
                  [1, 0], [0, 1], [1, 0],  # step 2 takes rows 5, 6, 7; 8 waits
                  [0, 1], [1, 0], [0, 1]], flaky=(4,))  # step 3 takes 8, 9, 10
    steps, received = _run_steps(tmp_path, rows, num_steps=3, filter_groups=True, max_backfill_prompts=6)
    first = steps[0]
    assert _kept_rows(first, received) == [0, 2, 4]  # dispatch order, exactly prompts_per_step groups
    assert first.filtered_groups == Counter(all_high=1, all_low=1)
    assert first.backfill_prompts == 2  # one prompt per round: only as many as groups are missing
    # The backfill round ran the same failed-rollout handling: row 4's failed sample was refilled.
    assert (first.refilled_rollouts, first.failures, first.num_rollouts) == (1, Counter(agent_error=1), 11)
    assert all(len(group) == 2 for group in first.groups)
    assert _kept_rows(steps[1], received) == [5, 6, 7] and _kept_rows(steps[2], received) == [8, 9, 10]
    assert steps[1].backfill_prompts == steps[2].backfill_prompts == 0
    # Every row once, in order: the rows a backfill left in the loader's batch were not lost.
    assert _dispatched_rows(received) == list(range(11))


@pytest.mark.parametrize("cap", [0, 1])
def test_backfill_stops_at_the_cap_and_the_step_trains_on_fewer_groups(tmp_path, caplog, cap):
    rows = _rows([[1, 1], [0, 0], [0, 1],  # one group of three has signal
                  [1, 1], [1, 1], [1, 1]])  # and so would none of the backfill
    with caplog.at_level(logging.WARNING, logger="molt"):
        steps, received = _run_steps(tmp_path, rows, num_steps=1, filter_groups=True, max_backfill_prompts=cap)
    step = steps[0]
    assert _kept_rows(step, received) == [2]
    assert step.backfill_prompts == cap and _dispatched_rows(received) == list(range(3 + cap))
    assert step.filtered_groups == Counter(all_high=1 + cap, all_low=1)
    assert f"step keeps 1 of 3 groups: algorithm.max_backfill_prompts={cap}" in caplog.text
    # Every rollout scored counts in the step's scored rewards, the filtered groups' too.
    assert sorted(step.scored_rewards) == sorted([1.0, 1.0, 0.0, 0.0, 0.0, 1.0] + [1.0, 1.0] * cap)


def test_a_group_dropped_for_failed_rollouts_is_backfilled_too(tmp_path):
    rows = _rows([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1], [1, 0]], broken=(1,))  # row 1 fails its refill too
    steps, received = _run_steps(tmp_path, rows, num_steps=1, filter_groups=True)
    step = steps[0]
    assert _kept_rows(step, received) == [0, 2, 3] and _dispatched_rows(received) == [0, 1, 2, 3]
    assert (step.dropped_groups, step.backfill_prompts, step.filtered_groups) == (1, 1, Counter())


def test_without_filter_groups_flat_groups_are_kept_and_nothing_is_backfilled(tmp_path):
    rows = _rows([[1, 1], [0, 0], [0, 1], [1, 0], [1, 0], [1, 0]])
    steps, received = _run_steps(tmp_path, rows, num_steps=1)
    assert _kept_rows(steps[0], received) == [0, 1, 2]
    assert steps[0].backfill_prompts == 0 and not steps[0].filtered_groups
    assert _dispatched_rows(received) == [0, 1, 2]


# -- streaming with bounded staleness (algorithm.max_staleness) -------------------------------


def _versioned_rollout_rank(address: str, identity: str, received: list[dict]) -> None:
    """Rewards from each row's metadata, as _scored_rollout_rank; the action token carries the
    request's policy version (what a rollout dispatched then and answered at once would record)."""
    def answer(request: dict, attempt: int) -> RolloutOutcome:
        reward = float(request["metadata"]["rewards"][request["sample_index"]])
        return RolloutOutcome(rollout_id=request["rollout_id"], group_id=request["group_id"], experiences=[Experience(
            token_ids=[1, 2], action_mask=[0, 1], behavior_logprobs=[0.0, -0.5],
            policy_versions=[-1, request["policy_version"]], reward=reward, score=reward,
            group_id=request["group_id"], rollout_id=request["rollout_id"])])
    _serve_rollouts(address, identity, received, answer)


def _stream_steps(tmp_path, rows: list[dict], versions: list[int], num_steps: int, **algorithm):
    """collect_step at each of `versions` (3 prompts x 2 samples, train.num_steps=num_steps); returns the
    steps and, for each, the requests the controller had dispatched when it returned."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = MoltConfig()
    cfg.data.train_path, cfg.data.shuffle = str(tmp_path / "train.jsonl"), False
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 3, 2
    cfg.train.num_steps = num_steps
    for key, value in algorithm.items():
        setattr(cfg.algorithm, key, value)
    router, received = Router("127.0.0.1"), []
    rank = threading.Thread(target=_versioned_rollout_rank, args=(router.address, "rollout-1", received), daemon=True)
    rank.start()
    controller = RolloutController(cfg, Mailbox(router, [1]))
    steps, seen, dispatched = [], [], []
    send = router.send
    router.send = lambda identity, message: (dispatched.append(message["request"]) if message["type"] == "rollout"
                                             else None, send(identity, message))
    try:
        controller.wait_for_ranks(num_trainer_ranks=1)
        for version in versions:
            steps.append(controller.collect_step(policy_version=version))
            seen.append(list(dispatched))
    finally:
        controller.shutdown()
        rank.join(10)
        router.close()
    return steps, seen


def _dispatch_versions(requests: list[dict]) -> dict[int, int]:
    """Prompt row -> the policy version its group was dispatched at."""
    return {r["metadata"]["row"]: r["policy_version"] for r in requests}


def _check_accounting(step: StepRollouts) -> None:
    totals = step.accounting
    dropped = sum(totals[f"rollout/dropped_{reason}_total"] for reason in ("failed", "failed_group", "filtered", "stale"))
    assert totals["rollout/dropped_total"] == dropped
    assert totals["rollout/dispatched_total"] == totals["rollout/consumed_total"] + dropped + totals["rollout/in_flight"]


def test_max_staleness_one_dispatches_the_next_step_ahead_and_keeps_the_sync_batches(tmp_path):
    rows = _rows([[0, 1]] * 12)
    steps, seen = _stream_steps(tmp_path, rows, versions=[0, 1, 2], num_steps=3, max_staleness=1)
    # The same prompts per step as the synchronous controller: dispatch order, prompts_per_step each.
    assert [_kept_rows(step, seen[-1]) for step in steps] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    # At version 0 the groups of steps 1 and 2 went out; at version 1 those of step 3; none past
    # train.num_steps (rows 9.. never dispatched).
    assert _dispatch_versions(seen[0]) == {0: 0, 1: 0, 2: 0, 3: 0, 4: 0, 5: 0}
    assert _dispatch_versions(seen[-1]) == {**_dispatch_versions(seen[0]), 6: 1, 7: 1, 8: 1}
    assert [step.accounting["rollout/in_flight"] for step in steps] == [6, 6, 0]
    for step in steps:
        _check_accounting(step)
        metrics = compute_staleness(step.groups, step.trained_version)
        assert metrics["staleness/max"] <= 1
    assert compute_staleness(steps[1].groups, 1)["staleness/mean"] == 1.0  # step 2 trained rollouts of version 0
    assert steps[-1].accounting["rollout/consumed_total"] == 18


def test_max_staleness_zero_keeps_nothing_in_flight_between_steps(tmp_path):
    steps, seen = _stream_steps(tmp_path, _rows([[0, 1]] * 9), versions=[0, 1, 2], num_steps=5)
    for version, (step, requests) in enumerate(zip(steps, seen)):
        assert step.accounting["rollout/in_flight"] == 0
        assert step.accounting["rollout/dispatched_total"] == step.accounting["rollout/consumed_total"] == 6 * (version + 1)
        assert max(r["policy_version"] for r in requests) == version  # nothing dispatched ahead of its step
        assert compute_staleness(step.groups, version)["staleness/max"] == 0


def test_a_group_older_than_the_bound_is_dropped_as_stale_and_counted(tmp_path):
    # The safety net: a trainer that jumped versions (0 -> 3) finds the groups dispatched at version
    # 0 for step 2 three versions old; with max_staleness=1 they are dropped, and fresh ones backfill.
    rows = _rows([[0, 1]] * 12)
    steps, seen = _stream_steps(tmp_path, rows, versions=[0, 3], num_steps=10, max_staleness=1,
                                filter_groups=True)
    late = steps[1]
    assert late.stale_groups == 3 and late.dropped_rollouts == Counter(stale=6)
    assert _kept_rows(late, seen[-1]) == [6, 7, 8] and late.backfill_prompts == 3
    assert compute_staleness(late.groups, 3)["staleness/max"] == 0
    _check_accounting(late)
    assert late.accounting["rollout/dropped_stale_total"] == 6


def test_filtered_groups_borrow_from_the_queue_under_streaming(tmp_path):
    rows = _rows([[0, 1], [1, 1], [0, 1],  # step 1: row 1 all right, replaced by row 3 (queued for step 2)
                  [1, 0], [0, 1], [1, 0],
                  [0, 1], [1, 0], [0, 1], [1, 0], [0, 1], [1, 0]])
    steps, seen = _stream_steps(tmp_path, rows, versions=[0, 1], num_steps=4, max_staleness=1, filter_groups=True)
    assert _kept_rows(steps[0], seen[-1]) == [0, 2, 3] and steps[0].backfill_prompts == 1
    assert steps[0].filtered_groups == Counter(all_high=1) and steps[0].dropped_rollouts == Counter(filtered=2)
    assert _kept_rows(steps[1], seen[-1]) == [4, 5, 6]
    assert _dispatch_versions(seen[-1])[6] == 1  # the top-up at version 1 made up for the borrowed group
    for step in steps:
        _check_accounting(step)


def test_accounting_that_does_not_add_up_raises():
    accounting = Accounting(dispatched=10, consumed=6, dropped=Counter(failed=1, filtered=2))
    assert accounting.check(in_flight=1)["rollout/dispatched_total"] == 10
    with pytest.raises(AccountingError, match=r"dispatched 10 != consumed 6 \+ dropped 3 .* \+ in flight 2"):
        accounting.check(in_flight=2)


def _turns(versions: list[int]) -> Experience:
    """A two-turn trace: prompt, turn 1 (2 tokens), observation, turn 2 (2 tokens); `versions`: per action."""
    mask = [0, 0, 1, 1, 0, 1, 1]
    per_token = iter(versions)
    return Experience(token_ids=[10, 11, 12, 13, 14, 15, 16], action_mask=mask,
                      behavior_logprobs=[0.0 if not m else -0.5 * i for i, m in enumerate(mask)],
                      policy_versions=[next(per_token) if m else -1 for m in mask], reward=1.0, score=1.0,
                      group_id=3, rollout_id=9, truncated=True)


def test_without_partial_rollout_a_rollout_is_split_where_its_version_changes():
    outcome = RolloutOutcome(rollout_id=9, group_id=3, experiences=[_turns([4, 4, 5, 5])], ledger={"first_turn": 1})
    split_by_version(outcome)
    first, second = outcome.experiences
    assert first.token_ids == [10, 11, 12, 13] and first.action_mask == [0, 0, 1, 1]
    assert first.policy_versions == [-1, -1, 4, 4] and first.behavior_logprobs == [0.0, 0.0, -1.0, -1.5]
    assert not first.truncated
    # The earlier turn is context of the new segment: same ids, no action, no log-prob, no version.
    assert second.token_ids == [10, 11, 12, 13, 14, 15, 16] and second.action_mask == [0, 0, 0, 0, 0, 1, 1]
    assert second.policy_versions == [-1] * 5 + [5, 5]
    assert second.behavior_logprobs == [0.0] * 5 + [-2.5, -3.0] and second.truncated
    assert [e.segment_index for e in outcome.experiences] == [0, 1]
    assert outcome.ledger == {"first_turn": 1, "version_change": 1}
    assert sum(sum(e.action_mask) for e in outcome.experiences) == 4  # every action token trained once


def test_a_single_version_rollout_is_left_alone():
    outcome = RolloutOutcome(rollout_id=9, group_id=3, experiences=[_turns([4, 4, 4, 4])])
    split_by_version(outcome)
    assert len(outcome.experiences) == 1 and outcome.ledger == {}
