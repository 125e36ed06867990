"""An agent worker: the process that runs user agent code (DESIGN sections 1, 2.3).

Each rollout rank spawns `rollout.num_agent_workers` of them (molt/rollout/agent_pool.py). A worker
imports the user's agent file itself, runs the rollouts its rank hands it concurrently with
asyncio, each under `agent.rollout_timeout_seconds`, and sends back each outcome. It never
imports vLLM: what a runner needs from the rank it gets over the worker's ZeroMQ DEALER socket,
msgpack messages only, through two small clients with the interfaces the runners use in-process:

- RemoteEngine (StepEnvRunner): `generate` -> the rank's engine.
- RemoteSessions (ChatAgentRunner): `begin_session` / `end_session` -> the rank's session
  endpoint. The agent itself talks HTTP to that endpoint over loopback with the real SDKs.

Messages worker -> rank: loaded {kind}, ready, failed {error}, outcome, call {call_id, method,
args}, cancel {call_id}. Rank -> worker: rollout {request}, reply {call_id, result | error}, shutdown.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
from dataclasses import dataclass

import zmq
import zmq.asyncio

from molt.agents.base import SamplingParams, load_agent_runner
from molt.agents.chat import ChatAgentRunner, SessionRecord
from molt.agents.env import run_with_timeout
from molt.agents.tls import share_default_tls_context
from molt.distributed.lifetime import exit_with_parent
from molt.metrics import configure_logging
from molt.rollout.loop_lag import LoopLagMonitor
from molt.trace.experience import Segment
from molt.trace.generation import Generation
from molt.trace.images import ImageInputs
from molt.transport.dispatch import decode_generation, decode_request, encode_outcome, failed_outcome, plain_fields
from molt.transport.wire import connect_dealer, pack, unpack

logger = logging.getLogger("molt")

BLOCKING_ADVICE = ("user agent code is blocking the event loop (a synchronous call such as time.sleep, a "
                   "blocking HTTP client or a long computation in async code); every rollout of this worker "
                   "waits meanwhile. Await instead, use the SDKs' async clients, or move blocking work to "
                   "asyncio.to_thread")


# -- the rollout wire format (controller -> rank -> worker and back) ----------------------------








# -- the worker's side of its rank ---------------------------------------------------------------


class RankCallError(RuntimeError):
    """The rank could not serve a call (the engine failed, an unknown session...)."""


class RankLink:
    """The worker's DEALER socket to its rank: sends messages, and matches replies to calls."""

    def __init__(self, socket: zmq.asyncio.Socket):
        self.socket = socket
        self._call_ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}

    async def send(self, message: dict) -> None:
        await self.socket.send(pack(message))

    async def call(self, method: str, **args) -> dict:
        call_id = next(self._call_ids)
        reply = self._pending[call_id] = asyncio.get_running_loop().create_future()
        try:
            await self.send({"type": "call", "call_id": call_id, "method": method, "args": args})
            message = await reply
        except asyncio.CancelledError:
            # The rollout ended (timeout) while waiting: the rank stops the work, e.g. aborts the
            # engine request, instead of finishing it for no one.
            await self.send({"type": "cancel", "call_id": call_id})
            raise
        finally:
            self._pending.pop(call_id, None)
        if "error" in message:
            raise RankCallError(f"{method}: {message['error']}")
        return message["result"]

    def resolve(self, message: dict) -> None:
        reply = self._pending.get(message["call_id"])
        if reply is not None and not reply.done():
            reply.set_result(message)


class RemoteEngine:
    """The rank's engine, as a StepEnvRunner's sampler."""

    def __init__(self, link: RankLink):
        self.link = link

    async def generate(self, token_ids: list[int], sampling: SamplingParams,
                       images: ImageInputs | None = None) -> Generation:
        result = await self.link.call("generate", token_ids=list(token_ids), sampling=plain_fields(sampling),
                                      images=images.for_engine().to_dict() if images else None)
        return decode_generation(result)


@dataclass(kw_only=True)
class RemoteSession:
    """What an agent needs of a session opened on the rank's endpoint."""

    session_id: str
    api_key: str
    base_url: str  # session root + /v1 (OpenAI SDK)
    session_url: str  # session root (Anthropic SDK)
    model_name: str


class RemoteSessions:
    """The rank's session endpoint, as a ChatAgentRunner's `endpoint`."""

    def __init__(self, link: RankLink):
        self.link = link

    async def begin_session(self, *, sampling: SamplingParams, max_length: int) -> RemoteSession:
        result = await self.link.call("open_session", sampling=plain_fields(sampling), max_length=max_length)
        return RemoteSession(**result)

    async def end_session(self, session: RemoteSession) -> SessionRecord:
        result = await self.link.call("close_session", session_id=session.session_id)
        return SessionRecord(segments=[Segment.from_dict(s) for s in result["segments"]], ledger=result["ledger"],
                             context_exhausted=result["context_exhausted"])


# -- the process -------------------------------------------------------------------------------


@dataclass(kw_only=True)
class WorkerSettings:
    """Plain values a worker is started with (spawn hands them over at process start)."""

    rank: int
    index: int
    identity: str  # its DEALER identity on the rank's ROUTER (unique per restart)
    address: str  # the rank's ROUTER (ipc://)
    parent_pid: int
    agent_path: str
    model_path: str
    rollout_timeout_seconds: float
    share_tls_context: bool
    on_context_exhausted: str  # agent.on_context_exhausted
    context_exhausted_reward: float


def run_agent_worker(settings: WorkerSettings) -> None:
    """Entry point of an agent worker process (the multiprocessing spawn target)."""
    configure_logging(settings.rank)
    # Ctrl-C reaches the whole process group; the rank decides what happens, and its workers go with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(settings.parent_pid)  # no orphans, however the rank exits
    asyncio.run(AgentWorker(settings).serve())


class AgentWorker:
    def __init__(self, settings: WorkerSettings):
        self.settings = settings
        self.name = f"agent worker {settings.index} of rollout rank {settings.rank} (pid {os.getpid()})"
        self.link = RankLink(connect_dealer(settings.address, settings.identity, zmq.asyncio.Context()))
        self.tasks: set[asyncio.Task] = set()

    async def serve(self) -> None:
        try:
            self.runner = load_agent_runner(self.settings.agent_path)
        except Exception as error:
            return await self.report_failure(error)
        is_chat = isinstance(self.runner, ChatAgentRunner)
        await self.link.send({"type": "loaded", "kind": "chat" if is_chat else "env"})
        try:
            self.attach_rank(is_chat)
        except Exception as error:
            return await self.report_failure(error)
        self.lag = LoopLagMonitor(self.name, BLOCKING_ADVICE)
        self.lag.start()
        await self.link.send({"type": "ready"})
        try:
            while (message := unpack(await self.link.socket.recv()))["type"] != "shutdown":
                if message["type"] == "reply":
                    self.link.resolve(message)
                elif message["type"] == "rollout":
                    task = asyncio.create_task(self.run_rollout(message))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
        finally:
            self.lag.stop()
            for task in self.tasks:
                task.cancel()
            self.link.socket.close(0)

    async def report_failure(self, error: Exception) -> None:
        """Say why this worker cannot start, then wait for the rank to stop it: exiting at once could
        beat the message to the rank (which would only see an exit code)."""
        logger.error("%s cannot start", self.name, exc_info=error)  # the traceback into the user's file
        await self.link.send({"type": "failed", "error": f"{type(error).__name__}: {error}"})
        while unpack(await self.link.socket.recv())["type"] != "shutdown":
            pass
        self.link.socket.close(0)

    def attach_rank(self, is_chat: bool) -> None:
        """What the runner reaches the rank through. The Env path tokenizes here (the same tokenizer
        as the engine's, from model.path); the ChatAgent path never tokenizes."""
        self.sampler = RemoteEngine(self.link)
        self.tokenizer = None
        if is_chat:
            self.runner.endpoint = RemoteSessions(self.link)
            self.runner.on_context_exhausted = self.settings.on_context_exhausted
            self.runner.context_exhausted_reward = self.settings.context_exhausted_reward
            if self.settings.share_tls_context:
                share_default_tls_context()
        else:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.settings.model_path)

    async def run_rollout(self, message: dict) -> None:
        request = message["request"]
        try:
            outcome = await run_with_timeout(self.runner, decode_request(message), self.sampler, self.tokenizer,
                                             self.settings.rollout_timeout_seconds)
            outcome.loop_lag_max_seconds = self.lag.take_max()
            frame = pack(encode_outcome(outcome))
        except Exception as error:  # a request it cannot decode or an outcome msgpack cannot carry
            logger.exception("%s: rollout %s failed outside the agent", self.name, request.get("rollout_id"))
            frame = pack(failed_outcome(request, "agent_error", f"{type(error).__name__}: {error}"))
        await self.link.socket.send(frame)
