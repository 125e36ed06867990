"""A rollout rank: hosts one vLLM engine and runs agent rollouts against it on the controller's request.

It talks to the controller (rank 0) over one ZeroMQ DEALER socket; every message is a msgpack
map with a 'type'. Rollouts run concurrently as asyncio tasks; refits run between steps.
"""

from __future__ import annotations

import asyncio
import logging
import os
import traceback
from pathlib import Path

import zmq
import zmq.asyncio

from molt.agents.base import RolloutOutcome, RolloutRequest, SamplingParams, load_agent_runner
from molt.agents.chat import ChatAgentRunner
from molt.agents.env import run_with_timeout
from molt.agents.tls import share_default_tls_context
from molt.config import MoltConfig
from molt.endpoint.server import SessionEndpoint
from molt.endpoint.template_check import find_prefix_breaks
from molt.engine import RolloutEngine
from molt.experience import Experience
from molt.wire import connect_dealer, pack, unpack

logger = logging.getLogger("molt")


def encode_outcome(outcome: RolloutOutcome) -> dict:
    return {"type": "outcome", "rollout_id": outcome.rollout_id, "group_id": outcome.group_id,
            "failure": outcome.failure, "error": outcome.error, "ledger": outcome.ledger,
            "experiences": [e.to_dict() for e in outcome.experiences]}


def decode_outcome(message: dict) -> RolloutOutcome:
    return RolloutOutcome(rollout_id=message["rollout_id"], group_id=message["group_id"],
                          failure=message["failure"], error=message["error"], ledger=message["ledger"],
                          experiences=[Experience.from_dict(e) for e in message["experiences"]])


def decode_request(message: dict) -> RolloutRequest:
    fields = dict(message["request"])
    fields["sampling"] = SamplingParams(**fields["sampling"])
    return RolloutRequest(**fields)


def run_rollout_rank(cfg: MoltConfig, rank: int, controller_address: str) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM is imported; workers inherit it
    asyncio.run(RolloutService(cfg, rank, controller_address).serve())


class RolloutService:
    def __init__(self, cfg: MoltConfig, rank: int, controller_address: str):
        self.cfg = cfg
        self.rank = rank
        self.socket = connect_dealer(controller_address, f"rollout-{rank}", zmq.asyncio.Context.instance())
        self.slots = asyncio.Semaphore(cfg.agent.max_concurrent_rollouts)
        self.tasks: set[asyncio.Task] = set()

    async def send(self, message: dict) -> None:
        await self.socket.send(pack(message))

    async def serve(self) -> None:
        try:
            self.runner = load_agent_runner(self.cfg.agent.path)  # first: it fails fast
            self.engine = RolloutEngine.start(self.cfg, seed=self.cfg.seed + self.rank)
            self.endpoint = None
            if isinstance(self.runner, ChatAgentRunner):
                if self.cfg.agent.share_tls_context:
                    share_default_tls_context()
                for problem in find_prefix_breaks(self.engine.tokenizer):
                    logger.warning("chat template is not prefix-preserving: %s; such turns open a new segment "
                                   "(counted as drift/template_rewrite)", problem)
                self.endpoint = SessionEndpoint(self.engine, self.engine.tokenizer,
                                                model_name=Path(self.cfg.model.path).name,
                                                host=self.cfg.agent.endpoint_host)
                await self.endpoint.start()
                self.runner.endpoint = self.endpoint
        except Exception as error:
            await self.send({"type": "failed", "rank": self.rank, "error": f"{type(error).__name__}: {error}"})
            raise
        await self.send({"type": "ready", "rank": self.rank})
        handlers = {"rollout": self.run_rollout, "join_refit": self.join_refit, "refit": self.refit,
                    "leave_refit": self.leave_refit, "score": self.score}
        try:
            while True:
                message = unpack(await self.socket.recv())
                if message["type"] == "shutdown":
                    break
                handler = handlers.get(message["type"])
                if handler is None:
                    logger.warning("rollout rank %d: ignoring unknown message type %r", self.rank, message["type"])
                    continue
                task = asyncio.create_task(self.guarded(handler, message))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        finally:
            for task in self.tasks:
                task.cancel()
            if self.endpoint is not None:
                await self.endpoint.stop()
            self.engine.shutdown()
            self.socket.close(0)

    async def guarded(self, handler, message: dict) -> None:
        """Run one handler; an exception is reported to the controller instead of dying silently."""
        try:
            await handler(message)
        except Exception as error:
            logger.error("rollout rank %d: %s failed:\n%s", self.rank, message["type"], traceback.format_exc())
            await self.send({"type": "error", "rank": self.rank, "during": message["type"],
                             "error": f"{type(error).__name__}: {error}"})

    async def run_rollout(self, message: dict) -> None:
        request = decode_request(message)
        async with self.slots:
            outcome = await run_with_timeout(self.runner, request, self.engine, self.engine.tokenizer,
                                             self.cfg.agent.rollout_timeout_seconds)
        await self.send(encode_outcome(outcome))

    async def join_refit(self, message: dict) -> None:
        await self.engine.join_refit_group(**message["group"])
        await self.send({"type": "refit_joined", "rank": self.rank})

    async def refit(self, message: dict) -> None:
        # Synchronous mode: the controller refits only when no rollout is in flight, so pausing
        # keeps nothing and aborts nothing; it fences the engine while its weights change.
        await self.engine.llm.pause_generation(mode="keep", clear_cache=True)
        try:
            await self.engine.receive_weights(message["version"])
        finally:
            await self.engine.llm.resume_generation()
        await self.send({"type": "refit_done", "rank": self.rank, "version": message["version"]})

    async def leave_refit(self, message: dict) -> None:
        await self.engine.leave_refit_group()
        await self.send({"type": "refit_left", "rank": self.rank})

    async def score(self, message: dict) -> None:
        logprobs = await self.engine.score(message["token_ids"])
        await self.send({"type": "scored", "rank": self.rank, "logprobs": logprobs,
                         "version": self.engine.policy_version})
