"""Engine routing: a group's rollouts run on one engine while load allows, otherwise the
least-loaded engine by outstanding tokens takes the next rollout (molt.controller.pool.EngineRouter),
and the controller dispatches, refills and resumes through it."""

import json
import threading

import pytest

from molt.agents.base import RolloutOutcome
from molt.config import MoltConfig
from molt.controller.engine_router import EngineRouter, estimate_rollout_tokens
from molt.controller.pool import RolloutController
from molt.trace.experience import Experience
from molt.transport.dispatch import encode_outcome
from molt.transport.mailbox import Mailbox
from molt.transport.wire import Router, connect_dealer, pack, unpack

RANKS = [1, 2]


def _place_groups(router: EngineRouter, group_ids: list[int], group_size: int, num_tokens: int,
                  first_rollout_id: int = 0) -> dict[int, list[int]]:
    """Place each group's rollouts in dispatch order; the rank of each rollout, by group."""
    rollout_id, placed = first_rollout_id, {}
    for group_id in group_ids:
        placed[group_id] = [router.place(rollout_id + i, group_id, group_size, num_tokens) for i in range(group_size)]
        rollout_id += group_size
    return placed


def test_each_group_lands_whole_on_one_rank_and_groups_alternate():
    router = EngineRouter(RANKS)
    placed = _place_groups(router, [0, 1, 2, 3], group_size=4, num_tokens=100)
    assert placed == {0: [1] * 4, 1: [2] * 4, 2: [1] * 4, 3: [2] * 4}
    assert router.outstanding == {1: 800, 2: 800}


def test_without_affinity_a_group_spreads_over_the_ranks():
    router = EngineRouter(RANKS, group_affinity=False)
    placed = _place_groups(router, [0, 1], group_size=4, num_tokens=100)
    assert placed == {0: [1, 2, 1, 2], 1: [2, 1, 2, 1]}


def test_the_least_loaded_rank_by_tokens_takes_new_groups():
    router = EngineRouter([1, 2, 3])
    big = _place_groups(router, [0], group_size=2, num_tokens=500)  # rank 1: 1000 tokens
    small = _place_groups(router, [1, 2, 3, 4], group_size=2, num_tokens=100, first_rollout_id=2)
    assert big == {0: [1, 1]}
    # Ranks 2 and 3 take the small groups until they carry as much as rank 1 (ties from group_id mod 3).
    assert small == {1: [2, 2], 2: [3, 3], 3: [2, 2], 4: [3, 3]}
    assert router.outstanding == {1: 1000, 2: 400, 3: 400}


def test_a_refill_goes_home_while_its_rank_is_within_a_group_of_the_least_loaded():
    router = EngineRouter(RANKS)
    _place_groups(router, [0, 1], group_size=4, num_tokens=100)  # group 0 on rank 1, group 1 on rank 2
    router.release(0)  # rollout 0 (group 0) failed: its tokens are released, a refill follows
    assert router.place(8, group_id=0, group_size=4, num_tokens=100) == 1
    assert router.outstanding == {1: 400, 2: 400}


def test_a_refill_spills_to_the_least_loaded_rank_when_its_home_is_overloaded():
    router = EngineRouter(RANKS)
    _place_groups(router, [0, 1, 2], group_size=4, num_tokens=100)  # groups 0, 2 on rank 1; group 1 on rank 2
    for rollout_id in range(4, 8):  # group 1 is back
        router.release(rollout_id)
    router.release(0)  # a rollout of group 0 failed
    # Rank 1 carries 700 tokens, rank 2 none: 700 + 100 > 0 + one group (400), so rank 2 takes the refill.
    assert router.place(12, group_id=0, group_size=4, num_tokens=100) == 2
    router.release(8)  # group 2 drains from rank 1 ...
    router.release(9)
    router.release(10)
    router.release(11)
    router.release(1)  # ... and a second rollout of group 0 fails: home (200 + 100 <= 100 + 400) takes it back
    assert router.place(13, group_id=0, group_size=4, num_tokens=100) == 1


def test_release_frees_a_rollouts_tokens_once():
    router = EngineRouter(RANKS)
    _place_groups(router, [0], group_size=2, num_tokens=100)
    router.release(0)
    assert router.outstanding == {1: 100, 2: 0}
    router.release(1)
    assert router.outstanding == {1: 0, 2: 0}
    with pytest.raises(KeyError):
        router.release(1)  # released already: a second outcome for one rollout is a bug


def test_placement_is_a_function_of_the_dispatch_sequence():
    """Two routers fed the same dispatches and outcomes place alike, and once everything is back a
    used router places like a fresh one (a resumed run starts fresh: the router is not saved)."""
    routers = [EngineRouter(RANKS), EngineRouter(RANKS)]
    for router in routers:
        _place_groups(router, [0, 1, 2], group_size=3, num_tokens=50)
        for rollout_id in (4, 0, 8, 1):
            router.release(rollout_id)
    later = [_place_groups(router, [3, 4], group_size=3, num_tokens=70, first_rollout_id=9) for router in routers]
    assert later[0] == later[1]
    used = routers[0]
    for rollout_id in [2, 3, 5, 6, 7, *range(9, 15)]:
        used.release(rollout_id)
    for group_id in range(5):
        used.forget_group(group_id)
    assert _place_groups(used, [5, 6, 7], 2, 30, 20) == _place_groups(EngineRouter(RANKS), [5, 6, 7], 2, 30, 20)


def test_the_token_estimate_counts_the_prompt_and_every_turn_it_may_sample():
    request = {"messages": [{"role": "user", "content": "x" * 400}], "tools": None,
               "sampling": {"max_tokens": 16}, "max_turns": 3}
    assert estimate_rollout_tokens(request) == len(json.dumps([request["messages"], None])) // 4 + 48
    longer = {**request, "messages": [{"role": "user", "content": "x" * 800}]}
    assert estimate_rollout_tokens(longer) == estimate_rollout_tokens(request) + 100


# -- the controller dispatching through the router, over real sockets -------------------------


def _stand_in_rank(address: str, rank: int, received: list[tuple[int, dict]]) -> None:
    """A rollout rank that answers every request at once. Sample 0 of group 0 fails on its first
    attempt. Its engine 'prefills' 10 tokens for a prompt it has not seen and 2 for one it has,
    and reports the running totals with each outcome, as molt.rollout.rank does."""
    socket = connect_dealer(address, f"rollout-{rank}")
    socket.send(pack({"type": "ready", "rank": rank}))
    seen, prompt_tokens, prefill_tokens = set(), 0, 0
    while (message := unpack(socket.recv()))["type"] != "shutdown":
        request = message["request"]
        received.append((rank, request))
        attempt = sum(r["group_id"] == request["group_id"] and r["sample_index"] == request["sample_index"]
                      for _, r in received)
        prompt = json.dumps(request["messages"])
        prompt_tokens, prefill_tokens = prompt_tokens + 10, prefill_tokens + (2 if prompt in seen else 10)
        seen.add(prompt)
        fails = request["group_id"] == 0 and request["sample_index"] == 0 and attempt == 1
        outcome = RolloutOutcome(
            rollout_id=request["rollout_id"], group_id=request["group_id"], failure="agent_error" if fails else "",
            experiences=[] if fails else [Experience(
                token_ids=[1, 2], action_mask=[0, 1], behavior_logprobs=[0.0, -0.5], policy_versions=[-1, 0],
                reward=float(request["sample_index"]), score=0.0, group_id=request["group_id"],
                rollout_id=request["rollout_id"])])
        totals = {"rollout/prompt_tokens_total": float(prompt_tokens), "rollout/prefill_tokens_total": float(prefill_tokens)}
        socket.send(pack({**encode_outcome(outcome), "rank": rank, "rank_metrics": totals}))
    socket.close(0)


def _run_controller(cfg: MoltConfig, num_steps: int, first_step: int = 0, state: dict | None = None):
    """Run `num_steps` collect_steps against two stand-in ranks; each step's result, the requests
    each rank received, and the controller's state at the end."""
    router, received = Router("127.0.0.1"), []
    ranks = [threading.Thread(target=_stand_in_rank, args=(router.address, rank, received), daemon=True)
             for rank in RANKS]
    for thread in ranks:
        thread.start()
    controller = RolloutController(cfg, Mailbox(router, RANKS))
    if state is not None:
        controller.load_state_dict(state)
    try:
        controller.wait_for_ranks(num_trainer_ranks=1)
        steps = [controller.collect_step(policy_version=v) for v in range(first_step, first_step + num_steps)]
        state = controller.state_dict()
    finally:
        controller.shutdown()
        for thread in ranks:
            thread.join(10)
        router.close()
    return steps, received, state


def _config(tmp_path, **rollout) -> MoltConfig:
    rows = [{"prompt": f"{i}+1=", "label": str(i + 1), "metadata": {"row": i}} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = MoltConfig()
    cfg.data.train_path, cfg.data.shuffle = str(tmp_path / "train.jsonl"), False
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 2, 3
    cfg.agent.on_failed_rollout, cfg.agent.max_refills_per_group = "refill", 1
    for key, value in rollout.items():
        setattr(cfg.rollout, key, value)
    return cfg


def _ranks_by_group(received: list[tuple[int, dict]]) -> dict[int, list[int]]:
    ranks: dict[int, list[int]] = {}
    for rank, request in received:
        ranks.setdefault(request["group_id"], []).append(rank)
    return ranks


def test_the_controller_keeps_each_group_and_its_refill_on_one_rank_and_logs_prefill_per_step(tmp_path):
    steps, received, _ = _run_controller(_config(tmp_path), num_steps=2)
    # Group 0's failed sample 0 is refilled on its home rank (4 requests); groups alternate ranks.
    assert _ranks_by_group(received) == {0: [1] * 4, 1: [2] * 3, 2: [1] * 3, 3: [2] * 3}
    assert all(len(step.groups) == 2 for step in steps)
    # Per step, summed over the ranks: each rank saw each of its groups' prompts once in full.
    first, second = (step.rank_metrics for step in steps)
    assert (first["rollout/prompt_tokens"], first["rollout/prefill_tokens"]) == (70, 10 + 2 * 3 + 10 + 2 * 2)
    assert (second["rollout/prompt_tokens"], second["rollout/prefill_tokens"]) == (60, 2 * (10 + 2 * 2))
    assert second["rollout/prompt_tokens_total"] == 130


def test_without_affinity_the_controller_spreads_each_group_and_prefills_more(tmp_path):
    steps, received, _ = _run_controller(_config(tmp_path, group_affinity=False), num_steps=2)
    assert all(len(set(ranks)) == 2 for ranks in _ranks_by_group(received).values())
    assert steps[1].rank_metrics["rollout/prefill_tokens"] == 2 * (10 + 10 + 2)


def test_a_resumed_synchronous_run_places_its_rollouts_as_the_uninterrupted_run(tmp_path):
    cfg = _config(tmp_path)
    _, uninterrupted, _ = _run_controller(cfg, num_steps=3)
    _, before, state = _run_controller(cfg, num_steps=1)
    _, after, _ = _run_controller(cfg, num_steps=2, first_step=1, state=json.loads(json.dumps(state)))

    def placements(received):
        return sorted((r["group_id"], r["sample_index"], r["rollout_id"], rank) for rank, r in received)
    assert placements(before + after) == placements(uninterrupted)
