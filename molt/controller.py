"""The rollout controller (rank 0): owns the prompt stream, dispatches single rollouts to the
rollout ranks, refills or drops groups with a failed rollout, gathers complete groups, filters
groups without signal and backfills them (DAPO dynamic sampling), and assembles each step's batch.

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
from molt.dataset import PromptRow, build_prompt_loader
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
    dropped_groups: int = 0  # groups dropped for a failed rollout
    refilled_rollouts: int = 0  # replacement rollouts dispatched for failed ones (agent.on_failed_rollout='refill')
    num_rollouts: int = 0  # rollouts run, refills included
    ledger: Counter = field(default_factory=Counter)  # ChatAgent turns by how they joined a segment
    filtered_groups: Counter = field(default_factory=Counter)  # complete groups dropped for no signal, by reason
    backfill_prompts: int = 0  # prompts dispatched after the first round to replace lost groups

    def merge(self, later: StepRollouts) -> None:
        """Add a later round of the same step: its groups go after these (dispatch order), counts add up."""
        self.groups += later.groups
        self.failures.update(later.failures)
        self.dropped_groups += later.dropped_groups
        self.refilled_rollouts += later.refilled_rollouts
        self.num_rollouts += later.num_rollouts
        self.ledger.update(later.ledger)
        self.filtered_groups.update(later.filtered_groups)
        self.backfill_prompts += later.backfill_prompts


class RolloutController:
    def __init__(self, cfg: MoltConfig, router: Router, rollout_ranks: list[int]):
        self.cfg = cfg
        self.router = router
        self.rollout_ranks = rollout_ranks
        self.loader = build_prompt_loader(cfg.data.train_path, batch_size=cfg.rollout.prompts_per_step,
                                          shuffle=cfg.data.shuffle, seed=cfg.seed)
        self._prompts = iter(self.loader)
        # Rows the loader handed out that no step has dispatched yet (a backfill takes fewer rows
        # than a batch); the next call takes them first, so no row is skipped or repeated. The
        # loader's own state is ahead of the dispatched rows by exactly these.
        self._pending_rows: list[PromptRow] = []
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

    def next_prompts(self, count: int) -> list[PromptRow]:
        """The next `count` rows of the prompt stream, unused rows of earlier batches first."""
        while len(self._pending_rows) < count:
            self._pending_rows += self.next_prompt_batch()
        rows, self._pending_rows = self._pending_rows[:count], self._pending_rows[count:]
        return rows

    def next_prompt_batch(self) -> list[PromptRow]:
        """One batch (rollout.prompts_per_step rows) from the loader; a new epoch starts when it runs out."""
        try:
            return next(self._prompts)
        except StopIteration:
            self.epoch += 1
            logger.info("prompt set exhausted; starting epoch %d", self.epoch)
            self._prompts = iter(self.loader)
            return next(self._prompts)

    def collect_step(self, policy_version: int) -> StepRollouts:
        """Run one step's rollout.prompts_per_step prompts as groups and return the groups kept.

        Under algorithm.filter_groups (DAPO dynamic sampling, Yu et al. 2025, arXiv:2503.14476)
        a step that lost groups, to the filter or to failed rollouts, runs fresh prompts as new
        groups, round after round, until it has rollout.prompts_per_step groups or has used
        algorithm.max_backfill_prompts extra prompts. A round dispatches only as many prompts as
        groups are missing, so a step never has more than rollout.prompts_per_step groups and no
        finished group is thrown away for being one too many."""
        target, algo = self.cfg.rollout.prompts_per_step, self.cfg.algorithm
        result = self.run_groups(self.next_prompts(target), policy_version)
        cap = algo.max_backfill_prompts if algo.filter_groups else 0
        while (missing := target - len(result.groups)) > 0 and result.backfill_prompts < cap:
            rows = self.next_prompts(min(missing, cap - result.backfill_prompts))
            result.merge(self.run_groups(rows, policy_version))
            result.backfill_prompts += len(rows)
        if algo.filter_groups and len(result.groups) < target:
            logger.warning("step keeps %d of %d groups: algorithm.max_backfill_prompts=%d extra prompts used up "
                           "(filtered: %s, dropped for failed rollouts: %d); it trains on fewer groups",
                           len(result.groups), target, cap, dict(result.filtered_groups), result.dropped_groups)
        return result

    def run_groups(self, rows: list[PromptRow], policy_version: int) -> StepRollouts:
        """Dispatch each row as a group of single rollouts and wait until each has finished; keep the
        complete groups, minus those without signal under algorithm.filter_groups. Under
        agent.on_failed_rollout='refill' a failed rollout is re-run, so its group stays complete."""
        cfg = self.cfg
        requests: dict[int, dict] = {}  # by rollout_id; a refill re-sends one with a new id
        group_sizes: dict[int, int] = {}
        for row in rows:
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
        if cfg.algorithm.filter_groups:
            result.groups, result.filtered_groups = filter_groups_by_score(result.groups, cfg.algorithm.filter_band)
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


def group_filter_reason(group: list[Experience], filter_band: tuple[float, float]) -> str:
    """Why a group carries no learning signal, or '' when it does (DAPO dynamic sampling, Yu et al.
    2025, arXiv:2503.14476): 'all_low' when every rollout's score is <= low, 'all_high' when every
    one is >= high. Each rollout counts once, whatever its number of segments (they share its score)."""
    low, high = filter_band
    scores = {e.rollout_id: e.score for e in group}.values()
    if all(score <= low for score in scores):
        return "all_low"
    if all(score >= high for score in scores):
        return "all_high"
    return ""


def filter_groups_by_score(groups: list[list[Experience]],
                           filter_band: tuple[float, float]) -> tuple[list[list[Experience]], Counter]:
    """The groups with signal, in their order, and the count of the others by reason."""
    kept, filtered = [], Counter()
    for group in groups:
        if reason := group_filter_reason(group, filter_band):
            filtered[reason] += 1
        else:
            kept.append(group)
    return kept, filtered
