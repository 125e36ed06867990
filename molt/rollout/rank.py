"""A rollout rank: hosts one vLLM engine and the session endpoint, and runs agent rollouts on the
controller's request in its agent worker processes (molt/rollout/agent_pool.py); user agent code never
runs in this process.

It talks to the controller (rank 0) over one ZeroMQ DEALER socket; every message is a msgpack
map with a 'type'. Rollouts run concurrently, each forwarded to a worker; refits run between steps.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import traceback
from pathlib import Path

import zmq
import zmq.asyncio

from molt.rollout.agent_pool import AgentWorkerPool
# The rollout wire format lives with the agent workers that produce and consume it; the
# controller (and its tests) import it from here.
from molt.agents.base import RolloutOutcome
from molt.config import MoltConfig
from molt.distributed.devices import apply_vllm_worker_start_method
from molt.endpoint.server import SessionEndpoint
from molt.endpoint.template_check import find_prefix_breaks
from molt.metrics import ProcessResourceSampler
from molt.refit.weight_sync import RefitCancelled, RefitError
from molt.rollout.engine import RolloutEngine
from molt.rollout.loop_lag import LoopLagMonitor
from molt.trace.experience import split_at_version_changes
from molt.trace.images import count_stray_placeholders
from molt.transport.dispatch import decode_outcome, encode_outcome
from molt.transport.payloads import PayloadStore, default_node_id, offload_record
from molt.transport.wire import ControllerAddress, connect_dealer, pack, unpack

logger = logging.getLogger("molt")

RANK_LAG_ADVICE = "the session endpoint and the engine's front end share this loop: their requests waited meanwhile"


def run_rollout_rank(cfg: MoltConfig, rank: int, controller_address: ControllerAddress, host: str) -> None:
    # Both before vLLM is imported; its engine core and workers inherit them.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    apply_vllm_worker_start_method(os.environ, cfg.device)  # this process holds the torchrun world
    asyncio.run(RolloutService(cfg, rank, controller_address, host).serve())


def wakes_engine(message_type: str) -> bool:
    """Whether a message from the controller needs the engine awake (rollout.sleep_while_training):
    a refit loads weights into it, a rollout and a score run it. The engine sleeps on 'sleep', which
    the trainer sends once it has a step's rollouts, and wakes at whichever of these comes next, so an
    engine also wakes when a step updated nothing and no refit follows."""
    return message_type in ("refit", "rollout", "score")


class RolloutService:
    def __init__(self, cfg: MoltConfig, rank: int, controller_address: ControllerAddress, host: str):
        self.cfg = cfg
        self.rank = rank
        self.host = host  # this node's interface: other nodes' trainer ranks fetch payloads there
        self.socket = connect_dealer(controller_address, f"rollout-{rank}", zmq.asyncio.Context.instance())
        self.tasks: set[asyncio.Task] = set()
        self.refit_lock = asyncio.Lock()  # one refit (or refit group rebuild) at a time
        self.refit_decisions: dict[tuple[int, int], asyncio.Future] = {}  # (version, attempt): go?

    async def send(self, message: dict) -> None:
        await self.socket.send(pack(message))

    async def serve(self) -> None:
        self.workers = AgentWorkerPool(self.cfg, self.rank)
        self.payloads = None
        self.endpoint = None
        try:
            await self.start()
        except Exception as error:
            await self.send({"type": "failed", "rank": self.rank, "error": f"{type(error).__name__}: {error}"})
            await self.workers.close()
            if self.payloads is not None:
                self.payloads.close()
            raise
        self.workers.on_failure = self.report_worker_failure
        self.lag = LoopLagMonitor(f"rollout rank {self.rank}", RANK_LAG_ADVICE)
        self.lag.start()  # after start-up, which blocks this loop while the engine loads
        self.resources = ProcessResourceSampler("rollout_rank")
        await self.send({"type": "ready", "rank": self.rank})
        handlers = self.handlers()
        try:
            while True:
                message = unpack(await self.socket.recv())
                if message["type"] == "shutdown":
                    break
                handler = handlers.get(message["type"])
                if handler is None:
                    logger.warning("rollout rank %d: ignoring unknown message type %r", self.rank, message["type"])
                    continue
                if wakes_engine(message["type"]):  # an engine asleep (rollout.sleep_while_training) wakes first
                    handler = self.woken(handler)
                self.spawn_task(self.guarded(handler, message))
        finally:
            self.lag.stop()  # stopping the engine blocks this loop: not a lag to warn about
            for task in self.tasks:
                task.cancel()
            await self.workers.request_stop()  # they exit while the engine stops
            if self.endpoint is not None:
                await self.endpoint.stop()
            self.engine.shutdown()
            await self.workers.close()
            self.payloads.close()
            # The controller waits for this before its rank exits (RolloutController.shutdown).
            # Ending the context waits (up to the linger) until the message has left: this process
            # exits right after, without a teardown that would give ZeroMQ's thread time to send it.
            await self.send({"type": "stopped", "rank": self.rank})
            self.socket.context.destroy(linger=2000)

    def handlers(self) -> dict:
        """The coroutine each controller message type runs (as its own task)."""
        return {"rollout": self.run_rollout, "join_refit": self.join_refit, "refit": self.refit,
                "refit_go": self.decide_refit, "refit_cancel": self.decide_refit,
                "leave_refit": self.leave_refit, "score": self.score, "sleep": self.sleep_engine}

    async def start(self) -> None:
        kind = await self.workers.start()  # first: each worker imports the agent file, which fails fast
        payloads = self.cfg.payloads
        self.payloads = PayloadStore(default_node_id(payloads.node_id), host=self.host,
                                     budget_bytes=int(payloads.budget_megabytes * 2**20),
                                     spill_dir=payloads.spill_dir or None, inline_bytes=payloads.inline_bytes)
        # Seeded by engine index, not global rank: a run resumed on another trainer world size samples
        # as the uninterrupted run would.
        engine_index = self.rank - self.cfg.layout.num_trainer_ranks
        self.engine = RolloutEngine.start(self.cfg, seed=self.cfg.seed + engine_index)
        if kind == "chat":
            for problem in find_prefix_breaks(self.engine.tokenizer):
                logger.warning("chat template is not prefix-preserving: %s; such turns open a new segment "
                               "(counted as drift/template_rewrite)", problem)
            self.endpoint = SessionEndpoint(self.engine, self.engine.tokenizer,
                                            model_name=Path(self.cfg.model.path).name,
                                            host=self.cfg.agent.endpoint_host,
                                            tool_call_parser=self.cfg.rollout.tool_call_parser,
                                            image_root=self.cfg.agent.image_root)
            await self.endpoint.start()
        self.workers.attach(engine=self.engine, endpoint=self.endpoint)
        await self.workers.wait_ready()

    async def sleep_engine(self, message: dict) -> None:
        """'sleep': the trainer steps; the engine frees its GPU memory until the next message that needs it."""
        await self.engine.sleep()

    def woken(self, handler):
        async def run_awake(message: dict) -> None:
            await self.engine.wake_up()  # before a refit pauses the engine, or a request or score uses it
            await handler(message)
        return run_awake

    def spawn_task(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def report_worker_failure(self, error: str) -> None:
        """The agent workers cannot go on (a restarted one could not start): the job must stop."""
        self.spawn_task(self.send({"type": "error", "rank": self.rank, "during": "agent worker restart",
                                   "error": error}))

    async def guarded(self, handler, message: dict) -> None:
        """Run one handler; an exception is reported to the controller instead of dying silently."""
        try:
            await handler(message)
        except Exception as error:
            logger.error("rollout rank %d: %s failed:\n%s", self.rank, message["type"], traceback.format_exc())
            await self.send({"type": "error", "rank": self.rank, "during": message["type"],
                             "error": f"{type(error).__name__}: {error}"})

    async def run_rollout(self, message: dict) -> None:
        if message.get("eval"):  # an eval rollout (molt.controller.evaluation): nothing trains on it, so it goes back whole,
            outcome = await self.workers.run(message["request"])
            for experience in outcome.get("experiences", []):
                experience["images"] = None  # ...but its images: the controller reads rewards and tokens only
            await self.send({**outcome, "rank": self.rank})
            return
        outcome = offload_outcome(await self.workers.run(message["request"]), self.payloads,
                                  partial_rollout=self.cfg.rollout.partial_rollout,
                                  image_token_id=self.engine.image_token_id)
        # The step's metric is the max over its outcomes: the worker's loop lag and this loop's.
        outcome["loop_lag_max_seconds"] = max(outcome.get("loop_lag_max_seconds", 0.0), self.lag.take_max())
        outcome["rank"] = self.rank
        # Sent with every outcome, so nothing here may cost more as payloads pile up: no reclaim
        # scan (the store's server thread reclaims), and /proc read about once a second.
        outcome["rank_metrics"] = {**self.payloads.metrics(reclaim=False), **self.resources.read(),
                                   "rollout/prompt_tokens_total": float(self.engine.prompt_tokens),
                                   "rollout/prefill_tokens_total": float(self.engine.prefill_tokens),
                                   "rollout/unrouted_tokens_total": float(self.engine.unrouted_tokens)}
        await self.send(outcome)

    async def join_refit(self, message: dict) -> None:
        async with self.refit_lock:  # after any refit attempt still running (one given up on)
            await self.engine.join_refit_group(**message["group"])
        await self.send({"type": "refit_joined", "rank": self.rank})

    async def refit(self, message: dict) -> None:
        """One refit attempt: pause the engine and get its workers ready, say 'refit_paused', then wait
        for the controller's decision, which it sends once every engine has paused or one missed the
        deadline: 'refit_go' receives and loads, resumes and says 'refit_done'; 'refit_cancel' tears
        the refit group down without loading, resumes on the old weights under their old version
        label and says 'refit_done' with the cancellation as its error (the trainer rebuilds the group
        and retries). A failure is reported in the reply due next; the trainer names this engine,
        rebuilds the refit group and retries. Until a refit succeeds the engine keeps its old weights
        and labels what it samples with their version (or, if a load failed part-way, stays paused)."""
        # Rollouts may be in flight (algorithm.max_staleness > 0); none is aborted. With
        # rollout.partial_rollout their requests are frozen and continue under the new weights;
        # without it they finish under the old ones before the swap (RolloutEngine.swap_weights).
        version, attempt = message["version"], message["attempt"]
        reply = {"rank": self.rank, "version": version, "attempt": attempt}
        timeout = self.cfg.refit.timeout_seconds
        deadline = time.monotonic() + timeout
        paused = False

        async def acknowledge_pause() -> bool:
            nonlocal paused
            if time.monotonic() > deadline:  # the trainer gave up on this attempt: it will not broadcast
                raise RefitError(f"paused only after refit.timeout_seconds={timeout:g}")
            paused = True
            await self.send({"type": "refit_paused", **reply, "error": None})
            # The controller decides by the deadline; a decision still missing a timeout later (the
            # controller is gone) counts as a cancel.
            return await self.refit_decision(version, attempt, deadline + timeout)

        error = None
        async with self.refit_lock:
            try:
                await self.engine.swap_weights(version, partial_rollout=self.cfg.rollout.partial_rollout,
                                               on_paused=acknowledge_pause)
            except RefitCancelled as cancelled:
                logger.info("rollout rank %d: %s", self.rank, cancelled)
                error = f"RefitCancelled: {cancelled}"
            except Exception as failure:
                logger.error("rollout rank %d: refit v%d (attempt %d) failed:\n%s", self.rank, version, attempt,
                             traceback.format_exc())
                error = f"{type(failure).__name__}: {failure}"
            finally:
                self.refit_decisions.pop((version, attempt), None)
        if not paused:  # the trainer is still waiting for the pause
            await self.send({"type": "refit_paused", **reply, "error": error})
            return
        await self.send({"type": "refit_done", **reply, "error": error})

    def _decision(self, version: int, attempt: int) -> asyncio.Future:
        key = (version, attempt)
        if key not in self.refit_decisions:
            self.refit_decisions[key] = asyncio.get_running_loop().create_future()
        return self.refit_decisions[key]

    async def refit_decision(self, version: int, attempt: int, deadline: float) -> bool:
        """True once the controller said 'refit_go' for this attempt; False on 'refit_cancel', or when
        no decision came by `deadline`."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._decision(version, attempt)),
                                          max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            logger.error("rollout rank %d: no go or cancel for refit v%d (attempt %d) from the trainer; "
                         "cancelling it here", self.rank, version, attempt)
            return False

    async def decide_refit(self, message: dict) -> None:
        """'refit_go' or 'refit_cancel' for one attempt; it may arrive before this engine has paused
        (a cancel sent while it was still pausing), and is then found when it does."""
        decision = self._decision(message["version"], message["attempt"])
        if not decision.done():
            decision.set_result(message["type"] == "refit_go")
        for key in [key for key in self.refit_decisions if key < (message["version"], message["attempt"])]:
            del self.refit_decisions[key]  # older attempts' decisions nobody will wait for

    async def leave_refit(self, message: dict) -> None:
        await self.engine.leave_refit_group()
        await self.send({"type": "refit_left", "rank": self.rank})

    async def score(self, message: dict) -> None:
        logprobs = await self.engine.score(message["token_ids"])
        await self.send({"type": "scored", "rank": self.rank, "logprobs": logprobs,
                         "version": self.engine.policy_version})


def offload_outcome(message: dict, store: PayloadStore, *, partial_rollout: bool,
                    image_token_id: int | None = None) -> dict:
    """An agent worker's outcome as the controller gets it (DESIGN section 7): each experience's
    token-axis fields go into this node's payload store and the record carries a reference to
    them; the trainer rank that trains an experience fetches it from there. Without partial
    rollout, experiences are first split where the policy version changes (split_by_version)."""
    outcome = decode_outcome(message)
    if image_token_id is not None and not outcome.failure:
        refuse_sampled_placeholders(outcome, image_token_id)
    if not partial_rollout:
        split_by_version(outcome)
    outcome.experiences = [offload_record(store, e) for e in outcome.experiences]
    return {**message, **encode_outcome(outcome)}


def refuse_sampled_placeholders(outcome: RolloutOutcome, image_token_id: int) -> None:
    """Fail a rollout whose policy sampled the image placeholder token in a segment with images: the
    model would read it as one more image slot than the segment has images (vLLM's expansion of a
    later turn and the trainer's forward both break on it). Rare for a trained model; a random tiny
    model samples it about once in 400 tokens."""
    for experience in outcome.experiences:
        if experience.images is not None and (stray := count_stray_placeholders(
                experience.token_ids, experience.images, image_token_id)):
            outcome.failure = "sampled_image_token"
            outcome.error = (f"the policy sampled the image placeholder (token {image_token_id}) {stray} time(s) in "
                             f"a segment with images; the rollout cannot be trained")
            outcome.experiences = []
            return


def split_by_version(outcome: RolloutOutcome) -> None:
    """Without partial rollout no experience may span two policy versions: a multi-turn rollout
    whose next turn ran under a newer version is split there (molt.trace.experience.split_at_version_changes),
    counted in its drift ledger as 'version_change'."""
    pieces = [split_at_version_changes(e) for e in outcome.experiences]
    num_changes = sum(len(p) - 1 for p in pieces)
    if not num_changes:
        return
    outcome.experiences = [e for p in pieces for e in p]
    for index, experience in enumerate(outcome.experiences):
        experience.segment_index = index
    outcome.ledger = {**outcome.ledger, "version_change": outcome.ledger.get("version_change", 0) + num_changes}
