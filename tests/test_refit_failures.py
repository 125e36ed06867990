"""Refit failures (RELIABILITY cases 2, 3, 4 and 29) on the real parts: the gloo refit group between
processes with Molt's own receiver code, the controller's real ZeroMQ socket, and the shared vLLM
CPU engine where the engine itself matters.

- case 2: an engine worker that dies, or hangs, part-way through the broadcast fails the sender
  within refit.timeout_seconds (never a hang); a rebuilt group then delivers every weight bit for bit.
- case 4: the refit group torn down and rebuilt three times in a row (a restarted engine each time),
  with the sender on global rank 1 of two FSDP2 trainer ranks.
- case 3: per refit attempt the controller sends two messages per engine and receives two, and its
  counters say what ZeroMQ took: a send to a rank that is gone raises, naming it, and counts nothing.
- case 29: an engine whose broadcast stops part-way either kept its old weights (nothing was loaded:
  it resumes, serving bitwise the old log-probs under the old label) or stays paused until a refit
  succeeds (some layers were new: it never serves the mix under either label); so does one whose
  load completed but whose new version label the engine core did not take.
- case 2, the trainer's side: a rebuilt group that an engine cannot join stops the job naming it.
"""

import asyncio
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distributed import run_ranks
from molt.config import MoltConfig
from molt.refit.coordinator import RefitCoordinator
from molt.refit.gloo import RefitSender
from molt.refit.receiver import RefitReceiver
from molt.refit.weight_sync import RefitError, RefitSendError
from molt.transport.mailbox import Mailbox, RolloutRankError
from molt.transport.wire import Router, connect_dealer, pack, unpack

TIMEOUT_SECONDS = 5.0  # refit.timeout_seconds of these groups
SLACK_SECONDS = 60.0  # what a loaded 2-core machine may add to a bound (stated, generous)
PROBE = list(range(3, 45))


class StandaloneReceiver(RefitReceiver):
    """Molt's engine-worker receive code outside vLLM: no tensor-parallel state to ask."""

    def molt_tensor_parallel_rank(self) -> int:
        return 0


def _tiny_model(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        intermediate_size=128, vocab_size=64, max_position_embeddings=128, tie_word_embeddings=True)
    return transformers.Qwen3ForCausalLM(config)


def _join_message(sender: RefitSender, rank: int = 1, world_size: int = 2) -> dict:
    group = dict(sender.group_message("127.0.0.1", world_size))
    group.pop("backend")
    return {**group, "rank": rank}


# -- case 2: an engine worker that dies or hangs during the broadcast --------------------------------


def _engine_worker(connection, fault: str | None) -> None:
    """An engine worker's refit side in its own process: joins each group it is sent, receives, and
    reports what it got. `fault` ('die' or 'hang') strikes once, after the first weight arrived."""
    import vllm.model_executor.model_loader.reload.layerwise  # noqa: F401  (the receive's import: seconds)

    receiver = StandaloneReceiver()
    connection.send("started")
    while (group := connection.recv()) is not None:
        receiver.molt_join_refit_group(**group)
        received = {}
        try:
            for name, tensor in receiver.molt_stream_weights():
                received[name] = tensor.clone()
                if fault == "die":
                    os._exit(17)  # killed mid-broadcast (OOM killer, a crash in the worker)
                if fault == "hang":
                    fault = None
                    os.kill(os.getpid(), signal.SIGSTOP)  # frozen until the test sends SIGCONT
            connection.send(("received", received))
        except RuntimeError as error:  # gloo: the group's timeout, or the sender went away
            connection.send(("failed", str(error)))
        receiver.molt_leave_refit_group()


def _start_workers(*faults: str | None) -> list[tuple]:
    """(process, connection) per fault, started side by side; returns once each has done its imports
    (seconds here), so it joins a group well within the group's timeout."""
    context = mp.get_context("spawn")
    workers = []
    for fault in faults:
        parent, child = context.Pipe()
        process = context.Process(target=_engine_worker, args=(child, fault), daemon=True)
        process.start()
        workers.append((process, parent))
    for _, connection in workers:
        assert connection.poll(SLACK_SECONDS) and connection.recv() == "started"
    return workers


def _timed_broadcast(sender: RefitSender) -> tuple[float, str | None]:
    started = time.monotonic()
    try:
        sender.broadcast()
        return time.monotonic() - started, None
    except RefitSendError as error:
        return time.monotonic() - started, str(error)


def _assert_received_bitwise(connection, model) -> None:
    assert connection.poll(TIMEOUT_SECONDS + SLACK_SECONDS)
    status, received = connection.recv()
    assert status == "received", received
    parameters = dict(model.named_parameters())
    assert received.keys() == parameters.keys()
    for name, parameter in parameters.items():
        assert torch.equal(received[name], parameter.detach()), name


@pytest.mark.e2e
def test_an_engine_worker_that_dies_or_hangs_mid_broadcast_fails_the_send_within_the_timeout_and_the_next_refit_works():
    model = _tiny_model()
    sender = RefitSender(model, is_sender=True, bucket_bytes=16 << 10, timeout_seconds=TIMEOUT_SECONDS)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert len(sender.buckets) > 2
    (dying, to_dying), (hanging, to_hanging) = _start_workers("die", "hang")
    try:
        # Dies after its first weight: the sender fails at once, before all the buckets went out.
        to_dying.send(_join_message(sender))
        sender.connect()
        seconds, error = _timed_broadcast(sender)
        dying.join(SLACK_SECONDS)
        assert dying.exitcode == 17
        assert error is not None and error.startswith("gloo broadcast failed after"), error
        assert int(error.removeprefix("gloo broadcast failed after ").split()[0]) < model_bytes
        assert seconds < TIMEOUT_SECONDS + SLACK_SECONDS
        # Freezes after its first weight: the sender fails at the group's timeout, not later, not never.
        sender.close_group()
        to_hanging.send(_join_message(sender))
        sender.connect()
        seconds, error = _timed_broadcast(sender)
        assert error is not None and "Timed out" in error, error
        assert TIMEOUT_SECONDS <= seconds < TIMEOUT_SECONDS + SLACK_SECONDS
        sender.close_group()  # the trainer gives up on the attempt and drops the group
        os.kill(hanging.pid, signal.SIGCONT)
        # Thawed, the worker finds the group gone: its receive fails instead of waiting forever.
        assert to_hanging.poll(TIMEOUT_SECONDS + SLACK_SECONDS)
        status, message = to_hanging.recv()
        assert status == "failed", message
        # The next refit, with other weights, over a fresh group: every weight arrives bit for bit.
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1.5)
        to_hanging.send(_join_message(sender))
        sender.connect()
        assert _timed_broadcast(sender)[1] is None
        _assert_received_bitwise(to_hanging, model)
        to_hanging.send(None)
        hanging.join(SLACK_SECONDS)
    finally:
        for worker in (dying, hanging):
            if worker.is_alive():
                os.kill(worker.pid, signal.SIGCONT)
                worker.kill()


# -- case 4: three rebuilds in a row, the sender on global rank 1 --------------------------------------


def _rebuild_three_times(rank: int, world_size: int, model_dir: str, num_rebuilds: int) -> list[float]:
    """Two FSDP2 trainer ranks; global rank 1 sends. Each round: the old group is torn down, a fresh
    engine worker (a thread of rank 0's process here, as a restarted engine) joins a fresh group, the
    shards change, and the worker must receive exactly the gathered weights."""
    from molt.trainer.sharded_model import build_actor_model
    from molt.distributed.parallelize import ShardingPlan, TrainerMesh

    mesh = TrainerMesh.from_group(dist.group.WORLD, "cpu")
    model = build_actor_model(model_dir, mesh=mesh, device=torch.device("cpu"), plan=ShardingPlan())
    is_sender = rank == 1
    sender = RefitSender(model, is_sender=is_sender, bucket_bytes=256 << 10, timeout_seconds=60)
    generator = torch.Generator().manual_seed(rank)
    gaps = []
    for _ in range(num_rebuilds):
        sender.close_group()
        message = [_join_message(sender) if is_sender else None]
        dist.broadcast_object_list(message, src=1)  # the join message, as the controller would send it
        received, worker = {}, None
        if rank == 0:
            def receive(group=message[0]):
                receiver = StandaloneReceiver()
                receiver.molt_join_refit_group(**group)
                received.update((name, t.clone()) for name, t in receiver.molt_stream_weights())
                receiver.molt_leave_refit_group()

            worker = threading.Thread(target=receive)
            worker.start()
        if is_sender:
            sender.connect()
        with torch.no_grad():
            for param in model.parameters():
                local = param.to_local()
                local.add_(torch.randn(local.shape, generator=generator) * 0.02)
        sender.broadcast()
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        if worker is not None:
            worker.join(120)
            assert received.keys() == full.keys()
            gaps.append(max((received[n] - full[n]).abs().max().item() for n in full))
    return gaps


@pytest.mark.e2e
def test_the_refit_group_is_rebuilt_three_times_in_a_row_with_the_sender_on_global_rank_1(tiny_model_dir):
    receiving, sending = run_ranks(_rebuild_three_times, 2, str(tiny_model_dir), 3, timeout_seconds=300)
    assert receiving == [0.0, 0.0, 0.0]  # every round: bit for bit what the two shards hold


# -- case 3: control messages per refit, counted as sent ---------------------------------------------


def _stand_in_rollout_rank(address, rank: int, num_refits: int, counted: dict) -> None:
    """Answers each 'refit' as a rollout rank does (paused, then done) and counts what reached it."""
    import zmq

    context = zmq.Context()
    socket = connect_dealer(address, f"rollout-{rank}", context)
    try:
        socket.send(pack({"type": "ready", "rank": rank}))
        for _ in range(num_refits):
            frame = socket.recv()
            counted["messages"] += 1
            counted["bytes"] += len(frame)
            message = unpack(frame)
            reply = {"rank": rank, "version": message["version"], "attempt": message["attempt"], "error": None}
            socket.send(pack({"type": "refit_paused", **reply}))
            frame = socket.recv()  # the controller's go, once every engine paused
            counted["messages"] += 1
            counted["bytes"] += len(frame)
            assert unpack(frame) == {"type": "refit_go", "version": message["version"], "attempt": message["attempt"]}
            socket.send(pack({"type": "refit_done", **reply}))
        socket.recv()  # the shutdown, which the test sends last
    finally:
        socket.close(0)
        context.term()


def test_a_refit_costs_two_messages_out_and_two_back_per_engine_counted_as_delivered():
    cfg = MoltConfig()
    cfg.refit.timeout_seconds = 60
    num_refits, ranks = 3, [1, 2]
    router = Router("127.0.0.1")
    counted = {rank: {"messages": 0, "bytes": 0} for rank in ranks}
    threads = [threading.Thread(target=_stand_in_rollout_rank, args=(router.address, rank, num_refits, counted[rank]),
                                daemon=True) for rank in ranks]
    for thread in threads:
        thread.start()
    mailbox = Mailbox(router, ranks)
    coordinator = RefitCoordinator(cfg, None, mailbox, host="127.0.0.1", group=None, device=torch.device("cpu"))
    try:
        mailbox.expect("ready", len(ranks), 60, "start")
        for version in range(1, num_refits + 1):  # RefitCoordinator.attempt's messages, without the broadcast
            before = (router.messages_sent, router.bytes_sent, router.messages_received)
            mailbox.send_to_rollout_ranks({"type": "refit", "version": version, "attempt": 1})
            deadline = time.monotonic() + cfg.refit.timeout_seconds
            assert coordinator.await_paused(version, 1, deadline) is None
            coordinator.decide_refit(version, 1, go=True)
            assert coordinator.finish_refit(version, 1, deadline, None) is None
            assert router.messages_sent - before[0] == 2 * len(ranks)  # O(engines), never O(parameters)
            assert router.messages_received - before[2] == 2 * len(ranks)
        # A rollout rank that is gone: the send raises naming it, and nothing is counted as sent.
        before = (router.messages_sent, router.bytes_sent)
        with pytest.raises(ConnectionError, match="rollout-3 is not connected to the controller"):
            router.send("rollout-3", {"type": "refit", "version": 9, "attempt": 1})
        assert (router.messages_sent, router.bytes_sent) == before
        mailbox.send_to_rollout_ranks({"type": "shutdown"})
        for thread in threads:
            thread.join(60)
    finally:
        router.close()
    # What the counters say went out is what the ranks got, message for message and byte for byte.
    assert router.messages_sent == sum(c["messages"] for c in counted.values()) + len(ranks)  # + the shutdowns
    shutdown_bytes = len(pack({"type": "shutdown"})) * len(ranks)
    assert router.bytes_sent == sum(c["bytes"] for c in counted.values()) + shutdown_bytes
    assert all(c["messages"] == 2 * num_refits for c in counted.values())


# -- case 29: a broadcast that stops part-way, on the real engine ---------------------------------------


class SenderThatStops(RefitSender):
    """The trainer's sender, going away after `num_buckets` buckets (a trainer rank killed mid-refit):
    it sends no more and drops its group, so the engine's next receive finds the connection closed."""

    def __init__(self, model, num_buckets: int):
        super().__init__(model, is_sender=True, bucket_bytes=256 << 10, timeout_seconds=30)
        self.num_buckets = num_buckets
        self.num_sent = 0

    def send_bucket(self, bucket, tensors):
        if self.num_sent == self.num_buckets:
            self.close_group()
            raise RefitSendError(f"stopped after {self.num_buckets} buckets")
        self.num_sent += 1
        wait = super().send_bucket(bucket, tensors)
        wait()
        return None


def _refit_engine(engine, sender: RefitSender, version: int) -> BaseException | None:
    """One refit of the shared engine from `sender` over a fresh group, as the trainer runs one
    attempt: the broadcast starts once the engine has paused. Returns the engine's error, if any."""
    message = _join_message(sender)
    joined = engine.submit(engine.engine.join_refit_group(**message))
    sender.connect()
    joined.result(120)

    async def broadcast_in_a_thread() -> bool:
        threading.Thread(target=lambda: _timed_broadcast(sender), daemon=True).start()
        return True  # the controller's go

    try:
        engine.run(engine.engine.swap_weights(version, partial_rollout=False, on_paused=broadcast_in_a_thread),
                   timeout_seconds=300)
    except Exception as error:
        return error
    return None


@pytest.mark.e2e
def test_a_broadcast_stopping_part_way_never_serves_a_mix_of_weights_under_either_label(engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    rollout_engine, llm = engine.engine, engine.engine.llm
    version = rollout_engine.policy_version
    before = engine.run(rollout_engine.score(PROBE))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():  # new weights whose log-probs differ visibly from the old ones
        generator = torch.Generator().manual_seed(3)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    try:
        # Stopped before the first bucket: nothing was loaded. The engine resumes on its old weights,
        # under its old label, serving bitwise what it served before.
        error = _refit_engine(engine, SenderThatStops(model, num_buckets=0), version + 1)
        assert error is not None
        assert not engine.run(llm.is_paused()) and rollout_engine.policy_version == version
        assert engine.run(llm.collective_rpc("molt_weights_intact")) == [True]
        assert engine.run(rollout_engine.score(PROBE)) == before
        # Stopped after the first bucket: the layers it completed are new, the rest old. The engine
        # stays paused (a probe submitted meanwhile gets nothing) until a refit succeeds, and then
        # serves wholly the new weights.
        stopped = SenderThatStops(model, num_buckets=1)
        assert len(stopped.buckets) > 1
        error = _refit_engine(engine, stopped, version + 1)
        assert error is not None
        assert engine.run(llm.is_paused()) and rollout_engine.policy_version == version
        assert engine.run(llm.collective_rpc("molt_weights_intact")) == [False]
        waiting = engine.submit(rollout_engine.score(PROBE))
        time.sleep(1.0)
        assert not waiting.done()
        assert _refit_engine(engine, RefitSender(model, is_sender=True, bucket_bytes=256 << 10, timeout_seconds=30),
                             version + 1) is None
        after = waiting.result(120)
        assert rollout_engine.policy_version == version + 1
        assert engine.run(rollout_engine.score(PROBE)) == after
        new_gap = max(abs(a - b) for a, b in zip(after[1:], before[1:]))
        assert new_gap > 1e-2, "the new weights must be visible, or this test could not fail"
        # Loaded wholly, but the engine core did not take the new version label (a stand-in injects
        # that): resuming would serve the new weights under the old label, so the engine stays paused.
        async def label_fails(label: str) -> None:
            raise RuntimeError(f"injected: the engine core did not take label {label}")

        llm.update_weight_version = label_fails
        try:
            error = _refit_engine(engine, RefitSender(model, is_sender=True, bucket_bytes=256 << 10,
                                                      timeout_seconds=30), version + 2)
        finally:
            del llm.update_weight_version  # vLLM's own again
        assert "injected" in str(error)
        assert engine.run(llm.is_paused()) and rollout_engine.policy_version == version + 1
    finally:  # the original weights, for the other tests sharing this engine
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(original[name])
        restored = _refit_engine(engine, RefitSender(model, is_sender=True, bucket_bytes=256 << 10,
                                                     timeout_seconds=30), version)
    assert restored is None and engine.run(rollout_engine.score(PROBE)) == before


# -- case 2, the trainer's side: an engine that cannot rejoin is named ----------------------------------


def _rollout_rank_joining(address, rank: int, behaviour: str) -> None:
    """A rollout rank's answer to 'join_refit': 'join' runs Molt's receiver code (the real join);
    'dead' reports the failure its rank reports when its engine died; 'silent' says nothing."""
    import zmq

    context = zmq.Context()
    socket = connect_dealer(address, f"rollout-{rank}", context)
    try:
        socket.send(pack({"type": "ready", "rank": rank}))
        message = unpack(socket.recv())
        if behaviour == "join":
            group = {key: value for key, value in message["group"].items() if key != "backend"}
            try:
                StandaloneReceiver().molt_join_refit_group(**group)
                socket.send(pack({"type": "refit_joined", "rank": rank}))
            except RuntimeError:  # the other engine never came: this one's join times out too
                pass
        elif behaviour == "dead":  # what RolloutService.guarded sends when join_refit raised
            socket.send(pack({"type": "error", "rank": rank, "during": "join_refit",
                              "error": "EngineDeadError: EngineCore encountered an issue"}))
        socket.poll(30_000)  # until the test is done with the controller
    finally:
        socket.close(0)
        context.term()


@pytest.mark.parametrize("behaviour, error, match", [
    ("dead", "RolloutRankError", "refit join: rollout-2 reported join_refit failure: EngineDeadError"),
    ("silent", "RefitError", r"refit group: the engine of rollout rank 2 never reached the refit rendezvous within "
                             r"refit.timeout_seconds=2; the trainer's sender: not every engine worker joined")])
def test_rebuilding_the_refit_group_names_the_engine_that_cannot_join(behaviour, error, match):
    """After an engine died mid-broadcast, the trainer rebuilds the group for its retry; that engine
    cannot join. The job stops within the refit timeout with an error naming it (RefitCoordinator.open_group
    on a real controller socket, a real gloo rendezvous and one real joining worker)."""
    cfg = MoltConfig()
    cfg.refit.timeout_seconds = 2
    router = Router("127.0.0.1")
    ranks = {1: "join", 2: behaviour}
    threads = [threading.Thread(target=_rollout_rank_joining, args=(router.address, rank, how), daemon=True)
               for rank, how in ranks.items()]
    for thread in threads:
        thread.start()
    mailbox = Mailbox(router, list(ranks))
    sender = RefitSender(_tiny_model(), is_sender=True, bucket_bytes=16 << 10,
                         timeout_seconds=cfg.refit.timeout_seconds)
    coordinator = RefitCoordinator(cfg, sender, mailbox, host="127.0.0.1", group=None, device=torch.device("cpu"))
    try:
        mailbox.expect("ready", len(ranks), 60, "start")
        started = time.monotonic()
        with pytest.raises(Exception, match=match) as raised:
            coordinator.open_group()
        assert type(raised.value).__name__ == error
        assert time.monotonic() - started < cfg.refit.timeout_seconds + SLACK_SECONDS
    finally:
        router.close()


# -- case 34: one engine misses the pause; one dies mid-broadcast (the go/cancel protocol, in process) ---


class LoadingReceiver(StandaloneReceiver):
    """Molt's receiver code (the gloo group, the buffer, the stream of weights) over a stand-in for
    vLLM's model runner that keeps what it is given: this test is about the protocol, not vLLM's
    reload (the e2e tests above run the real one). `die_at_version`: its receive of that version
    stops after the first bucket, as a worker killed mid-broadcast (it drops the group)."""

    def __init__(self, die_at_version: int | None = None):
        self.loaded: dict[str, torch.Tensor] = {}
        self.die_at_version = die_at_version
        self.model_runner = self  # reload_weights below

    def reload_weights(self, weights_iterator) -> None:
        for name, tensor in weights_iterator:
            self.loaded[name] = tensor.clone()

    def molt_receive_weights(self, version: int) -> None:
        if version != self.die_at_version:
            return super().molt_receive_weights(version)
        first_bucket = len(self._molt_plan[0])
        for index, (name, tensor) in enumerate(self.molt_stream_weights()):
            self.loaded[name] = tensor.clone()
            if index + 1 == first_bucket:
                self._molt_group = None  # the worker's connections close with it
                raise RuntimeError("injected: the engine worker died mid-broadcast")

    def _molt_retie_embeddings(self) -> None:  # vLLM model specifics, not in this stand-in
        pass

    def _molt_prepack_cpu_experts(self) -> None:
        pass

    def _molt_end_abandoned_reload(self) -> None:
        pass


class ProtocolLLM:
    """Stands in for vLLM's AsyncLLM around one LoadingReceiver: pause/resume and the version label as
    flags, worker RPCs run on the receiver in a thread (gloo receives block). Every call is logged
    with its time. `pause_seconds`: the first pause takes that long (an engine that misses the
    pause); `dead`: from the receiver's death on, every call fails as on a dead engine core."""

    def __init__(self, receiver: LoadingReceiver, pause_seconds: float = 0.0):
        self.receiver = receiver
        self.pause_seconds = pause_seconds
        self.paused = False
        self.dead = False
        self.labels: list[str] = []
        self.log: list[tuple[float, str]] = []

    def _call(self, what: str) -> None:
        self.log.append((time.monotonic(), what))
        if self.dead:
            raise RuntimeError("EngineDeadError: EngineCore encountered an issue")

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self._call("pause")
        await asyncio.sleep(self.pause_seconds)
        self.pause_seconds = 0.0
        self.paused = True
        self._call("paused")

    async def resume_generation(self) -> None:
        self._call("resume")
        self.paused = False

    async def collective_rpc(self, method: str, kwargs: dict | None = None) -> list:
        self._call(method)
        try:
            return [await asyncio.to_thread(getattr(self.receiver, method), **(kwargs or {}))]
        except RuntimeError as error:
            if "died" in str(error):
                self.dead = True
            raise

    async def reset_encoder_cache(self) -> None:
        self._call("reset_encoder_cache")

    async def update_weight_version(self, label: str) -> None:
        self._call(f"label {label}")
        self.labels.append(label)


def _serve_rollout_ranks(services: list, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
    """RolloutService's message dispatch (its own handlers) for each service, on one event loop."""
    from molt.transport.wire import unpack as decode

    async def serve(service) -> None:
        await service.send({"type": "ready", "rank": service.rank})
        handlers = service.handlers()
        while not stop.is_set():
            if await service.socket.poll(50):
                message = decode(await service.socket.recv())
                service.spawn_task(service.guarded(handlers[message["type"]], message))

    async def main() -> None:
        await asyncio.gather(*(serve(service) for service in services))
        tasks = [task for service in services for task in service.tasks]
        for task in tasks:  # a refit still waiting (an engine left paused): ended with the test
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    loop.run_until_complete(main())
    loop.close()


class ProtocolJob:
    """A controller (the real RefitCoordinator over a real Mailbox and Router, one
    trainer rank, the real gloo RefitSender) and rollout ranks (real RolloutService and RolloutEngine)
    whose engines are ProtocolLLMs."""

    def __init__(self, engines: list[ProtocolLLM], timeout_seconds: float, max_attempts: int):
        import vllm.model_executor.model_loader.reload.layerwise  # noqa: F401  (the receive's import: seconds)

        from molt.rollout.engine import RolloutEngine
        from molt.refit.gloo import GlooEngineSync
        from molt.rollout.rank import RolloutService

        cfg = MoltConfig()
        cfg.refit.timeout_seconds, cfg.refit.max_attempts = timeout_seconds, max_attempts
        self.router = Router("127.0.0.1")
        ranks = list(range(1, len(engines) + 1))
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.services = []
        for rank, llm in zip(ranks, engines):
            service = RolloutService(cfg, rank, self.router.address, "127.0.0.1")
            service.engine = RolloutEngine(llm, None, weight_sync=GlooEngineSync())
            self.services.append(service)
        asyncio.set_event_loop(None)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=_serve_rollout_ranks, args=(self.services, self.loop, self.stop),
                                       daemon=True)
        self.thread.start()
        self.mailbox = Mailbox(self.router, ranks)
        self.model = _tiny_model()
        sender = RefitSender(self.model, is_sender=True, bucket_bytes=16 << 10, timeout_seconds=timeout_seconds)
        self.coordinator = RefitCoordinator(cfg, sender, self.mailbox, host="127.0.0.1", group=None,
                                            device=torch.device("cpu"))
        self.mailbox.expect("ready", len(ranks), 60, "start")
        self.coordinator.open_group()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        for service in self.services:
            service.socket.close(0)
        self.router.close()


def _times(llm: ProtocolLLM, what: str) -> list[float]:
    return [at for at, name in llm.log if name == what]


def test_an_engine_that_misses_the_pause_gets_healthy_engines_cancelled_at_once_and_the_retry_includes_it():
    """RELIABILITY 34 (issue 27, finding 9). Engine 3 pauses only after the attempt's deadline. The
    controller says 'refit_cancel' at the deadline: engines 1 and 2, paused since the start, drop the
    group at once without receiving anything and resume on their old weights under their old label,
    before engine 3 has even paused (they used to sit in the broadcast until their own timeout).
    The retry rebuilds the group with all three, and all three load the new weights."""
    timeout = 3.0
    receivers = [LoadingReceiver() for _ in range(3)]
    engines = [ProtocolLLM(receivers[0]), ProtocolLLM(receivers[1]),
               ProtocolLLM(receivers[2], pause_seconds=1.5 * timeout)]  # pauses after the deadline
    job = ProtocolJob(engines, timeout_seconds=timeout, max_attempts=2)
    try:
        started = time.monotonic()
        job.coordinator.push(version=1)  # returns once every engine loaded version 1
        seconds = time.monotonic() - started
    finally:
        job.close()
    assert job.coordinator.failures == 1
    assert seconds < 2 * timeout + SLACK_SECONDS
    slow = engines[2]
    slow_paused_at = _times(slow, "paused")[0]
    for healthy in engines[:2]:
        names = [name for _, name in healthy.log]
        # attempt 1: paused, prepared, cancelled: recovered and left the group, resumed; nothing received
        first = names[:names.index("resume") + 1]
        assert first == ["molt_join_refit_group", "pause", "paused", "molt_prepare_refit", "molt_weights_intact",
                         "molt_leave_refit_group", "resume"], first
        assert _times(healthy, "resume")[0] < slow_paused_at  # cancelled at the deadline, not at a timeout
        assert names.count("molt_receive_weights") == 1  # the retry's only
    # Engine 3 paused late (its own attempt 1 failed there) and loaded in the retry with the others.
    assert [name for _, name in slow.log].count("molt_receive_weights") == 1
    for llm in engines:
        assert llm.labels == ["1"] and not llm.paused
    for receiver in receivers:
        for name, parameter in job.model.named_parameters():
            assert torch.equal(receiver.loaded[name], parameter.detach()), name


def test_an_engine_that_dies_mid_broadcast_stops_the_job_naming_it_and_no_engine_serves_a_mix():
    """Both engines pause and get 'refit_go'; engine 2's worker dies after the first bucket. The
    attempt fails naming it; the retry cannot rebuild the group (its engine is dead) and the job
    stops naming it, within the attempt's and the join's timeouts. Engine 1 either loaded everything
    (and took the new label) or stays paused: it never serves a mix of old and new weights."""
    timeout = 3.0
    receivers = [LoadingReceiver(), LoadingReceiver(die_at_version=1)]
    engines = [ProtocolLLM(receivers[0]), ProtocolLLM(receivers[1])]
    job = ProtocolJob(engines, timeout_seconds=timeout, max_attempts=2)
    try:
        started = time.monotonic()
        with pytest.raises((RefitError, RolloutRankError), match="rollout-2|rollout rank 2"):
            job.coordinator.push(version=1)
        seconds = time.monotonic() - started
    finally:
        job.close()
    assert seconds < 3 * timeout + SLACK_SECONDS
    assert job.coordinator.failures >= 1
    survivor = engines[0]
    names = [name for _, name in survivor.log]
    assert names.count("molt_receive_weights") == 1  # one go: no receive after the failed attempt
    complete = all(torch.equal(receivers[0].loaded.get(name, torch.empty(0)), p.detach())
                   for name, p in job.model.named_parameters())
    if complete:
        assert survivor.labels == ["1"]
    else:
        assert survivor.paused and survivor.labels == []
    assert len(receivers[1].loaded) < len(list(job.model.parameters()))  # it did die part-way
