"""Rank 0's mailbox: the rollout controller's one ZeroMQ router socket, its waits and its backlog.

Every rollout rank and every other trainer rank holds a dealer connected to this router
(molt.transport.wire). The controller (molt.controller.pool) is a state machine over the messages:
it sends through the mailbox and asks it for replies of one type; the mailbox keeps the messages
that arrive early for a later wait, drops stale replies to an attempt given up on, turns a rank's
error report into RolloutRankError, and says what a long wait waits for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from molt.console import HEARTBEAT_SECONDS, Heartbeat
from molt.transport.wire import Router

logger = logging.getLogger("molt")


class RolloutRankError(RuntimeError):
    """A rollout rank reported a failure; the message names the rank."""


class Mailbox:
    def __init__(self, router: Router, rollout_ranks: list[int]):
        self.router = router
        self.rollout_ranks = rollout_ranks
        self.backlog: list[tuple[str, dict]] = []  # (sender, message) that arrived before a wait wanted them
        self.heartbeat_seconds = HEARTBEAT_SECONDS  # how often a long wait says what it waits for

    def send_to_rollout_rank(self, rank: int, message: dict) -> None:
        self.router.send(f"rollout-{rank}", message)

    def send_to_rollout_ranks(self, message: dict) -> None:
        for rank in self.rollout_ranks:
            self.send_to_rollout_rank(rank, message)

    def send_to_trainer_rank(self, rank: int, message: dict) -> None:
        self.router.send(f"trainer-{rank}", message)

    def expect(self, message_type: str, count: int, timeout_seconds: float, what: str,
               heartbeat: Heartbeat | None = None, status: Callable[[], str] | None = None) -> list[dict]:
        """Wait for `count` messages of one type; an error report or the deadline raises."""
        received = self.receive_replies(message_type, count, time.monotonic() + timeout_seconds, what,
                                        heartbeat=heartbeat, status=status)
        if len(received) < count:
            raise TimeoutError(f"{what}: got {len(received)} of {count} replies within {timeout_seconds:.0f}s; "
                               f"a rank may be stuck or dead")
        return received

    def receive_replies(self, message_type: str, count: int, deadline: float, what: str,
                        match: Callable[[dict], bool] | None = None, heartbeat: Heartbeat | None = None,
                        status: Callable[[], str] | None = None) -> list[dict]:
        """Up to `count` messages of one type, those that arrive by `deadline`; an error report
        raises. Messages of that type `match` rejects are stale replies (to an attempt given up on)
        and are dropped; other types wait in the backlog for the call that wants them. A long wait
        says what it waits for every heartbeat interval (`status`, or the replies counted so far)."""
        def stale(message: dict) -> bool:
            return message["type"] == message_type and match is not None and not match(message)

        received = [m for _, m in self.backlog if m["type"] == message_type and not stale(m)][:count]
        self.backlog = [(i, m) for i, m in self.backlog if not stale(m) and not any(m is r for r in received)]
        heartbeat = heartbeat or Heartbeat(self.heartbeat_seconds)
        while len(received) < count:
            try:
                identity, message = self.router.receive(max(0.0, min(deadline, heartbeat.due_at) - time.monotonic()))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    break
                heartbeat.beat(status() if status else f"waiting for {what}: {len(received)} of {count} replies")
                continue
            if message["type"] in ("failed", "error"):
                raise RolloutRankError(f"{what}: {identity} reported {message.get('during', 'start-up')} failure: "
                                       f"{message['error']}")
            if message["type"] != message_type:
                self.backlog.append((identity, message))  # an early reply to a later wait
            elif stale(message):
                logger.info("%s: ignoring a late reply from %s: %s", what, identity, message)
            else:
                received.append(message)
        return received

    def traffic_metrics(self) -> dict[str, float]:
        """What passed through the socket so far: references and control only."""
        return {"controller/bytes_received_total": float(self.router.bytes_received),
                "controller/bytes_sent_total": float(self.router.bytes_sent)}
