"""Weight sync (molt.refit.weight_sync): the parts of both backends that run on a CPU. The NCCL calls
themselves need a GPU and vLLM's CUDA build; here the NCCL backend's messages are checked against
vLLM's own init and update dataclasses, its bucket geometry against vLLM's packed producer and
consumer over a loopback stand-in for the communicator, and its watchdog against a stand-in
broadcast that hangs until aborted."""

import asyncio
import base64
import os
import threading
import time
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from molt.config import ConfigError, MoltConfig
from molt.refit.backends import build_engine_sync, build_sender, resolve_backend
from molt.refit.coordinator import RefitCoordinator
from molt.refit.gloo import GlooEngineSync, RefitSender
from molt.refit.nccl import (NcclEngineSync, NcclSender, PACKED_NUM_BUFFERS, bucket_update_infos,
                             worker_init_info)
from molt.refit.weight_sync import (RefitError, RefitSendError, Watchdog, engine_first_rank, gather_device, gather_stream,
                                    refit_device, refit_world_size)
from molt.transport.mailbox import Mailbox
from molt.transport.wire import Router, connect_dealer, pack, unpack


def _model(model_path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)


def _nccl_sender(model, monkeypatch, **kwargs) -> NcclSender:
    unique_id = base64.b64encode(os.urandom(128)).decode()  # ncclGetUniqueId needs the NCCL library
    monkeypatch.setattr("molt.refit.nccl.mint_unique_id", lambda: unique_id)
    return NcclSender(model, is_sender=True, **{"bucket_bytes": 64 << 10, "timeout_seconds": 30, **kwargs})


# -- backend choice and ranks ------------------------------------------------------------------


@pytest.mark.parametrize("backend, device_type, expected", [
    ("auto", "cpu", "gloo"), ("auto", "cuda", "nccl"), ("gloo", "cuda", "gloo"), ("nccl", "cuda", "nccl")])
def test_backend_auto_is_nccl_only_for_a_cuda_trainer(backend, device_type, expected):
    assert resolve_backend(backend, device_type) == expected


@pytest.mark.parametrize("backend, match", [("nccl", "refit.backend='nccl' but the trainer computes on cpu"),
                                            ("mpi", "refit.backend='mpi': use auto, gloo or nccl")])
def test_a_backend_that_cannot_run_is_a_config_error_naming_the_field(backend, match):
    with pytest.raises(ConfigError, match=match):
        resolve_backend(backend, "cpu")


def test_a_cpu_run_builds_the_gloo_halves(model_path):
    cfg = MoltConfig()
    sender = build_sender(cfg, _model(model_path), is_sender=True, device=torch.device("cpu"))
    assert type(sender) is RefitSender and sender.backend == "gloo"
    assert type(build_engine_sync("gloo")) is GlooEngineSync and type(build_engine_sync("nccl")) is NcclEngineSync


@pytest.mark.parametrize("num_engines, tensor_parallel", [(1, 1), (3, 1), (1, 2), (3, 2), (2, 4)])
def test_every_worker_of_every_engine_has_its_own_refit_rank(num_engines, tensor_parallel, monkeypatch):
    """Molt's gloo workers take first rank + tensor-parallel rank; vLLM's NCCL workers take rank offset
    + their rank inside the engine (nccl_common.worker_init_process_group, run here with the
    communicator stubbed out). Both give ranks 1 .. world - 1, each once, engine after engine."""
    from vllm.distributed.weight_transfer import nccl_common
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

    world_size = refit_world_size(num_engines, tensor_parallel)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(nccl_common, "uid_init_process_group", lambda uid, rank, world, device: rank)
    group = {"nccl_unique_id_b64": base64.b64encode(os.urandom(128)).decode(), "world_size": world_size,
             "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2}
    gloo_ranks, nccl_ranks = [], []
    for engine in range(num_engines):
        first = engine_first_rank(engine, tensor_parallel)
        info = NCCLWeightTransferInitInfo(**worker_init_info({**group, "rank": first}))
        for tp_rank in range(tensor_parallel):
            gloo_ranks.append(first + tp_rank)
            parallel = SimpleNamespace(data_parallel_index=0, world_size=tensor_parallel, rank=tp_rank)
            nccl_ranks.append(nccl_common.worker_init_process_group(info, parallel))
    assert gloo_ranks == nccl_ranks == list(range(1, world_size))


# -- GPU-only decisions: the device and stream of the trainer's gathers ------------------------------


def test_the_refit_communicator_is_on_the_trainers_gpu_with_its_index_never_a_parameters_device():
    """vllm/distributed/device_communicators/pynccl.py, PyNcclCommunicator.broadcast asserts
    `tensor.device == self.device`: the communicator must be built on the indexed GPU the packed
    tensors are on. Under train.cpu_offload the parameters are on the host; the trainer is not."""
    assert refit_device(torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert refit_device(torch.device("cuda"), current_index=lambda: 5) == torch.device("cuda", 5)
    with pytest.raises(ValueError, match="the NCCL refit needs a trainer on CUDA, not cpu"):
        refit_device(torch.device("cpu"))


@pytest.mark.parametrize("shard, trainer, expected", [
    ("cpu", "cuda:1", "cuda:1"),  # CPUOffloadPolicy: gather over NCCL on the trainer's GPU, not over gloo
    ("cuda:1", "cuda:1", "cuda:1"), ("cpu", "cpu", "cpu")])
def test_an_offloaded_shard_is_gathered_on_the_trainers_gpu(shard, trainer, expected):
    assert gather_device(torch.device(shard), torch.device(trainer)) == torch.device(expected)


def test_a_gathered_tensor_is_produced_on_the_stream_current_in_vllms_producer():
    """packed_tensor.py, packed_nccl_broadcast_producer pulls the iterator inside
    `with torch.cuda.stream(streams[buffer_idx])`: on CUDA the gather runs on that stream, the one
    current at the pull (not the default stream, which the producer's streams never wait for)."""
    producer_stream = object()
    assert gather_stream("cuda", lambda: producer_stream) is producer_stream

    def no_streams_on_cpu():
        raise AssertionError("a CPU gather asks for no stream")

    assert gather_stream("cpu", no_streams_on_cpu) is None


def test_the_nccl_sender_builds_its_communicator_on_the_trainers_gpu_under_offload(model_path, monkeypatch):
    """The parameters are on the host (as under CPUOffloadPolicy); the communicator goes on cuda:2,
    the trainer's device, which build_sender passes (Trainer.device)."""
    from vllm.distributed.weight_transfer import nccl_common

    built = {}

    def init(unique_id: bytes, rank: int, world_size: int, device) -> str:
        built["device"] = device
        return "communicator"

    monkeypatch.setattr(nccl_common, "uid_init_process_group", init)
    cfg = MoltConfig()
    cfg.refit.backend = "nccl"
    monkeypatch.setattr("molt.refit.nccl.mint_unique_id", lambda: base64.b64encode(bytes(128)).decode())
    sender = build_sender(cfg, _model(model_path), is_sender=True, device=torch.device("cuda", 2))
    assert type(sender) is NcclSender and next(sender.model.parameters()).device.type == "cpu"
    sender.group_message("127.0.0.1", 2)
    sender.connect()
    assert built["device"] == torch.device("cuda", 2)


# -- the NCCL messages ---------------------------------------------------------------------------


def test_the_nccl_join_message_is_msgpack_and_is_what_vllm_workers_accept(model_path, monkeypatch):
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

    sender = _nccl_sender(_model(model_path), monkeypatch, bucket_bytes=3 << 20)
    group = sender.group_message("127.0.0.1", world_size=5)
    message = {"type": "join_refit", "group": {**group, "rank": engine_first_rank(1, 2)}}
    received = unpack(pack(message))  # Molt's wire: msgpack, no pickle
    assert received == message
    joined = received["group"]
    assert joined["backend"] == "nccl" and joined["plan"] == sender.wire_plan
    info = NCCLWeightTransferInitInfo(**worker_init_info(joined))  # vLLM validates the unique id's size
    assert info.nccl_unique_id_bytes == base64.b64decode(group["nccl_unique_id_b64"])
    assert (info.master_address, info.master_port) == (None, None)  # never vLLM's pickling TCPStore rendezvous
    assert (info.rank_offset, info.world_size) == (3, 5)
    assert (info.packed, info.packed_buffer_size_bytes, info.packed_num_buffers) == (True, 3 << 20, PACKED_NUM_BUFFERS)


def test_one_update_info_per_bucket_in_the_engine_dtype(model_path, monkeypatch):
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    model = _model(model_path)
    sender = _nccl_sender(model, monkeypatch, bucket_bytes=16 << 10, engine_dtype="bfloat16")
    infos = unpack(pack({"type": "x", "infos": bucket_update_infos(sender.wire_plan)}))["infos"]
    assert len(infos) == len(sender.buckets) > 1
    for info, bucket in zip(infos, sender.buckets):
        NCCLWeightTransferUpdateInfo(**info)  # the lists agree in length
        assert info == {"names": [e.name for e in bucket], "dtype_names": ["bfloat16"] * len(bucket),
                        "shapes": [list(e.shape) for e in bucket]}
    assert [name for info in infos for name in info["names"]] == [name for name, _ in model.named_parameters()]


class LoopbackCommunicator:
    """Stands in for vLLM's PyNcclCommunicator: the trainer's broadcasts are kept, and the workers'
    broadcasts take them in order, failing if a receive buffer's size differs from what was sent."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []
        self.disabled = False
        self.receiving = False  # False: the trainer's side, True: the workers'

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        if self.disabled:
            return
        if self.receiving:
            chunk = self.sent.pop(0)
            assert chunk.numel() == tensor.numel(), "the two sides cut the stream differently"
            tensor.copy_(chunk)
        else:
            self.sent.append(tensor.clone())


def _cpu_packed_tensor(monkeypatch) -> None:
    """vLLM's packed producer and consumer, on CPU: CUDA streams replaced by no-ops."""
    from vllm.distributed.weight_transfer import packed_tensor

    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    stream = SimpleNamespace(synchronize=lambda: None)
    monkeypatch.setattr(packed_tensor, "_get_streams", lambda device, count: (stream,) * count)


def test_one_producer_call_sends_the_whole_refit_and_the_workers_consumer_cuts_each_bucket_alike(model_path,
                                                                                                  monkeypatch):
    """The trainer's sends go through ONE call of vLLM's packed producer (so its double buffering
    overlaps bucket i + 1's gathers with bucket i's broadcast; a call per bucket drains the streams at
    each), the workers' receives through its packed consumer once per bucket (as NCCLWeightTransferEngine
    runs it for each update_weights), fed Molt's update infos: each bucket is one broadcast of the
    bucket's bytes, and every weight arrives in the engine dtype, equal to the trainer's weight cast
    to it. The embeddings are larger than refit.bucket_megabytes here: vLLM's 'exceeds
    buffer_size_bytes' warning must not fire (the packed buffer is sized to the largest tensor)."""
    from vllm.distributed.weight_transfer import packed_tensor
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

    _cpu_packed_tensor(monkeypatch)
    calls = []
    producer = packed_tensor.packed_nccl_broadcast_producer
    monkeypatch.setattr(packed_tensor, "packed_nccl_broadcast_producer",
                        lambda **kwargs: calls.append(1) or producer(**kwargs))
    model = _model(model_path)
    bucket_bytes = 8 << 10
    largest = max(p.numel() * 2 for p in model.parameters())
    assert largest > bucket_bytes, "a tensor larger than the bucket, or the warning check could not fail"
    sender = _nccl_sender(model, monkeypatch, bucket_bytes=bucket_bytes, engine_dtype="bfloat16")
    assert sender.packed_buffer_bytes == largest
    sender.communicator = LoopbackCommunicator()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sent = sender.broadcast()
    assert not [w for w in caught if "exceeds buffer_size_bytes" in str(w.message)]
    assert len(calls) == 1 and len(sender.buckets) > 2
    chunks = sender.communicator.sent
    assert [c.numel() for c in chunks] == [sum(e.num_bytes for e in b) for b in sender.buckets]
    assert sent == sum(c.numel() for c in chunks) == sum(p.numel() * 2 for p in model.parameters())
    assert max(c.numel() for c in chunks) <= 2 * sender.packed_buffer_bytes

    received = {}
    sender.communicator.receiving = True
    for info in bucket_update_infos(sender.wire_plan):
        metadata = ((name, (shape, getattr(torch, dtype)))
                    for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"]))
        num_before = len(sender.communicator.sent)
        packed_nccl_broadcast_consumer(
            iterator=metadata, group=sender.communicator, src=0,
            post_unpack_func=lambda weights: received.update((n, t.clone()) for n, t in weights),
            buffer_size_bytes=sender.packed_buffer_bytes, num_buffers=PACKED_NUM_BUFFERS, device="cpu")
        assert num_before - len(sender.communicator.sent) == 1  # one update_weights = one broadcast
    assert not sender.communicator.sent  # every broadcast was consumed
    for name, parameter in model.named_parameters():
        assert received[name].dtype == torch.bfloat16
        assert torch.equal(received[name], parameter.detach().to(torch.bfloat16)), name


@pytest.mark.parametrize("buffer_bytes", [1, 100, 250, 10_000])
def test_the_nccl_plan_cuts_where_vllms_packed_producer_cuts(buffer_bytes):
    """plan_packed_buckets against vLLM's own pack_tensors over the same stream of tensors (sizes in
    bytes: uint8), including tensors larger than the buffer and a chunk ending exactly on it."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    from molt.refit.weight_sync import BucketEntry, plan_packed_buckets

    sizes = [40, 60, 100, 7, 300, 1, 1, 99, 150, 150, 20]
    entries = [BucketEntry(f"w{i}", "uint8", (size,)) for i, size in enumerate(sizes)]
    stream = iter([(entry.name, torch.zeros(entry.shape, dtype=torch.uint8)) for entry in entries])
    chunks = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM's 'exceeds buffer_size_bytes', wanted here
        while (chunk := pack_tensors(stream, lambda item: item[1], buffer_bytes)) is not None:
            chunks.append(chunk.names)
    assert [[e.name for e in bucket] for bucket in plan_packed_buckets(entries, buffer_bytes)] == chunks


# -- the watchdog --------------------------------------------------------------------------------


def test_the_watchdog_aborts_a_hung_step_after_its_timeout_and_not_before():
    hung = threading.Event()  # a broadcast that waits for a peer that never comes; abort releases it
    started = time.monotonic()
    with Watchdog(0.5, hung.set, "stand-in broadcast") as watchdog:
        assert hung.wait(60)  # generous: it fires at 0.5 s; a loaded machine may run the thread late
    assert watchdog.fired and time.monotonic() - started >= 0.5
    aborted = threading.Event()
    with Watchdog(0.5, aborted.set, "quick step") as quick:
        pass
    # Disarmed: its thread ends without firing (waited for, not slept past).
    for thread in threading.enumerate():
        if thread.name == "molt-watchdog: quick step":
            thread.join(60)
    assert not quick.fired and not aborted.is_set()


class HungCommunicator:
    """A broadcast that never completes (a dead engine worker) until the communicator is destroyed,
    which is what vLLM's destroy (ncclCommAbort) does to a blocked NCCL broadcast. Injects that
    failure only; after it, broadcasts do nothing, as on a destroyed PyNcclCommunicator."""

    def __init__(self):
        self.aborted = threading.Event()
        self.disabled = False
        self.num_broadcasts = 0

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        if self.disabled:
            return
        self.num_broadcasts += 1
        self.aborted.wait()

    def destroy(self) -> None:
        self.disabled = True
        self.aborted.set()


def _two_trainer_ranks_one_engine_gone(rank: int, world_size: int, model_dir: str) -> dict:
    """Two FSDP2 ranks. First a refit nobody is paused for (gloo, `send=False`: the sender has no
    group at all, so a send would fail), then an NCCL refit into a communicator that hangs: the
    watchdog aborts it, the sender raises, and both ranks ran every gather."""
    import molt.refit.nccl as nccl
    from vllm.distributed.weight_transfer import packed_tensor

    from molt.trainer.sharded_model import build_actor_model
    from molt.distributed.parallelize import ShardingPlan, TrainerMesh

    torch.accelerator.current_device_index = lambda: 0
    stream = SimpleNamespace(synchronize=lambda: None)
    packed_tensor._get_streams = lambda device, count: (stream,) * count
    nccl.mint_unique_id = lambda: base64.b64encode(bytes(128)).decode()
    mesh = TrainerMesh.from_group(dist.group.WORLD, "cpu")
    model = build_actor_model(model_dir, mesh=mesh, device=torch.device("cpu"), plan=ShardingPlan())
    gathers = []
    original = torch.distributed.tensor.DTensor.full_tensor

    def counted_full_tensor(self, *args, **kwargs):
        gathers.append(self.dtype)
        return original(self, *args, **kwargs)

    torch.distributed.tensor.DTensor.full_tensor = counted_full_tensor
    kwargs = dict(is_sender=rank == 0, bucket_bytes=64 << 10, timeout_seconds=1.5, engine_dtype="bfloat16")
    gloo = RefitSender(model, **kwargs)
    result = {"unsent": gloo.broadcast(send=False), "gloo_gathers": len(gathers)}
    sender = NcclSender(model, **kwargs)
    sender.communicator = HungCommunicator() if rank == 0 else None
    started = time.monotonic()
    try:
        sender.broadcast()
        result["error"] = None
    except RefitSendError as error:
        result["error"] = str(error)
    result.update(seconds=time.monotonic() - started, nccl_gathers=len(gathers) - result["gloo_gathers"],
                  num_params=len(list(model.parameters())), num_buckets=len(sender.buckets),
                  num_broadcasts=sender.communicator.num_broadcasts if rank == 0 else 0,
                  gathered_dtypes=sorted({str(dtype) for dtype in gathers}),
                  master_dtypes=sorted({str(p.dtype) for p in model.parameters()}))
    dist.barrier()  # both ranks got here: neither waits in a gather
    return result


def test_a_refit_the_engines_are_not_ready_for_still_gathers_and_a_hung_nccl_send_is_aborted(tiny_model_dir):
    results = run_ranks(_two_trainer_ranks_one_engine_gone, 2, str(tiny_model_dir), timeout_seconds=180)
    for result in results:
        # fp32 masters, each shard cast to the engine dtype before its all-gather: half the bytes gathered
        assert result["master_dtypes"] == ["torch.float32"] and result["gathered_dtypes"] == ["torch.bfloat16"]
        assert result["unsent"] == 0 and result["gloo_gathers"] == result["num_params"]
        assert result["nccl_gathers"] == result["num_params"]  # every gather, after the abort too
    sender, other = results
    assert sender["num_buckets"] > 1 and sender["num_broadcasts"] == 1  # later buckets were not sent
    assert "no progress within refit.timeout_seconds=1.5; the NCCL communicator was aborted" in sender["error"]
    assert sender["error"].startswith("nccl broadcast failed after 0 bytes")
    assert 1.5 <= sender["seconds"] < 30 and other["error"] is None


class NcclWorker:
    """One vLLM worker as the NCCL engine half drives it: Molt's receiver methods (the real ones)
    over a stand-in for vLLM's weight-transfer engine, whose update hangs on a communicator that
    never delivers until aborted (a peer gone mid-broadcast)."""

    def __init__(self, timeline: list[str]):
        from molt.refit.receiver import RefitReceiver

        self.communicator = HungCommunicator()
        self.timeline = timeline
        worker = self

        class Worker(RefitReceiver):
            weight_transfer_engine = SimpleNamespace(model_update_group=worker.communicator)
            model_runner = SimpleNamespace(get_model=torch.nn.Module)  # no layer mid-reload to finish

            def update_weights(self, update_info: dict) -> None:  # vLLM's Worker.update_weights
                timeline.append("update_weights")
                worker.communicator.broadcast(None, src=0)

        self.receiver = Worker()

    async def collective_rpc(self, method: str, kwargs: dict | None = None) -> list:
        self.timeline.append(method)
        return [await asyncio.to_thread(getattr(self.receiver, method), **(kwargs or {}))]

    async def start_weight_update(self) -> None:
        self.timeline.append("start_weight_update")

    async def finish_weight_update(self) -> None:
        self.timeline.append("finish_weight_update")


def test_the_nccl_worker_watchdog_arms_at_the_first_bucket_and_no_update_runs_after_it_fired(model_path,
                                                                                           monkeypatch):
    """Issue 27, finding 9: `prepare` (before the controller's go) arms nothing, so the wait for other
    engines' pauses is not timed by this worker; the first bucket arms it; the hung broadcast is
    aborted after the timeout and no later bucket's update_weights is issued (an aborted communicator
    would 'receive' at once and load uninitialised buffers). The engine then reports mixed weights."""
    sender = _nccl_sender(_model(model_path), monkeypatch, bucket_bytes=16 << 10, timeout_seconds=0.5)
    group = {**sender.group_message("127.0.0.1", 2), "rank": 1}
    assert len(group["plan"]) > 2
    timeline: list[str] = []
    llm = NcclWorker(timeline)
    sync = NcclEngineSync()
    sync.update_infos, sync.timeout_seconds, sync.joined = bucket_update_infos(group["plan"]), 0.5, True

    async def refit() -> str:
        await sync.prepare(llm, 7)
        assert getattr(llm.receiver, "_molt_watchdog", None) is None  # not armed while waiting for the go
        await asyncio.sleep(1.0)  # other engines' pauses: longer than the timeout, harmless here
        started = time.monotonic()
        try:
            await sync.receive(llm, 7)
        except RefitError as error:
            assert time.monotonic() - started >= 0.5
            return str(error)
        return "no error"

    error = asyncio.run(refit())
    assert "refit v7 (nccl): no update after the watchdog fired" in error
    assert timeline.count("update_weights") == 1 and timeline.count("molt_update_weights") == 2
    assert "finish_weight_update" not in timeline and llm.communicator.disabled
    assert asyncio.run(sync.recover(llm)) is False  # a bucket may have loaded: the engine stays paused


def test_an_nccl_refit_joins_quietly_receives_bucket_by_bucket_and_reties_the_head(model_path, monkeypatch):
    """The healthy path of the NCCL engine half: its join quiets vLLM's expected 'Failed to load
    weights' for the tied lm_head (issue 27, finding 13: it was silenced on gloo only), then one
    update per bucket, the watchdog disarmed, vLLM's update finished, and the lm_head re-tied to the
    new embeddings (vLLM's reload puts the old tensor back, on GPU as on CPU)."""
    import logging

    sender = _nccl_sender(_model(model_path), monkeypatch, bucket_bytes=16 << 10)
    group = {**sender.group_message("127.0.0.1", 2), "rank": 1}
    timeline: list[str] = []
    llm = NcclWorker(timeline)
    llm.communicator = SimpleNamespace(broadcast=lambda tensor, src: None, destroy=lambda: None)  # delivers
    llm.receiver.weight_transfer_engine = SimpleNamespace(model_update_group=llm.communicator)
    retied = []
    llm.receiver._molt_retie_embeddings = lambda: retied.append(1)

    async def init_weight_transfer_engine(request) -> None:
        timeline.append("init_weight_transfer_engine")

    llm.init_weight_transfer_engine = init_weight_transfer_engine
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    monkeypatch.setattr(layerwise, "level", logging.NOTSET)
    sync = NcclEngineSync()

    async def refit() -> None:
        await sync.join(llm, group)
        await sync.prepare(llm, 3)
        await sync.receive(llm, 3)

    asyncio.run(refit())
    assert layerwise.getEffectiveLevel() == logging.ERROR
    num_buckets = len(group["plan"])
    assert timeline == (["molt_quiet_expected_reload_warnings", "init_weight_transfer_engine", "start_weight_update"]
                        + ["molt_update_weights", "update_weights"] * num_buckets
                        + ["molt_disarm_watchdog", "finish_weight_update", "molt_retie_embeddings"])
    assert retied == [1] and not sync.mixed


# -- the controller: the engines acknowledge the pause before anything is sent -------------------


def _rollout_rank_replying(address: str, identity: str, replies: list[dict]) -> None:
    socket = connect_dealer(address, identity)
    socket.send(pack({"type": "ready", "rank": int(identity.split("-")[1])}))
    for reply in replies:
        socket.send(pack(reply))
    time.sleep(3)
    socket.close(0)


def test_the_controller_names_each_engine_that_did_not_acknowledge_the_pause_in_time():
    cfg = MoltConfig()
    cfg.refit.timeout_seconds = 1.0
    router = Router("127.0.0.1")
    replies = {1: [{"type": "refit_paused", "rank": 1, "version": 4, "attempt": 1, "error": None},  # a stale one
                   {"type": "refit_paused", "rank": 1, "version": 5, "attempt": 2, "error": None}],
               2: [],  # never acknowledges
               3: [{"type": "refit_paused", "rank": 3, "version": 5, "attempt": 2, "error": "RuntimeError: boom"}]}
    ranks = [threading.Thread(target=_rollout_rank_replying, args=(router.address, f"rollout-{rank}", replies[rank]),
                              daemon=True) for rank in replies]
    for thread in ranks:
        thread.start()
    mailbox = Mailbox(router, list(replies))
    coordinator = RefitCoordinator(cfg, None, mailbox, host="127.0.0.1", group=None, device=torch.device("cpu"))
    try:
        mailbox.expect("ready", 3, 30, "start")
        started = time.monotonic()
        failure = coordinator.await_paused(5, 2, time.monotonic() + cfg.refit.timeout_seconds)
        waited = time.monotonic() - started
        all_paused = coordinator.await_paused(5, 2, time.monotonic() + 0.1)  # replies already taken: none left
    finally:
        mailbox.send_to_rollout_ranks({"type": "shutdown"})
        router.close()
    assert failure == ("refit v5 (attempt 2): the engine of rollout rank 2 did not acknowledge the pause within "
                       "refit.timeout_seconds=1; the engine of rollout rank 3 failed: RuntimeError: boom; "
                       "nothing was broadcast")
    # It returns at its 1 s deadline (ZeroMQ polls in whole milliseconds, so up to 1 ms early), not
    # before; the upper bound is generous for a loaded machine.
    assert 0.99 <= waited < 30
    assert "rank 1" in all_paused  # each acknowledgement counts once


# -- on a GPU: the sender's gathers on CUDA streams (never run yet: no GPU where it was written) ------


class DeviceCheckingLink:
    """Stands in for vLLM's PyNcclCommunicator on one GPU: like pynccl's broadcast it asserts the
    tensor is on its device and reads it on the current stream (the producer's), where it enqueues a
    copy, as ncclBroadcast would read the buffer there."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        assert tensor.device == self.device, f"a packed tensor on {tensor.device}, the communicator on {self.device}"
        self.sent.append(tensor.clone())  # on the current stream, like the NCCL kernel


def _gather_on_cuda_streams(model_path: str, offload: bool) -> None:
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    from molt.trainer.sharded_model import build_actor_model
    from molt.distributed.parallelize import ShardingPlan, TrainerMesh

    device = torch.device("cuda", 0)
    mesh = TrainerMesh.from_group(dist.group.WORLD, "cuda")
    model = build_actor_model(model_path, mesh=mesh, device=device,
                              plan=ShardingPlan(param_dtype=torch.float32, cpu_offload=offload))
    sender = NcclSender(model, is_sender=True, bucket_bytes=64 << 10, timeout_seconds=120,
                        engine_dtype="bfloat16", device=device)
    sender.communicator = DeviceCheckingLink(device)
    with torch.no_grad():  # the optimizer's last writes, still queued on the default stream
        for parameter in model.parameters():
            local = parameter.to_local()
            for _ in range(20):
                local.mul_(1.01).add_(0.001)
    sender.broadcast()  # no synchronize before: the producer's streams must wait for these writes
    torch.cuda.synchronize()
    expected = {name: p.full_tensor().to(torch.bfloat16).to(device) for name, p in model.named_parameters()}
    assert len(sender.communicator.sent) == len(sender.buckets) > 1
    for chunk, bucket in zip(sender.communicator.sent, sender.buckets):
        weights = unpack_tensor(chunk, [e.name for e in bucket], [list(e.shape) for e in bucket],
                                [torch.bfloat16] * len(bucket), [e.num_bytes for e in bucket])
        for name, tensor in weights:
            assert torch.equal(tensor, expected[name]), name


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [False, True])
def test_the_nccl_senders_gathers_on_cuda_streams_produce_exactly_the_full_tensors(model_path, offload):
    """Finding 3 of issue 27: each gathered tensor is cast, gathered, packed and 'broadcast' on vLLM's
    producer streams after the default stream's writes, and equals the full tensor in the engine
    dtype; under CPU offload the shards are gathered on the GPU (the stand-in refuses host tensors)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import socket as sockets

    torch.cuda.set_device(0)
    with sockets.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)  # as molt.train
    try:
        _gather_on_cuda_streams(model_path, offload)
    finally:
        dist.destroy_process_group()
