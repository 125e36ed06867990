"""The refit protocol on the trainer ranks (DESIGN section 6), one role per rank, chosen once.

On rank 0, `RefitCoordinator` runs the protocol with the engines through the rollout controller (handed
in by molt.train): it opens the refit group, asks the engines to pause, says 'refit_go' or 'refit_cancel',
waits for their confirmations, retries a failed attempt on a rebuilt group up to refit.max_attempts,
and tells the other trainer ranks how each attempt went. On ranks 1.., `RefitFollower` runs the FSDP2
gathers of every attempt (the sender's weights are sharded over all trainer ranks) and learns the outcome.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from molt.config import MoltConfig
from molt.refit.weight_sync import RefitError, RefitSendError, engine_first_rank, refit_world_size

logger = logging.getLogger("molt")


class RefitFollower:
    """A trainer rank that is not the sender: it gathers its shards for every attempt."""

    def __init__(self, cfg: MoltConfig, sender, *, group: dist.ProcessGroup | None, device: torch.device):
        """`sender`: molt.refit.weight_sync's sender over the actor (molt.refit.backends.build_sender)."""
        self.cfg, self.sender, self.group, self.device = cfg, sender, group, device
        self.failures = 0  # failed refit attempts so far (each retried or fatal)

    def connect(self) -> None:
        """Build the refit group (rank 0 only: the engines and the sender)."""

    def push(self, version: int) -> None:
        """Broadcast the new weights into every engine; returns when every engine has loaded them.

        One refit.timeout_seconds covers an attempt (broadcast and every engine's confirmation). A
        failed attempt is logged naming each engine that failed; the refit group is rebuilt and the
        refit retried, up to refit.max_attempts, after which RefitError stops the job. An engine
        that did not load the weights keeps sampling under its old version label, never a wrong one."""
        max_attempts = self.cfg.refit.max_attempts
        for attempt in range(1, max_attempts + 1):
            failure = self.attempt(version, attempt)
            if not self.agree(failure is not None):
                return
            self.failures += 1
            if attempt == max_attempts:
                raise RefitError(f"{failure or 'refit failed on the engines (rank 0 logs which)'}; "
                                 f"gave up after refit.max_attempts={max_attempts}")
            self.prepare_retry(failure, attempt)

    def attempt(self, version: int, attempt: int) -> str | None:
        """The gathers of one attempt (`send=True` on a rank that does not send gathers only)."""
        self.sender.broadcast(send=True)
        return None

    def prepare_retry(self, failure: str | None, attempt: int) -> None:
        pass

    def agree(self, flag: bool) -> bool:
        """Rank 0's flag, on every trainer rank (one tiny broadcast)."""
        if self.cfg.layout.num_trainer_ranks == 1:
            return flag
        value = torch.tensor([int(flag)], device=self.device)
        dist.broadcast(value, group_src=0, group=self.group)
        return bool(value.item())

    def compare(self, probe: list[int], trainer_logprobs: torch.Tensor) -> dict[str, float]:
        """The refit check's metrics: the largest log-prob gap between engines and trainer (rank 0)."""
        return {}


class RefitCoordinator(RefitFollower):
    """Rank 0: the sender, and the refit protocol's replies and retries."""

    def __init__(self, cfg: MoltConfig, sender, controller, *, host: str, group: dist.ProcessGroup | None,
                 device: torch.device):
        """`controller`: molt.controller.pool.RolloutController, which carries the protocol's messages."""
        super().__init__(cfg, sender, group=group, device=device)
        self.controller, self.host = controller, host
        self.rollout_ranks = controller.rollout_ranks

    def connect(self) -> None:
        self.open_group()
        logger.info("engines ready; %s refit group of %d ranks, %d buckets", self.sender.backend,
                    refit_world_size(len(self.rollout_ranks), self.cfg.layout.engine_tensor_parallel_size),
                    len(self.sender.buckets))

    def open_group(self) -> None:
        """A fresh refit group with every worker of every engine (at start, and after a failed refit).
        Each engine's join message carries its first refit rank; its tensor-parallel workers take that
        rank and the next ones (molt.refit.weight_sync)."""
        self.sender.close_group()
        tensor_parallel = self.cfg.layout.engine_tensor_parallel_size
        group = self.sender.group_message(self.host, refit_world_size(len(self.rollout_ranks), tensor_parallel))
        for index, rank in enumerate(self.rollout_ranks):
            self.controller.mailbox.send_to_rollout_rank(rank, {
                "type": "join_refit", "group": {**group, "rank": engine_first_rank(index, tensor_parallel)}})
        try:
            self.sender.connect()
        except RefitSendError as error:  # an engine did not join: its rank's report, or its absence, names it
            absent = {self.rollout_ranks[(rank - 1) // tensor_parallel] for rank in error.absent_ranks}
            self.controller.await_joined(0.0, error, absent=absent)
        self.controller.await_joined(self.cfg.refit.timeout_seconds)

    def attempt(self, version: int, attempt: int) -> str | None:
        """One refit attempt; returns what failed, if anything.

        The engines pause first; once every engine has said it is paused and ready, 'refit_go' and
        the sender broadcasts. If one did not by the deadline, 'refit_cancel' (the paused engines drop
        the group without loading) and nothing is sent. Every trainer rank runs the FSDP2 gathers
        either way (`send=False` gathers only)."""
        deadline = time.monotonic() + self.cfg.refit.timeout_seconds
        self.controller.mailbox.send_to_rollout_ranks({"type": "refit", "version": version, "attempt": attempt})
        not_paused = self.controller.await_paused(version, attempt, deadline)
        self.controller.decide_refit(version, attempt, go=not_paused is None)
        send_error = None
        started = time.perf_counter()
        try:
            num_bytes = self.sender.broadcast(send=not_paused is None)
        except RefitSendError as error:  # only the sender raises; the engines' replies say which one failed
            send_error, num_bytes = error, 0
        failure = not_paused or self.controller.finish_refit(version, attempt, deadline, send_error)
        logger.debug("refit v%d: %.1f MB in %.2fs", version, num_bytes / 1e6, time.perf_counter() - started)
        return failure

    def prepare_retry(self, failure: str | None, attempt: int) -> None:
        logger.error("%s; rebuilding the refit group and retrying (attempt %d of %d)",
                     failure, attempt + 1, self.cfg.refit.max_attempts)
        self.open_group()

    def compare(self, probe: list[int], trainer_logprobs: torch.Tensor) -> dict[str, float]:
        engine_logprobs = self.controller.score_on_engines(probe, self.cfg.refit.timeout_seconds)
        reference = trainer_logprobs[0, 1:].double().cpu()
        gap = max((reference - torch.tensor(e[1:], dtype=torch.float64)).abs().max().item() for e in engine_logprobs)
        logger.info("refit check: max |engine - trainer| log-prob = %.3g", gap)
        return {"refit/max_abs_logprob_diff": gap}
