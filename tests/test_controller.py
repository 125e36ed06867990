"""The rollout controller: which groups a step keeps, and refilling failed rollouts (agent.on_failed_rollout)."""

import json
import threading

import pytest

from molt.agents.base import RolloutOutcome
from molt.config import AgentConfig, MoltConfig
from molt.controller import RolloutController, gather_groups, should_refill
from molt.experience import Experience
from molt.rollout import encode_outcome
from molt.wire import Router, connect_dealer, pack, unpack


def _outcome(rollout_id: int, group_id: int, failure: str = "") -> RolloutOutcome:
    experiences = [] if failure else [Experience(
        token_ids=[1, 2], action_mask=[0, 1], behavior_logprobs=[0.0, -0.5], policy_versions=[-1, 0],
        reward=float(rollout_id), score=float(rollout_id), group_id=group_id, rollout_id=rollout_id)]
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


def _stand_in_rollout_rank(address: str, identity: str, received: list[dict]) -> None:
    """Answers rollout requests as a rollout rank would: sample 0 of group 0 fails on its first
    attempt only, sample 0 of group 1 fails on every attempt, everything else succeeds."""
    socket = connect_dealer(address, identity)
    socket.send(pack({"type": "ready", "rank": 1}))
    while (message := unpack(socket.recv()))["type"] != "shutdown":
        request = message["request"]
        received.append(request)
        attempts = sum(r["group_id"] == request["group_id"] and r["sample_index"] == request["sample_index"]
                       for r in received)
        fails = request["sample_index"] == 0 and (request["group_id"] == 1 or attempts == 1 and request["group_id"] == 0)
        outcome = _outcome(request["rollout_id"], request["group_id"], failure="agent_error" if fails else "")
        socket.send(pack(encode_outcome(outcome)))
    socket.close(0)


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
    controller = RolloutController(cfg, router, rollout_ranks=[1])
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
