"""The rollout controller (rank 0): owns the prompt stream, dispatches single rollouts to the
rollout ranks, refills or drops groups with a failed rollout, gathers complete groups, and
assembles each step's batch.

This is the synchronous controller: a step dispatches its prompts, waits for their groups and
hands them to the trainer; refits happen with no rollout in flight.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from molt.agents.base import RolloutOutcome
from molt.config import AgentConfig, MoltConfig
from molt.dataset import build_prompt_loader
from molt.experience import Experience
from molt.rollout import decode_outcome
from molt.wire import Router

logger = logging.getLogger("molt")


class RolloutRankError(RuntimeError):
    """A rollout rank reported a failure; the message names the rank."""


@dataclass
class StepRollouts:
    """The complete groups of one step, plus what happened to the rest."""

    groups: list[list[Experience]]  # each inner list: every segment of every rollout of one prompt
    failures: Counter = field(default_factory=Counter)  # failed rollouts by reason
    dropped_groups: int = 0
    refilled_rollouts: int = 0  # replacement rollouts dispatched for failed ones (agent.on_failed_rollout='refill')
    num_rollouts: int = 0  # rollouts run, refills included
    ledger: Counter = field(default_factory=Counter)  # ChatAgent turns by how they joined a segment


class RolloutController:
    def __init__(self, cfg: MoltConfig, router: Router, rollout_ranks: list[int]):
        self.cfg = cfg
        self.router = router
        self.rollout_ranks = rollout_ranks
        self.loader = build_prompt_loader(cfg.data.train_path, batch_size=cfg.rollout.prompts_per_step,
                                          shuffle=cfg.data.shuffle, seed=cfg.seed)
        self._prompts = iter(self.loader)
        self.epoch = 0
        self._rollout_ids = itertools.count()
        self._group_ids = itertools.count()
        self._next_rank = itertools.cycle(rollout_ranks)
        self._backlog: list[tuple[str, dict]] = []

    # -- plumbing --------------------------------------------------------------------------

    def send_to_rollout_ranks(self, message: dict) -> None:
        for rank in self.rollout_ranks:
            self.router.send(f"rollout-{rank}", message)

    def expect(self, message_type: str, count: int, timeout_seconds: float, what: str) -> list[dict]:
        """Wait for `count` messages of one type; an error report or the deadline raises."""
        deadline = time.monotonic() + timeout_seconds
        received = [m for _, m in self._backlog if m["type"] == message_type][:count]
        self._backlog = [(i, m) for i, m in self._backlog if not any(m is r for r in received)]
        while len(received) < count:
            try:
                identity, message = self.router.receive_until(deadline)
            except TimeoutError:
                raise TimeoutError(f"{what}: got {len(received)} of {count} replies within {timeout_seconds:.0f}s; "
                                   f"a rank may be stuck or dead") from None
            if message["type"] in ("failed", "error"):
                raise RolloutRankError(f"{what}: {identity} reported {message.get('during', 'start-up')} failure: "
                                       f"{message['error']}")
            if message["type"] != message_type:
                self._backlog.append((identity, message))  # an early reply to a later wait
                continue
            received.append(message)
        return received

    def wait_for_ranks(self, num_trainer_ranks: int) -> None:
        """Every other trainer rank says hello (so the router can address it), every engine says ready."""
        self.expect("hello", num_trainer_ranks - 1, 120, "trainer ranks connecting")
        self.expect("ready", len(self.rollout_ranks), self.cfg.rollout.engine_start_timeout_seconds, "engine start")

    # -- prompts and rollouts --------------------------------------------------------------

    def next_prompts(self) -> list:
        try:
            return next(self._prompts)
        except StopIteration:
            self.epoch += 1
            logger.info("prompt set exhausted; starting epoch %d", self.epoch)
            self._prompts = iter(self.loader)
            return next(self._prompts)

    def collect_step(self, policy_version: int) -> StepRollouts:
        """Dispatch one step's prompts as single rollouts and wait until each has finished. Under
        agent.on_failed_rollout='refill' a failed rollout is re-run, so its group stays complete."""
        cfg = self.cfg
        requests: dict[int, dict] = {}  # by rollout_id; a refill re-sends one with a new id
        group_sizes: dict[int, int] = {}
        for row in self.next_prompts():
            group_id = next(self._group_ids)
            group_sizes[group_id] = cfg.rollout.n_samples_per_prompt
            for sample_index in range(cfg.rollout.n_samples_per_prompt):
                self.dispatch(requests, {
                    "group_id": group_id, "sample_index": sample_index,
                    "messages": row.messages, "label": row.label, "tools": row.tools,
                    "sampling": {"max_tokens": cfg.rollout.max_response_tokens,
                                 "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p},
                    "max_length": cfg.rollout.max_length, "max_turns": cfg.agent.max_turns,
                    "policy_version": policy_version, "metadata": row.metadata,
                })
        # Each rollout ends by itself within the rollout timeout, so a longer silence (allowing for
        # queueing behind others) means a stuck rank. Every dispatched rollout is waited for, refills too.
        timeout = cfg.agent.rollout_timeout_seconds * 2 + 60
        outcomes, refills = [], Counter()  # refills: by group_id
        while len(outcomes) < len(requests):
            what = f"rollouts ({len(outcomes)} of {len(requests)} back)"
            outcome = decode_outcome(self.expect("outcome", 1, timeout, what)[0])
            outcomes.append(outcome)
            if not outcome.failure:
                continue
            if should_refill(refills[outcome.group_id], cfg.agent):
                refills[outcome.group_id] += 1
                replacement = {**requests[outcome.rollout_id], "policy_version": policy_version}
                fate = f"refilled as rollout {self.dispatch(requests, replacement)}"
            else:
                fate = "its group is dropped" + (" (agent.max_refills_per_group used up)"
                                                 if cfg.agent.on_failed_rollout == "refill" else "")
            logger.warning("rollout %d failed (%s): %s; %s", outcome.rollout_id, outcome.failure, outcome.error, fate)
        result = gather_groups(outcomes, group_sizes)
        result.refilled_rollouts = sum(refills.values())
        return result

    def dispatch(self, requests: dict[int, dict], request: dict) -> int:
        """Send one rollout request, under a fresh rollout_id, to the next rollout rank."""
        request = {**request, "rollout_id": next(self._rollout_ids)}
        requests[request["rollout_id"]] = request
        self.router.send(f"rollout-{next(self._next_rank)}", {"type": "rollout", "request": request})
        return request["rollout_id"]

    # -- refit and probes ------------------------------------------------------------------

    def score_on_engines(self, token_ids: list[int], timeout_seconds: float) -> list[list[float]]:
        self.send_to_rollout_ranks({"type": "score", "token_ids": token_ids})
        replies = self.expect("scored", len(self.rollout_ranks), timeout_seconds, "refit check")
        return [r["logprobs"] for r in replies]

    def shutdown(self) -> None:
        self.send_to_rollout_ranks({"type": "shutdown"})


def should_refill(num_refills: int, agent: AgentConfig) -> bool:
    """Whether a failed rollout is re-run, given the refills its group already had this step."""
    return agent.on_failed_rollout == "refill" and num_refills < agent.max_refills_per_group


def gather_groups(outcomes: list[RolloutOutcome], group_sizes: dict[int, int]) -> StepRollouts:
    """Keep each group with a successful rollout for every sample (a refill makes up for a failed
    one); drop the rest, since a group with a hole would bias its baseline. Counts every failure."""
    by_group = defaultdict(list)
    result = StepRollouts(groups=[], num_rollouts=len(outcomes))
    for outcome in outcomes:
        result.ledger.update(outcome.ledger)
        if outcome.failure:
            result.failures[outcome.failure] += 1
        else:
            by_group[outcome.group_id].append(outcome)
    for group_id, size in group_sizes.items():
        members = sorted(by_group[group_id], key=lambda o: o.rollout_id)
        if len(members) < size:
            result.dropped_groups += 1
            continue
        result.groups.append([e for o in members for e in o.experiences])
    return result
