"""The refit protocol on the trainer ranks (DESIGN section 6), one role per rank, chosen once.

On rank 0, `RefitCoordinator` runs the protocol with the engines through rank 0's mailbox
(molt.transport.mailbox, handed in by molt.train): it opens the refit group, asks the engines to pause,
says 'refit_go' or 'refit_cancel', waits for their confirmations, retries a failed attempt on a rebuilt
group up to refit.max_attempts, tells the other trainer ranks how each attempt went, and scores the
refit check's probe on the engines. On ranks 1.., `RefitFollower` runs the FSDP2 gathers of every
attempt (the sender's weights are sharded over all trainer ranks) and learns the outcome.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

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

    def __init__(self, cfg: MoltConfig, sender, mailbox, *, host: str, group: dist.ProcessGroup | None,
                 device: torch.device):
        """`mailbox`: molt.transport.mailbox.Mailbox, which carries the protocol's messages."""
        super().__init__(cfg, sender, group=group, device=device)
        self.mailbox, self.host = mailbox, host
        self.rollout_ranks = mailbox.rollout_ranks

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
            self.mailbox.send_to_rollout_rank(rank, {
                "type": "join_refit", "group": {**group, "rank": engine_first_rank(index, tensor_parallel)}})
        try:
            self.sender.connect()
        except RefitSendError as error:  # an engine did not join: its rank's report, or its absence, names it
            absent = {self.rollout_ranks[(rank - 1) // tensor_parallel] for rank in error.absent_ranks}
            self.await_joined(0.0, error, absent=absent)
        self.await_joined(self.cfg.refit.timeout_seconds)

    def attempt(self, version: int, attempt: int) -> str | None:
        """One refit attempt; returns what failed, if anything.

        The engines pause first; once every engine has said it is paused and ready, 'refit_go' and
        the sender broadcasts. If one did not by the deadline, 'refit_cancel' (the paused engines drop
        the group without loading) and nothing is sent. Every trainer rank runs the FSDP2 gathers
        either way (`send=False` gathers only)."""
        deadline = time.monotonic() + self.cfg.refit.timeout_seconds
        self.mailbox.send_to_rollout_ranks({"type": "refit", "version": version, "attempt": attempt})
        not_paused = self.await_paused(version, attempt, deadline)
        self.decide_refit(version, attempt, go=not_paused is None)
        send_error = None
        started = time.perf_counter()
        try:
            num_bytes = self.sender.broadcast(send=not_paused is None)
        except RefitSendError as error:  # only the sender raises; the engines' replies say which one failed
            send_error, num_bytes = error, 0
        failure = not_paused or self.finish_refit(version, attempt, deadline, send_error)
        logger.debug("refit v%d: %.1f MB in %.2fs", version, num_bytes / 1e6, time.perf_counter() - started)
        return failure

    def prepare_retry(self, failure: str | None, attempt: int) -> None:
        logger.error("%s; rebuilding the refit group and retrying (attempt %d of %d)",
                     failure, attempt + 1, self.cfg.refit.max_attempts)
        self.open_group()

    def compare(self, probe: list[int], trainer_logprobs: torch.Tensor) -> dict[str, float]:
        self.mailbox.send_to_rollout_ranks({"type": "score", "token_ids": probe})
        replies = self.mailbox.expect("scored", len(self.rollout_ranks), self.cfg.refit.timeout_seconds, "refit check")
        engine_logprobs = [reply["logprobs"] for reply in replies]
        reference = trainer_logprobs[0, 1:].double().cpu()
        gap = max((reference - torch.tensor(e[1:], dtype=torch.float64)).abs().max().item() for e in engine_logprobs)
        logger.info("refit check: max |engine - trainer| log-prob = %.3g", gap)
        return {"refit/max_abs_logprob_diff": gap}

    def await_paused(self, version: int, attempt: int, deadline: float) -> str | None:
        """Wait until `deadline` for every engine to say it paused for one refit attempt, ready to
        receive. None when all did (the sender may broadcast); otherwise what went wrong, naming each
        engine that did not: then nothing is broadcast and the attempt has failed. Either way the
        caller then sends `decide_refit`, which the engines wait for."""
        problems = self._refit_problems("refit_paused", version, attempt, deadline, "acknowledge the pause")
        return (f"refit v{version} (attempt {attempt}): " + "; ".join(problems) + "; nothing was broadcast"
                if problems else None)

    def decide_refit(self, version: int, attempt: int, go: bool) -> None:
        """Tell every engine, once `await_paused` returned, whether this attempt goes ahead: 'refit_go'
        (every engine paused: they receive) or 'refit_cancel' (one did not: the paused ones tear the
        group down at once, loading nothing, and keep serving their old weights). A rank that is no
        longer connected cannot be told; its absence shows in the attempt's replies."""
        message = {"type": "refit_go" if go else "refit_cancel", "version": version, "attempt": attempt}
        for rank in self.rollout_ranks:
            try:
                self.mailbox.send_to_rollout_rank(rank, message)
            except ConnectionError as error:
                logger.error("refit v%d (attempt %d): %s", version, attempt, error)

    def finish_refit(self, version: int, attempt: int, deadline: float, send_error: Exception | None) -> str | None:
        """Wait until `deadline` for every engine to confirm one refit attempt. None when all
        loaded the weights; otherwise what went wrong, naming each engine that did not."""
        problems = self._refit_problems("refit_done", version, attempt, deadline, "confirm")
        if send_error is not None:
            problems.append(f"the trainer's {send_error}")
        return f"refit v{version} (attempt {attempt}): " + "; ".join(problems) if problems else None

    def await_joined(self, timeout_seconds: float, join_error: Exception | None = None,
                     absent: Collection[int] = ()) -> None:
        """Wait up to `timeout_seconds` for every engine to confirm it joined a fresh refit group. An
        engine that did not is named: by its rank's own report (RolloutRankError, e.g. its engine died)
        or in a RefitError, which also carries `join_error` (the sender's failed rendezvous). `absent`:
        the rollout ranks whose engines never reached that rendezvous; when known, only they are named
        (the others timed out waiting for them)."""
        replies = self.mailbox.receive_replies("refit_joined", len(self.rollout_ranks),
                                               time.monotonic() + timeout_seconds, "refit join")
        joined = {reply["rank"] for reply in replies}
        timeout = f"refit.timeout_seconds={self.cfg.refit.timeout_seconds:g}"
        problems = ([f"the engine of rollout rank {rank} never reached the refit rendezvous within {timeout}"
                     for rank in sorted(absent)] or
                    [f"the engine of rollout rank {rank} did not join within {timeout}"
                     for rank in self.rollout_ranks if rank not in joined])
        if join_error is not None:
            problems.append(f"the trainer's sender: {join_error}")
        if problems:
            raise RefitError("refit group: " + "; ".join(problems))

    def _refit_problems(self, reply_type: str, version: int, attempt: int, deadline: float, verb: str) -> list[str]:
        """One line per engine whose `reply_type` for this attempt was missing by `deadline` or reported an error."""
        def this_attempt(message: dict) -> bool:
            return message["version"] == version and message["attempt"] == attempt

        replies = self.mailbox.receive_replies(reply_type, len(self.rollout_ranks), deadline, f"refit v{version}",
                                               this_attempt)
        by_rank = {reply["rank"]: reply for reply in replies}
        problems = []
        for rank in self.rollout_ranks:
            reply = by_rank.get(rank)
            if reply is None:
                problems.append(f"the engine of rollout rank {rank} did not {verb} within "
                                f"refit.timeout_seconds={self.cfg.refit.timeout_seconds:g}")
            elif reply["error"]:
                problems.append(f"the engine of rollout rank {rank} failed: {reply['error']}")
        return problems
