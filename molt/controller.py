"""The rollout controller (rank 0): owns the prompt stream, dispatches single rollouts to the
rollout ranks, gathers complete groups, and assembles each step's batch.

This is the synchronous controller: a step dispatches its prompts, waits for their groups and
hands them to the trainer; refits happen with no rollout in flight.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from molt.config import MoltConfig
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
    num_rollouts: int = 0
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
        """Dispatch one step's prompts as single rollouts and wait until each has finished."""
        cfg = self.cfg
        group_sizes: dict[int, int] = {}
        for row in self.next_prompts():
            group_id = next(self._group_ids)
            group_sizes[group_id] = cfg.rollout.n_samples_per_prompt
            for sample_index in range(cfg.rollout.n_samples_per_prompt):
                request = {
                    "rollout_id": next(self._rollout_ids), "group_id": group_id, "sample_index": sample_index,
                    "messages": row.messages, "label": row.label, "tools": row.tools,
                    "sampling": {"max_tokens": cfg.rollout.max_response_tokens,
                                 "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p},
                    "max_length": cfg.rollout.max_length, "max_turns": cfg.agent.max_turns,
                    "policy_version": policy_version, "metadata": row.metadata,
                }
                self.router.send(f"rollout-{next(self._next_rank)}", {"type": "rollout", "request": request})
        num_rollouts = sum(group_sizes.values())
        # Each rollout ends by itself within the rollout timeout; allow for queueing behind others.
        timeout = cfg.agent.rollout_timeout_seconds * 2 + 60
        outcomes = [decode_outcome(m) for m in self.expect("outcome", num_rollouts, timeout, "rollouts")]
        return self._gather_groups(outcomes, group_sizes)

    def _gather_groups(self, outcomes, group_sizes: dict[int, int]) -> StepRollouts:
        by_group = defaultdict(list)
        result = StepRollouts(groups=[], num_rollouts=len(outcomes))
        for outcome in outcomes:
            by_group[outcome.group_id].append(outcome)
            result.ledger.update(outcome.ledger)
        for group_id in group_sizes:
            members = by_group[group_id]
            failed = [o for o in members if o.failure]
            for outcome in failed:
                result.failures[outcome.failure] += 1
                logger.warning("rollout %d failed (%s): %s", outcome.rollout_id, outcome.failure, outcome.error)
            if failed:
                result.dropped_groups += 1  # a group with a hole would bias its baseline
                continue
            result.groups.append([e for o in sorted(members, key=lambda o: o.rollout_id) for e in o.experiences])
        return result

    # -- refit and probes ------------------------------------------------------------------

    def score_on_engines(self, token_ids: list[int], timeout_seconds: float) -> list[list[float]]:
        self.send_to_rollout_ranks({"type": "score", "token_ids": token_ids})
        replies = self.expect("scored", len(self.rollout_ranks), timeout_seconds, "refit check")
        return [r["logprobs"] for r in replies]

    def shutdown(self) -> None:
        self.send_to_rollout_ranks({"type": "shutdown"})
