"""The rollout controller (rank 0): owns the prompt stream, dispatches single rollouts to the
rollout ranks, refills or drops groups with a failed rollout, gathers complete groups, filters
groups without signal and backfills them (DAPO dynamic sampling), and releases each step's groups
(rank 0's batch feed, molt.trainer.feed, balances them over the trainer ranks). It is a state
machine over messages with no socket in it: they pass through its mailbox (molt.transport.mailbox),
and the refit protocol's decisions and retries are the refit coordinator's (molt.refit.coordinator),
for which it sends the engines' pause, go and cancel and waits for their replies.

Streaming with bounded staleness (`algorithm.max_staleness = k`, DESIGN section 6): groups are
dispatched ahead and stay in flight while the trainer trains, with no global rollout round. At
policy version v the controller keeps the groups of the next min(k + 1, steps left) steps
dispatched (`rollout.prompts_per_step` each). A step releases groups strictly in dispatch order,
waiting for the oldest one to complete, and takes the first `prompts_per_step` that survive the
failed-rollout rule and the filter; a failed or filtered group is replaced by the next group in
the queue, or, when the queue is empty, by prompts dispatched there and then (the backfill).

Why dispatch order rather than completion order: completion order would keep letting short
rollouts overtake long ones, biasing every batch toward short responses and dropping long groups
as stale; in dispatch order a batch holds the same prompts whatever k is, only their versions
differ. It bounds the lag by construction: a group dispatched at version v has fewer than
(k + 1) x prompts_per_step groups ahead of it, each step releases at least prompts_per_step of them,
so the step that trains version v + k has released it. A group found older than the bound anyway
is dropped and counted (reason 'stale'); the check is a safety net. With k = 0 the queue holds only
the current step's groups: a step dispatches its prompts, waits for them, refills and backfills
round by round, with refits between steps and no rollout in flight: the synchronous trainer,
through the same code.

Accounting, in rollouts, checked every step: dispatched = consumed + dropped (by reason) + in flight.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from collections.abc import Callable

from molt.agents.base import RolloutOutcome
from molt.config import AgentConfig, MoltConfig, engine_start_limit_seconds
from molt.console import Heartbeat
from molt.controller.engine_router import EngineRouter, estimate_rollout_tokens
from molt.controller.evaluation import (EvalRun, EvalSample, build_eval_requests, build_rollout_request,
                                        compute_eval_metrics, split_eval_rows)
from molt.controller.prompts import PromptRow, build_prompt_loader, load_prompt_rows
from molt.trace.experience import Experience
from molt.transport.dispatch import decode_outcome
from molt.transport.payloads import PayloadClient, PayloadRef, default_node_id
from molt.transport.mailbox import Mailbox, RolloutRankError

logger = logging.getLogger("molt")

# Why a dispatched rollout was not trained on (accounting and metrics):
DROP_REASONS = ("failed",  # it failed (refilled or not)
                "failed_group",  # it succeeded, but its group was dropped for a failed rollout
                "filtered",  # its group carried no signal (algorithm.filter_groups)
                "stale")  # its group would have been trained beyond algorithm.max_staleness
# Running totals the engines report (rank metrics '<name>_total'); each step logs its growth as '<name>':
ROLLOUT_RANK_STOP_SECONDS = 60.0  # longest wait at the end for the rollout ranks to stop their engines
MAX_EXAMPLE_CHARACTERS = 500  # of a failed rollout's error quoted when the job stops for failed steps
ENGINE_COUNTERS = ("rollout/prompt_tokens",  # prompt tokens submitted to the engines
                   "rollout/prefill_tokens",  # ... of which computed (not vLLM prefix-cache hits)
                   "rollout/unrouted_tokens")  # MoE: ... of which without a recorded route (molt.rollout.route_capture)


class AccountingError(RuntimeError):
    """Dispatched rollouts do not add up to consumed + dropped + in flight: rollouts were lost."""


@dataclass
class StepRollouts:
    """The complete groups of one step, plus what happened to the rest."""

    groups: list[list[Experience]]  # each inner list: every segment of every rollout of one prompt
    failures: Counter = field(default_factory=Counter)  # failed rollouts by reason
    failure_examples: dict[str, str] = field(default_factory=dict)  # reason -> the first such rollout's error
    dropped_groups: int = 0  # groups dropped for a failed rollout
    refilled_rollouts: int = 0  # replacement rollouts dispatched for failed ones (agent.on_failed_rollout='refill')
    num_rollouts: int = 0  # rollouts run, refills included
    ledger: Counter = field(default_factory=Counter)  # ChatAgent turns by how they joined a segment
    filtered_groups: Counter = field(default_factory=Counter)  # complete groups dropped for no signal, by reason
    backfill_prompts: int = 0  # groups released beyond prompts_per_step to replace lost ones
    loop_lag_max_seconds: float = 0.0  # most an agent worker's or rollout rank's event loop lagged
    stale_groups: int = 0  # complete groups dropped as older than algorithm.max_staleness
    consumed_rollouts: int = 0  # rollouts whose experiences are in `groups`
    dropped_rollouts: Counter = field(default_factory=Counter)  # rollouts not trained on, by DROP_REASONS
    trained_version: int = 0  # the policy version this step's update starts from
    accounting: dict[str, float] = field(default_factory=dict)  # run totals after this step (metrics)
    # The reward of every rollout of the step's complete groups, trained or dropped (filtered, stale):
    # what the policy earns, where reward/mean covers only the groups trained on.
    scored_rewards: list[float] = field(default_factory=list)
    trained_prompts: list[int] = field(default_factory=list)  # prompt-file index of each group in `groups`
    dropped_prompts: list[int] = field(default_factory=list)  # ... of each group released but dropped
    # The rollout ranks' payload-store, process and engine metrics, summed:
    rank_metrics: dict[str, float] = field(default_factory=dict)

    def merge(self, later: StepRollouts) -> None:
        """Add later groups of the same step: they go after these (dispatch order), counts add up; the
        step's own fields (trained_version, accounting, rank_metrics) are set once, after the merges."""
        for name in MERGED_FIELDS:
            mine, theirs = getattr(self, name), getattr(later, name)
            if isinstance(mine, Counter):
                mine.update(theirs)
            elif isinstance(mine, dict):  # failure_examples: the first example of each reason stays
                mine.update({key: value for key, value in theirs.items() if key not in mine})
            else:  # lists follow in dispatch order, counts add up, the largest lag stays
                setattr(self, name, max(mine, theirs) if name == "loop_lag_max_seconds" else mine + theirs)

    def metrics(self, experiences: list[Experience]) -> dict[str, float]:
        """The step's rollout metrics; `experiences`: those trained on (the groups', or none)."""
        rewards = {e.rollout_id: e.reward for e in experiences}
        response_lengths = [e.num_action_tokens for e in experiences]
        metrics = {
            "reward/mean": statistics.fmean(rewards.values()) if rewards else math.nan,
            # With algorithm.filter_groups (or staleness drops), reward/mean covers the trained groups only.
            "reward/scored_mean": statistics.fmean(self.scored_rewards) if self.scored_rewards else math.nan,
            "rollout/num_rollouts": float(self.num_rollouts),
            "rollout/num_groups": float(len(self.groups)),
            "rollout/dropped_groups": float(self.dropped_groups),
            "rollout/refilled": float(self.refilled_rollouts),
            "rollout/failed": float(sum(self.failures.values())),
            "rollout/tokens": float(sum(e.num_tokens for e in experiences)),
            "rollout/response_length_mean": statistics.fmean(response_lengths) if response_lengths else math.nan,
            "rollout/truncated_share": statistics.fmean(e.truncated for e in experiences) if experiences else math.nan,
            # The images stay in the rollout ranks' payload stores; the records say how many and how big.
            "rollout/images": float(sum(e.num_images for e in experiences)),
            "rollout/image_bytes": float(sum(e.image_bytes for e in experiences)),
        }
        metrics.update({f"rollout/failed_{reason}": float(n) for reason, n in self.failures.items()})
        metrics.update({f"rollout/filtered_{reason}": float(n) for reason, n in self.filtered_groups.items()})
        metrics["rollout/backfill_prompts"] = float(self.backfill_prompts)
        metrics["rollout/stale_groups"] = float(self.stale_groups)
        metrics.update(compute_staleness(self.groups, self.trained_version))
        metrics.update({"rollout/consumed": float(self.consumed_rollouts), **self.accounting})
        metrics["rollout/loop_lag_max_seconds"] = self.loop_lag_max_seconds
        metrics.update({key: float(value) for key, value in self.rank_metrics.items()})
        metrics.update({f"drift/{reason}": float(n) for reason, n in self.ledger.items()})
        metrics["rollout/segments_per_rollout"] = len(experiences) / len(rewards) if rewards else math.nan
        infos: dict[str, list[float]] = {}
        for e in experiences:
            for key, value in e.info.items():
                infos.setdefault(key, []).append(value)
        metrics.update({f"agent/{k}": statistics.fmean(v) for k, v in infos.items()})
        return metrics


# What `StepRollouts.merge` combines: every field but the step's own.
MERGED_FIELDS = [f.name for f in dataclasses.fields(StepRollouts)
                 if f.name not in ("trained_version", "accounting", "rank_metrics")]


@dataclass
class GroupInFlight:
    """One prompt's group from its dispatch until a step releases it."""

    group_id: int
    size: int  # rollout.n_samples_per_prompt
    dispatch_version: int  # policy version when it was dispatched (its refills may be newer)
    row: PromptRow  # its prompt
    pending: set[int] = field(default_factory=set)  # rollout ids dispatched and not back yet
    outcomes: list[RolloutOutcome] = field(default_factory=list)  # back, in arrival order
    num_refills: int = 0


@dataclass
class Accounting:
    """Run totals, in rollouts. In flight is counted from the queue itself, not kept as a total, so
    the invariant compares two independent tallies."""

    dispatched: int = 0
    consumed: int = 0
    dropped: Counter = field(default_factory=Counter)  # by DROP_REASONS

    def check(self, in_flight: int) -> dict[str, float]:
        """The run totals as metrics; raises AccountingError when they do not add up."""
        dropped = sum(self.dropped.values())
        if self.dispatched != self.consumed + dropped + in_flight:
            message = (f"rollout accounting broken: dispatched {self.dispatched} != consumed {self.consumed} + "
                       f"dropped {dropped} {dict(self.dropped)} + in flight {in_flight}; rollouts were lost or "
                       f"counted twice")
            logger.error("%s", message)
            raise AccountingError(message)
        metrics = {"rollout/dispatched_total": float(self.dispatched), "rollout/consumed_total": float(self.consumed),
                   "rollout/dropped_total": float(dropped), "rollout/in_flight": float(in_flight)}
        metrics.update({f"rollout/dropped_{reason}_total": float(self.dropped[reason]) for reason in DROP_REASONS})
        return metrics


class RolloutController:
    def __init__(self, cfg: MoltConfig, mailbox: Mailbox, *, prompt_rows: list[PromptRow] | None = None):
        """`mailbox`: how messages reach and leave the ranks (molt.transport.mailbox); `prompt_rows`:
        data.train_path's rows when already read (molt.train); None reads the file."""
        self.cfg = cfg
        self.mailbox = mailbox
        rollout_ranks = self.rollout_ranks = mailbox.rollout_ranks
        # eval.holdout_rows leaves training without the eval rows (molt.controller.evaluation), evaluating or
        # not, so that python -m molt.eval can later score them; eval.data_path is read only when
        # training evaluates.
        training_rows = load_prompt_rows(cfg.data.train_path) if prompt_rows is None else prompt_rows
        self.eval_rows = []
        if cfg.eval.every_steps or cfg.eval.holdout_rows:
            training_rows, self.eval_rows = split_eval_rows(cfg, training_rows)
        self.loader = build_prompt_loader(cfg.data.train_path, batch_size=cfg.rollout.prompts_per_step,
                                          shuffle=cfg.data.shuffle, seed=cfg.seed, rows=training_rows)
        self._prompts = iter(self.loader)
        # Rows the loader handed out that no step has dispatched yet (a backfill takes fewer rows
        # than a batch); the next call takes them first, so no row is skipped or repeated. The
        # loader's own state is ahead of the dispatched rows by exactly these.
        self._pending_rows: list[PromptRow] = []
        self.epoch = 0
        self._next_rollout_id = 0
        self._next_group_id = 0
        self._queue: deque[GroupInFlight] = deque()  # dispatched groups not yet released, in dispatch order
        self._requests: dict[int, tuple[GroupInFlight, dict]] = {}  # rollout id -> its group and request, until back
        self.accounting = Accounting()
        # The controller handles references only; it frees the payloads of experiences no step trains.
        self.payloads = PayloadClient(default_node_id(cfg.payloads.node_id), spill_dir=cfg.payloads.spill_dir or None,
                                      timeout_seconds=cfg.payloads.fetch_timeout_seconds)
        self.engine_router = EngineRouter(rollout_ranks, group_affinity=cfg.rollout.group_affinity)
        self.rank_metrics: dict[int, dict[str, float]] = {}  # rollout rank -> its latest store, process, engine metrics
        self._engine_totals: dict[str, float] = {}  # ENGINE_COUNTERS summed over the ranks at the last step
        self.token_values_received = 0  # token-axis values that reached the controller (0: payloads stayed put)
        self._started: dict[int, tuple[float, int]] = {}  # rollout id -> (monotonic dispatch time, rollout rank)
        self._eval: EvalRun | None = None  # the evaluation in flight, if any
        self._next_eval_id = -1  # eval rollouts and groups count down from -1, apart from training's ids
        self.failed_steps = FailedStepStreak(cfg.agent.max_failed_steps)  # the trainer's feed records each step

    # -- start ---------------------------------------------------------------------------

    def wait_for_ranks(self, num_trainer_ranks: int) -> None:
        """Every other trainer rank says hello (so the router can address it), every engine says ready."""
        self.mailbox.expect("hello", num_trainer_ranks - 1, 120, "trainer ranks connecting")
        self.mailbox.expect("ready", len(self.rollout_ranks), engine_start_limit_seconds(self.cfg), "engine start")

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the controller (JSON-friendly): its prompt stream, the prompts
        of every group not yet released ahead of the rows no step has dispatched (a resumed run
        dispatches them first: their rollouts die with the job), id counters and run totals, the
        rollouts in flight counted as never dispatched. The EngineRouter holds nothing else, so it
        is not saved."""
        unreleased = [group.row for group in self._queue]
        return {"loader": self.loader.state_dict(), "epoch": self.epoch,
                "pending_rows": [dataclasses.asdict(row) for row in unreleased + self._pending_rows],
                "next_rollout_id": self._next_rollout_id, "next_group_id": self._next_group_id,
                "accounting": {"dispatched": self.accounting.dispatched - self.num_in_flight,
                               "consumed": self.accounting.consumed, "dropped": dict(self.accounting.dropped)}}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])
        self._prompts = iter(self.loader)
        self.epoch = state["epoch"]
        self._pending_rows = [PromptRow(**row) for row in state["pending_rows"]]
        self._next_rollout_id, self._next_group_id = state["next_rollout_id"], state["next_group_id"]
        totals = state["accounting"]
        self.accounting = Accounting(dispatched=totals["dispatched"], consumed=totals["consumed"],
                                     dropped=Counter(totals["dropped"]))

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

    @property
    def num_in_flight(self) -> int:
        """Dispatched rollouts not yet consumed or dropped: running, or back in a group not yet released."""
        return sum(len(group.pending) + len(group.outcomes) for group in self._queue)

    def collect_step(self, policy_version: int, step: int | None = None) -> StepRollouts:
        """The groups of training step `step` (default policy_version + 1; later when steps with a
        non-finite loss left the version where it was), which trains `policy_version` -> `policy_version + 1`.

        First tops up the dispatch window (see the module docstring), then releases groups in
        dispatch order until the step has rollout.prompts_per_step groups. Under
        algorithm.filter_groups (DAPO dynamic sampling, Yu et al. 2025, arXiv:2503.14476) a group
        lost to the filter or to failed rollouts is replaced by the next one; the step releases at
        most algorithm.max_backfill_prompts groups beyond prompts_per_step. When the queue runs dry
        it dispatches only as many prompts as groups are missing, so a step never has more than
        prompts_per_step groups and no finished group is thrown away for being one too many."""
        target, algo = self.cfg.rollout.prompts_per_step, self.cfg.algorithm
        max_released = target + (algo.max_backfill_prompts if algo.filter_groups else 0)
        self.top_up(policy_version, policy_version + 1 if step is None else step)
        result, released = StepRollouts(groups=[], trained_version=policy_version), 0
        heartbeat = Heartbeat(self.mailbox.heartbeat_seconds)
        def status() -> str:
            return self.describe_wait(step, len(result.groups), target)
        while len(result.groups) < target and released < max_released:
            if not self._queue:  # nothing dispatched left: a backfill round
                self.dispatch_groups(self.next_prompts(min(target - len(result.groups), max_released - released)),
                                     policy_version)
            group = self._queue[0]
            while group.pending:
                self.receive_outcome(policy_version, heartbeat, status)
            self._queue.popleft()
            result.merge(self.release(group, policy_version))
            released += 1
        result.backfill_prompts = released - target if released > target else 0
        if algo.filter_groups and len(result.groups) < target:
            logger.warning("step keeps %d of %d groups: algorithm.max_backfill_prompts=%d extra prompts used up "
                           "(filtered: %s, dropped for failed rollouts: %d); it trains on fewer groups",
                           len(result.groups), target, algo.max_backfill_prompts, dict(result.filtered_groups),
                           result.dropped_groups)
        result.accounting = self.accounting.check(self.num_in_flight)
        result.rank_metrics = self.sum_rank_metrics()
        return result

    def sum_rank_metrics(self) -> dict[str, float]:
        """The rollout ranks' latest metrics summed, plus what the engines' running totals
        (ENGINE_COUNTERS) grew by since the last step. Ranks report with each outcome, so under
        streaming a step's figure may include work for rollouts of the next one."""
        summed: dict[str, float] = {}
        for metrics in self.rank_metrics.values():
            for key, value in metrics.items():
                summed[key] = summed.get(key, 0.0) + value
        for name in ENGINE_COUNTERS:
            total = summed.get(f"{name}_total", 0.0)
            summed[name], self._engine_totals[name] = total - self._engine_totals.get(name, 0.0), total
        return summed

    def top_up(self, policy_version: int, step: int) -> None:
        """Dispatch prompts until the groups not yet released cover every step that may still train
        on a rollout dispatched now: steps step .. step + max_staleness, within train.num_steps."""
        steps = min(self.cfg.algorithm.max_staleness + 1, self.cfg.train.num_steps - step + 1)
        missing = steps * self.cfg.rollout.prompts_per_step - len(self._queue)
        if missing > 0:
            self.dispatch_groups(self.next_prompts(missing), policy_version)

    def dispatch_groups(self, rows: list[PromptRow], policy_version: int) -> None:
        """Dispatch each row as a group of rollout.n_samples_per_prompt single rollouts."""
        cfg = self.cfg
        sampling = {"max_tokens": cfg.rollout.max_response_tokens, "temperature": cfg.rollout.temperature,
                    "top_p": cfg.rollout.top_p}
        for row in rows:
            group = GroupInFlight(group_id=self._next_group_id, size=cfg.rollout.n_samples_per_prompt,
                                  dispatch_version=policy_version, row=row)
            self._next_group_id += 1
            self._queue.append(group)
            for sample_index in range(group.size):
                self.dispatch(group, build_rollout_request(cfg, row, group_id=group.group_id, sample_index=sample_index,
                                                           sampling=sampling, policy_version=policy_version))

    def dispatch(self, group: GroupInFlight, request: dict) -> int:
        """Send one rollout request, under a fresh rollout_id, to the rollout rank the EngineRouter picks."""
        request = {**request, "rollout_id": self._next_rollout_id}
        self._next_rollout_id += 1
        self._requests[request["rollout_id"]] = (group, request)
        group.pending.add(request["rollout_id"])
        self.accounting.dispatched += 1
        rank = self.engine_router.place(request["rollout_id"], group.group_id, group.size,
                                        estimate_rollout_tokens(request))
        self.mailbox.send_to_rollout_rank(rank, {"type": "rollout", "request": request})
        self._started[request["rollout_id"]] = (time.monotonic(), rank)
        return request["rollout_id"]

    # -- evaluation ------------------------------------------------------------------------

    def run_eval(self, step: int, policy_version: int) -> tuple[dict[str, float], list[EvalSample]]:
        """Evaluate the policy the engines serve (trained for `step` steps) on the eval set: dispatch
        eval.n_samples rollouts of each eval prompt with the eval sampling settings and wait for all.
        Training rollouts in flight (algorithm.max_staleness > 0) keep running and are taken into
        their groups meanwhile; no refit happens until the eval is back, so every eval sample is of
        one version. Eval rollouts are not dispatched training rollouts: they take ids below 0,
        outside the accounting, and their outcomes never reach a group or a payload store."""
        started = time.monotonic()
        run = self._eval = EvalRun(step=step, policy_version=policy_version, started=started)
        requests = build_eval_requests(self.cfg, self.eval_rows, policy_version)
        for request in requests:
            rollout_id, router_group = self._next_eval_id, -1 - request["group_id"]
            self._next_eval_id -= 1
            request = {**request, "rollout_id": rollout_id}
            run.sample_indices[rollout_id] = request["sample_index"]
            rank = self.engine_router.place(rollout_id, router_group, self.cfg.eval.n_samples,
                                            estimate_rollout_tokens(request))
            self.mailbox.send_to_rollout_rank(rank, {"type": "rollout", "request": request, "eval": True})
        heartbeat = Heartbeat(self.mailbox.heartbeat_seconds)
        def status() -> str:
            return f"eval of step {step}: {len(run.samples)} of {len(requests)} samples back"
        try:
            while not run.done:
                self.receive_outcome(policy_version, heartbeat, status)
        finally:
            self._eval = None
        for position in range(len(self.eval_rows)):
            self.engine_router.forget_group(-1 - position)
        metrics = compute_eval_metrics(run.samples, k=self.cfg.eval.n_samples,
                                       success_threshold=self.cfg.eval.success_threshold)
        metrics.update({"eval/step": float(step), "eval/policy_version": float(policy_version),
                        "eval/seconds": time.monotonic() - started})
        return metrics, run.samples

    def describe_wait(self, step: int | None, num_kept: int, target: int) -> str:
        """What a step waiting for rollouts waits for (its heartbeat line)."""
        in_flight = [group for group in self._queue if group.pending]
        line = (f"step {step if step is not None else '?'} waits for rollouts: {num_kept} of {target} groups kept; "
                f"queued groups: {len(self._queue) - len(in_flight)} complete, {len(in_flight)} in flight "
                f"({len(self._started)} rollouts running")
        if self._started:
            rollout_id, (started, rank) = min(self._started.items(), key=lambda item: item[1][0])
            line += f"; the oldest, rollout {rollout_id} on rollout rank {rank}, started {time.monotonic() - started:.0f} s ago"
        return line + ")"

    def receive_outcome(self, policy_version: int, heartbeat: Heartbeat | None = None,
                        status: Callable[[], str] | None = None) -> None:
        """Take one rollout outcome into its group; a failed rollout is refilled (at the current
        version) or dooms its group, per agent.on_failed_rollout."""
        cfg = self.cfg
        # Each rollout ends by itself within the rollout timeout, so a longer silence (allowing for
        # queueing behind others) means a stuck rank. Every dispatched rollout is waited for, refills too.
        timeout = cfg.agent.rollout_timeout_seconds * 2 + 60
        what = f"rollouts ({self.num_in_flight} in flight)"
        message = self.mailbox.expect("outcome", 1, timeout, what, heartbeat=heartbeat, status=status)[0]
        outcome = decode_outcome(message)
        if self._eval is not None and outcome.rollout_id in self._eval.sample_indices:
            self.engine_router.release(outcome.rollout_id)
            self._eval.take(outcome)
            return
        self.token_values_received += sum(len(e.token_ids) + len(e.behavior_logprobs) for e in outcome.experiences)
        if "rank_metrics" in message:
            self.rank_metrics[message["rank"]] = message["rank_metrics"]
        group, request = self._requests.pop(outcome.rollout_id)
        self._started.pop(outcome.rollout_id, None)
        self.engine_router.release(outcome.rollout_id)
        group.pending.discard(outcome.rollout_id)
        group.outcomes.append(outcome)
        if not outcome.failure:
            return
        if should_refill(group.num_refills, cfg.agent):
            group.num_refills += 1
            replacement = {**request, "policy_version": policy_version}
            fate = f"refilled as rollout {self.dispatch(group, replacement)}"
        else:
            fate = "its group is dropped" + (" (agent.max_refills_per_group used up)"
                                             if cfg.agent.on_failed_rollout == "refill" else "")
        logger.warning("rollout %d failed (%s): %s; %s", outcome.rollout_id, outcome.failure, outcome.error, fate)

    def release(self, group: GroupInFlight, policy_version: int) -> StepRollouts:
        """What a complete group gives the step that trains `policy_version`: its experiences, or
        the reason it is dropped (a failed rollout not made up, too stale, no signal)."""
        self.engine_router.forget_group(group.group_id)
        part = gather_groups(group.outcomes, {group.group_id: group.size})
        part.refilled_rollouts = group.num_refills
        part.scored_rewards = list({e.rollout_id: e.reward for g in part.groups for e in g}.values())
        num_good = sum(not outcome.failure for outcome in group.outcomes)
        part.dropped_rollouts["failed"] = len(group.outcomes) - num_good
        if part.dropped_groups:
            part.dropped_rollouts["failed_group"] = num_good
        elif policy_version - group.dispatch_version > self.cfg.algorithm.max_staleness:
            logger.warning("group %d, dispatched at version %d, is too stale for the step training version %d "
                           "(algorithm.max_staleness=%d); dropped", group.group_id, group.dispatch_version,
                           policy_version, self.cfg.algorithm.max_staleness)
            part.groups, part.stale_groups, part.dropped_rollouts["stale"] = [], 1, num_good
        elif self.cfg.algorithm.filter_groups:
            part.groups, part.filtered_groups = filter_groups_by_score(part.groups, self.cfg.algorithm.filter_band)
            if part.filtered_groups:
                part.dropped_rollouts["filtered"] = num_good
        if part.groups:
            part.consumed_rollouts = num_good
            part.trained_prompts = [group.row.index]
        else:
            part.dropped_prompts = [group.row.index]
        kept = {id(e) for g in part.groups for e in g}
        for experience in (e for outcome in group.outcomes for e in outcome.experiences):
            if id(experience) not in kept and experience.payload is not None:
                self.payloads.release(PayloadRef.from_dict(experience.payload))
        self.accounting.consumed += part.consumed_rollouts
        self.accounting.dropped.update(part.dropped_rollouts)
        return part

    def traffic_metrics(self) -> dict[str, float]:
        """What passed through the controller's socket so far: references and control only."""
        return {**self.mailbox.traffic_metrics(),
                "controller/token_values_received_total": float(self.token_values_received)}

    def close(self) -> None:
        """At the end of the job: stop the rollout ranks and wait for them (see shutdown)."""
        self.shutdown(wait_seconds=ROLLOUT_RANK_STOP_SECONDS)

    def shutdown(self, wait_seconds: float = 0.0) -> None:
        """Tell the rollout ranks to stop; with `wait_seconds`, wait that long for each to say it has
        stopped its engine, so this rank, which the launcher waits for, is the last to exit."""
        if self._queue:
            logger.info("stopping with %d rollouts in flight (%d groups dispatched for steps past the last)",
                        self.num_in_flight, len(self._queue))
        self.mailbox.send_to_rollout_ranks({"type": "shutdown"})
        if wait_seconds > 0:
            try:
                stopped = self.mailbox.receive_replies("stopped", len(self.rollout_ranks),
                                                       time.monotonic() + wait_seconds, "rollout ranks stopping")
                if len(stopped) < len(self.rollout_ranks):
                    logger.warning("%d of %d rollout ranks did not say they stopped within %.0f s",
                                   len(self.rollout_ranks) - len(stopped), len(self.rollout_ranks), wait_seconds)
            except RolloutRankError as error:
                logger.warning("while stopping: %s", error)
        self.payloads.close()


class FailedStepStreak:
    """Counts consecutive steps in which every rollout failed (agent.max_failed_steps), with their
    failures by reason and an example of each, so the job can stop saying why."""

    def __init__(self, max_failed_steps: int):
        self.max_failed_steps = max_failed_steps
        self.reset()

    def reset(self) -> None:
        self.num_steps, self.num_rollouts = 0, 0
        self.failures: Counter = Counter()
        self.examples: dict[str, str] = {}

    def record(self, rollouts: StepRollouts) -> str | None:
        """Add one step; once max_failed_steps steps in a row had only failed rollouts, what to tell
        the user (the job must stop), else None. A step with one good rollout ends the streak."""
        if not rollouts.num_rollouts or sum(rollouts.failures.values()) < rollouts.num_rollouts:
            self.reset()
            return None
        self.num_steps += 1
        self.num_rollouts += rollouts.num_rollouts
        self.failures.update(rollouts.failures)
        for reason, example in rollouts.failure_examples.items():
            self.examples.setdefault(reason, example)
        if not self.max_failed_steps or self.num_steps < self.max_failed_steps:
            return None
        (reason, count), *others = self.failures.most_common()
        example = self.examples.get(reason, "")
        if len(example) > MAX_EXAMPLE_CHARACTERS:
            example = example[:MAX_EXAMPLE_CHARACTERS] + "..."
        also = "; also " + ", ".join(f"{r} ({n})" for r, n in others) if others else ""
        return (f"every rollout of the last {self.num_steps} steps failed ({self.num_rollouts} rollouts; "
                f"agent.max_failed_steps={self.max_failed_steps}): most often '{reason}' ({count} rollouts), "
                f"e.g. {example}{also}. Fix the agent (agent.path) or what it calls, or set "
                f"agent.max_failed_steps=0 to train on regardless")


def should_refill(num_refills: int, agent: AgentConfig) -> bool:
    """Whether a failed rollout is re-run, given the refills its group already had."""
    return agent.on_failed_rollout == "refill" and num_refills < agent.max_refills_per_group


def gather_groups(outcomes: list[RolloutOutcome], group_sizes: dict[int, int]) -> StepRollouts:
    """Keep each group with a successful rollout for every sample (a refill makes up for a failed
    one); drop the rest, since a group with a hole would bias its baseline. Counts every failure."""
    by_group = defaultdict(list)
    result = StepRollouts(groups=[], num_rollouts=len(outcomes))
    for outcome in outcomes:
        result.ledger.update(outcome.ledger)
        result.loop_lag_max_seconds = max(result.loop_lag_max_seconds, outcome.loop_lag_max_seconds)
        if outcome.failure:
            result.failures[outcome.failure] += 1
            result.failure_examples.setdefault(outcome.failure, f"rollout {outcome.rollout_id}: {outcome.error}")
        else:
            by_group[outcome.group_id].append(outcome)
    for group_id, size in group_sizes.items():
        members = sorted(by_group[group_id], key=lambda o: o.rollout_id)
        if len(members) < size:
            result.dropped_groups += 1
            continue
        result.groups.append([e for o in members for e in o.experiences])
    return result


def compute_staleness(groups: list[list[Experience]], trained_version: int) -> dict[str, float]:
    """Staleness metrics of a step's groups: mean and max version lag of the action tokens (the
    trained version minus the version that sampled the token; nan and 0 without action tokens), and
    how many experiences hold action tokens of more than one version (partial rollout)."""
    num_tokens, version_sum, max_lag, multi_version = 0, 0, 0, 0
    for experience in (e for group in groups for e in group):
        count, total, lowest, highest = experience.action_version_stats()
        if not count:
            continue
        num_tokens, version_sum = num_tokens + count, version_sum + total
        max_lag = max(max_lag, trained_version - lowest)
        multi_version += lowest != highest
    return {"staleness/mean": trained_version - version_sum / num_tokens if num_tokens else float("nan"),
            "staleness/max": float(max_lag),
            "staleness/multi_version_experiences": float(multi_version)}


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
