"""The rollout rank's agent workers: processes that run user agent code, so that it never runs in
the rank that hosts the engine and the session endpoint (DESIGN sections 1, 2.3).

The rank spawns `rollout.num_agent_workers` workers (molt/rollout/agent_worker.py) and talks to them
over one ZeroMQ ROUTER on an ipc:// socket in a private (0700) directory; each worker has a
DEALER with its own identity; msgpack only. The pool

- runs at most `agent.max_concurrent_rollouts` rollouts of the rank at a time and hands each to
  the ready worker with the fewest in flight (a shared cap rather than a fixed share per worker:
  no worker idles while another queues, and a dying worker takes down only what it was running);
- serves the workers' calls without blocking the rank's loop: `generate` on the engine,
  `open_session` / `close_session` on the session endpoint (a worker can close only its own);
- restarts a worker that dies: its in-flight rollouts come back as failed outcomes with reason
  `agent_worker_died`, its sessions and engine requests end, and a warning names it and its exit
  code. A worker still holding a rollout `stuck_grace_seconds` past the rollout timeout has an
  event loop blocked by user code (its own timeout cannot fire): it is killed and restarted the
  same way. A worker that dies before it was ever ready is not restarted: the pool fails;
- kills every worker when the rank shuts down (and on Linux the kernel kills them if the rank
  dies, see molt/rollout/agent_worker.py).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from molt.agents.base import SamplingParams
from molt.config import MoltConfig, engine_start_limit_seconds
from molt.rollout.agent_worker import WorkerSettings, run_agent_worker
from molt.trace.images import ImageInputs
from molt.transport.dispatch import encode_generation, failed_outcome
from molt.transport.wire import pack, unpack

logger = logging.getLogger("molt")


class AgentWorkerError(RuntimeError):
    """The pool cannot go on: a worker could not start."""


@dataclass
class InFlight:
    future: asyncio.Future  # resolved with the outcome message
    request: dict  # the controller's rollout request
    started: float  # time.monotonic() when handed to the worker


@dataclass
class WorkerHandle:
    """The rank's view of one worker process."""

    index: int
    incarnation: int  # 0, then +1 per restart
    identity: str
    process: multiprocessing.process.BaseProcess
    pid: int
    kind: str = ""  # 'chat' | 'env' once it has imported the agent file
    ready: bool = False  # has said ready (stays True after it exits; `alive` says that)
    alive: bool = True
    killed_reason: str = ""  # why the pool killed it, if it did
    in_flight: dict[int, InFlight] = field(default_factory=dict)  # by rollout_id
    sessions: dict = field(default_factory=dict)  # session_id -> Session it opened
    calls: dict[int, asyncio.Task] = field(default_factory=dict)  # call_id -> task serving it

    @property
    def name(self) -> str:
        return f"agent worker {self.index} (pid {self.pid})"


class AgentWorkerPool:
    def __init__(self, cfg: MoltConfig, rank: int, *, stuck_grace_seconds: float = 30.0,
                 on_failure: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.rank = rank
        self.stuck_grace_seconds = stuck_grace_seconds
        self.on_failure = on_failure  # told when the pool fails after start-up
        self.engine = None
        self.endpoint = None
        self.slots = asyncio.Semaphore(cfg.agent.max_concurrent_rollouts)
        self.workers: list[WorkerHandle] = []
        self.failure = ""
        self.closing = False
        self._by_identity: dict[str, WorkerHandle] = {}
        self._changed = asyncio.Event()
        self._spawn_context = multiprocessing.get_context("spawn")
        self._directory = tempfile.mkdtemp(prefix="molt-agents-")  # mode 0700: only this user connects
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.address = f"ipc://{self._directory}/rank{rank}.sock"
        self.socket.bind(self.address)
        self._tasks: list[asyncio.Task] = []

    # -- start and stop --------------------------------------------------------------------

    async def start(self) -> str:
        """Spawn the workers and wait until each has imported the agent file (which fails fast on a
        bad file); returns the runner kind, 'chat' or 'env'."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._receive()), loop.create_task(self._watch_stuck())]
        self.workers = [self._spawn(index, 0) for index in range(self.cfg.rollout.num_agent_workers)]
        await self._wait_until(lambda: all(w.kind for w in self.workers), "import the agent file")
        return self.workers[0].kind

    def attach(self, *, engine, endpoint) -> None:
        """What the workers' calls are served with: the engine, and the endpoint (ChatAgents)."""
        self.engine, self.endpoint = engine, endpoint

    async def wait_ready(self) -> None:
        await self._wait_until(lambda: all(w.ready for w in self.workers), "get ready")

    async def request_stop(self) -> None:
        """Ask every worker to exit, without waiting: the rank stops its engine meanwhile (each takes
        seconds, mostly the interpreter's own exit) and then calls `close`."""
        if self.closing:
            return
        self.closing = True
        for worker in self.workers:
            if worker.alive:
                await self._send(worker, {"type": "shutdown"})

    async def close(self) -> None:
        """Ask every worker to exit (unless `request_stop` has), kill those still running after a few
        seconds, and reap them."""
        await self.request_stop()
        deadline = time.monotonic() + 5.0
        while any(w.process.is_alive() for w in self.workers) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for worker in self.workers:
            self._stop_watching(worker)
            if worker.process.is_alive():
                worker.process.kill()
            worker.process.join(5)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.socket.close(0)
        self.context.term()
        shutil.rmtree(self._directory, ignore_errors=True)

    def _spawn(self, index: int, incarnation: int) -> WorkerHandle:
        identity = f"agent-{index}.{incarnation}"
        settings = WorkerSettings(
            rank=self.rank, index=index, identity=identity, address=self.address, parent_pid=os.getpid(),
            agent_path=self.cfg.agent.path, model_path=self.cfg.model.path,
            rollout_timeout_seconds=self.cfg.agent.rollout_timeout_seconds,
            share_tls_context=self.cfg.agent.share_tls_context,
            on_context_exhausted=self.cfg.agent.on_context_exhausted,
            context_exhausted_reward=self.cfg.agent.context_exhausted_reward)
        process = self._spawn_context.Process(target=run_agent_worker, args=(settings,),
                                              name=f"molt-agent-worker-{self.rank}.{index}")
        process.start()
        worker = WorkerHandle(index=index, incarnation=incarnation, identity=identity, process=process,
                              pid=process.pid)
        self._by_identity[identity] = worker
        asyncio.get_running_loop().add_reader(process.sentinel, self._on_exit, worker)
        return worker

    def _stop_watching(self, worker: WorkerHandle) -> None:
        try:
            asyncio.get_running_loop().remove_reader(worker.process.sentinel)
        except (ValueError, OSError):  # the sentinel is already closed
            pass

    async def _wait_until(self, predicate: Callable[[], bool], what: str) -> None:
        timeout = engine_start_limit_seconds(self.cfg)

        async def until() -> None:
            while not predicate() and not self.failure:
                await self._changed.wait()

        try:
            await asyncio.wait_for(until(), timeout)
        except asyncio.TimeoutError:
            raise AgentWorkerError(f"rollout rank {self.rank}: agent workers did not {what} within {timeout:.0f}s "
                                   f"(rollout.engine_start_timeout_seconds)") from None
        if self.failure:
            raise AgentWorkerError(self.failure)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _fail(self, message: str) -> None:
        if not self.failure:
            self.failure = message
            logger.error("rollout rank %d: %s", self.rank, message)
            if self.on_failure is not None:
                self.on_failure(message)
        self._notify()

    # -- rollouts --------------------------------------------------------------------------

    async def run(self, request: dict) -> dict:
        """Run one rollout (the controller's request dict) on the ready worker with the fewest in
        flight; returns its outcome message."""
        async with self.slots:
            while not (ready := [w for w in self.workers if w.ready and w.alive]):
                if self.failure:
                    raise AgentWorkerError(self.failure)
                await self._changed.wait()
            worker = min(ready, key=lambda w: len(w.in_flight))
            future = asyncio.get_running_loop().create_future()
            worker.in_flight[request["rollout_id"]] = InFlight(future=future, request=request, started=time.monotonic())
            await self._send(worker, {"type": "rollout", "request": request})
            return await future

    async def _send(self, worker: WorkerHandle, message: dict) -> None:
        try:
            await self.socket.send_multipart([worker.identity.encode(), pack(message)])
        except zmq.ZMQError as error:  # it has just exited (ROUTER_MANDATORY): its exit handler reports it
            logger.debug("rollout rank %d: cannot reach %s: %s", self.rank, worker.name, error)

    async def _receive(self) -> None:
        while True:
            identity, *frames = await self.socket.recv_multipart()
            worker = self._by_identity.get(identity.decode(errors="replace"))
            if worker is None or not worker.alive:
                continue  # a late message of a worker that has exited, or a stranger's: never decoded
            try:
                if len(frames) != 1:
                    raise ValueError(f"expected one frame, got {len(frames)}")
                self._handle(worker, unpack(frames[0]))
            except Exception:  # a bug of ours; the pool keeps serving the others
                logger.exception("rollout rank %d: bad message from %s", self.rank, worker.name)

    def _handle(self, worker: WorkerHandle, message: dict) -> None:
        kind = message["type"]
        if kind == "outcome":
            entry = worker.in_flight.pop(message["rollout_id"], None)
            if entry is not None and not entry.future.done():
                entry.future.set_result(message)
        elif kind == "call":
            task = asyncio.create_task(self._serve_call(worker, message))
            worker.calls[message["call_id"]] = task
            task.add_done_callback(lambda _, w=worker, c=message["call_id"]: w.calls.pop(c, None))
        elif kind == "cancel":
            if (task := worker.calls.get(message["call_id"])) is not None:
                task.cancel()
        elif kind == "loaded":
            worker.kind = message["kind"]
            self._notify()
        elif kind == "ready":
            worker.ready = True
            if worker.incarnation:
                logger.info("rollout rank %d: %s is back (restart %d)", self.rank, worker.name, worker.incarnation)
            self._notify()
        elif kind == "failed":
            self._fail(f"{worker.name} could not start: {message['error']}")

    # -- calls from the workers -------------------------------------------------------------

    async def _serve_call(self, worker: WorkerHandle, message: dict) -> None:
        try:
            reply = {"result": await self._call(worker, message["method"], message.get("args") or {})}
        except Exception as error:
            reply = {"error": f"{type(error).__name__}: {error}"}
        await self._send(worker, {"type": "reply", "call_id": message["call_id"], **reply})

    async def _call(self, worker: WorkerHandle, method: str, args: dict) -> dict:
        if method == "generate":
            generation = await self.engine.generate(list(args["token_ids"]), SamplingParams(**args["sampling"]),
                                                    images=ImageInputs.from_dict(args.get("images")))
            return encode_generation(generation)
        if method in ("open_session", "close_session") and self.endpoint is None:
            raise RuntimeError(f"{method}: this rank has no session endpoint (the agent is not a ChatAgentRunner)")
        if method == "open_session":
            session = await self.endpoint.begin_session(sampling=SamplingParams(**args["sampling"]),
                                                        max_length=args["max_length"])
            worker.sessions[session.session_id] = session
            return {"session_id": session.session_id, "api_key": session.api_key, "base_url": session.base_url,
                    "session_url": session.session_url, "model_name": session.model_name}
        if method == "close_session":
            session = worker.sessions.pop(args["session_id"], None)
            if session is None:
                raise KeyError(f"no open session {args['session_id']!r} of this worker")
            record = await self.endpoint.end_session(session)
            return {"segments": [s.to_dict() for s in record.segments], "ledger": dict(record.ledger),
                    "context_exhausted": record.context_exhausted}
        raise ValueError(f"unknown call {method!r}")

    # -- faults ----------------------------------------------------------------------------

    def _on_exit(self, worker: WorkerHandle) -> None:
        """The worker process has exited (its sentinel became readable)."""
        self._stop_watching(worker)
        worker.process.join()  # reap it; it has exited, so this returns at once
        worker.alive = False
        if self.closing:
            return
        self._by_identity.pop(worker.identity, None)
        for task in list(worker.calls.values()):
            task.cancel()  # e.g. aborts its engine requests
        for session in worker.sessions.values():
            self.endpoint.close_session(session)
        worker.sessions.clear()
        code = worker.process.exitcode
        if not worker.ready:  # restarting a worker that cannot start would loop forever
            self._fail(f"{worker.name} exited with code {code} before it was ready")
            return
        lost, worker.in_flight = worker.in_flight, {}
        cause = worker.killed_reason or f"died with exit code {code}"
        logger.warning("rollout rank %d: %s %s; its %d in-flight rollouts fail as agent_worker_died; restarting it",
                       self.rank, worker.name, cause, len(lost))
        for rollout_id, entry in lost.items():
            if not entry.future.done():
                entry.future.set_result(failed_outcome(
                    entry.request, "agent_worker_died", f"{worker.name} {cause} while running rollout {rollout_id}"))
        worker.process.close()  # its sentinel; the replacement has its own
        self.workers[worker.index] = self._spawn(worker.index, worker.incarnation + 1)
        self._notify()

    async def _watch_stuck(self) -> None:
        """Kill a worker that holds a rollout well past the rollout timeout: its loop is blocked."""
        limit = self.cfg.agent.rollout_timeout_seconds + self.stuck_grace_seconds
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            now = time.monotonic()
            for worker in self.workers:
                oldest = min((entry.started for entry in worker.in_flight.values()), default=now)
                if worker.alive and not worker.killed_reason and now - oldest > limit:
                    worker.killed_reason = (f"was killed: it held a rollout {now - oldest:.0f}s, past "
                                            f"agent.rollout_timeout_seconds={self.cfg.agent.rollout_timeout_seconds} "
                                            f"+ {self.stuck_grace_seconds:.0f}s, so user code blocks its event loop")
                    worker.process.kill()
