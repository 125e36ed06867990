"""Weight sync: how a refit's weights go from the trainer into every engine's workers (DESIGN
section 6), as one interface with two backends driven by the same control flow:

- 'gloo' (molt.refit.gloo): host memory over a gloo group; what CPU runs (and CI) use.
- 'nccl' (molt.refit.nccl): vLLM's NCCL weight-transfer engine, GPU to GPU.

Each backend has a trainer half (`WeightSender`, on every trainer rank) and an engine half
(`EngineWeightSync`, on each rollout rank, driving its engine's workers). One refit attempt:

    controller                         rollout rank (engine)                   engine workers
    'refit' v, attempt      ------->   pause ('wait', or 'keep' with partial rollout)
                                       EngineWeightSync.prepare
                            <-------   'refit_paused' (error: why it could not pause)
    every engine paused by the deadline:
    'refit_go' v, attempt   ------->   (waits for go or cancel)
    WeightSender.broadcast  =========  EngineWeightSync.receive  ===========>  receive bucket by bucket, load
                                       resume, label the new version
                            <-------   'refit_done' (error: None)
    otherwise:
    'refit_cancel' v, attempt ----->   EngineWeightSync.abandon: the group torn down, nothing loaded;
                                       resume on the old weights, under the old version label
                            <-------   'refit_done' (error: 'RefitCancelled: ...'; nobody waits for it)
    broadcast(send=False): the gathers only; the attempt failed, the group is rebuilt and retried

Every trainer rank runs the same FSDP2 gathers whatever happens on the wire (`broadcast(send=False)`
when nothing is sent, and the rest of the gathers after a failed send), so no trainer rank waits in a
collective. Each gather casts the local shard to the engine dtype first, then all-gathers it on the
trainer's device (`gather_device`: the GPU, also under CPU offload) and, on CUDA, on the stream the
sending code pulls it on (`gather_stream`). An engine that pauses only after the deadline reports it
and resumes; the cancel finds it then. An engine gives up waiting for the decision a timeout after
the deadline (the controller is gone) as if cancelled. An engine whose load fails part-way stays
paused until a refit succeeds (RolloutEngine.swap_weights). After a failed attempt the group is
rebuilt; an engine that cannot rejoin (its engine died) is named by its rank's report or, silent, as
one that never reached the rendezvous, and the job stops.

Messages per attempt and engine: two from the controller ('refit', then 'refit_go' or
'refit_cancel'), two back ('refit_paused', 'refit_done'); inside the engine, O(buckets) worker calls.

Refit ranks: the trainer's sending rank is 0; worker `t` (its tensor-parallel rank) of engine `e`
is `1 + e * TP + t`. The join message carries the engine's first rank; each worker adds its own.
"""

from __future__ import annotations

import logging
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.distributed.tensor import DTensor

from molt.models.hf_checkpoint import checkpoint_entries

logger = logging.getLogger("molt")


class RefitError(RuntimeError):
    """A refit did not complete on every engine; the message names each engine that failed and why."""


class RefitCancelled(RefitError):
    """The controller cancelled a refit attempt (an engine missed the pause): nothing was loaded."""


class RefitSendError(RuntimeError):
    """The sender could not deliver the weights (the refit timeout, or a peer went away).
    `absent_ranks`: after a failed rendezvous, the refit ranks that never reached it, when known."""

    def __init__(self, message: str, *, absent_ranks: list[int] | None = None):
        super().__init__(message)
        self.absent_ranks = absent_ranks or []


# -- the bucket plan ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BucketEntry:
    name: str  # Hugging Face checkpoint key, as vLLM's load_weights expects (per expert for MoE experts)
    dtype: str  # torch dtype name, e.g. 'float32'
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


def plan_buckets(entries: list[BucketEntry], bucket_bytes: int) -> list[list[BucketEntry]]:
    """Group parameters, in order, into buckets of one dtype and at most `bucket_bytes` each
    (a larger parameter gets a bucket of its own). The gloo backend's plan."""
    buckets: list[list[BucketEntry]] = []
    current: list[BucketEntry] = []
    current_bytes = 0
    for entry in entries:
        fits = current and current[0].dtype == entry.dtype and current_bytes + entry.num_bytes <= bucket_bytes
        if current and not fits:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(entry)
        current_bytes += entry.num_bytes
    if current:
        buckets.append(current)
    return buckets


def plan_packed_buckets(entries: list[BucketEntry], buffer_bytes: int) -> list[list[BucketEntry]]:
    """Cut the entries where vLLM's packed producer cuts one stream of them: a chunk ends with the
    tensor that takes it past `buffer_bytes` (vllm/distributed/weight_transfer/packed_tensor.py,
    pack_tensors: `if total_bytes > buffer_size_bytes: break`). The nccl backend's plan: one producer
    call over the whole refit then sends exactly these buckets, and the workers' consumer, called once
    per bucket with that bucket's names, cuts each into one broadcast of the same bytes (no prefix of a
    bucket but the whole passes `buffer_bytes`). The wire carries bytes, so dtypes may mix."""
    buckets: list[list[BucketEntry]] = []
    current: list[BucketEntry] = []
    current_bytes = 0
    for entry in entries:
        current.append(entry)
        current_bytes += entry.num_bytes
        if current_bytes > buffer_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
    if current:
        buckets.append(current)
    return buckets


def bucket_num_bytes(bucket: list[list]) -> int:
    """Bytes of one bucket of a wire plan ([name, dtype, shape] entries)."""
    return sum(BucketEntry(name, dtype, tuple(shape)).num_bytes for name, dtype, shape in bucket)


# -- ranks and backends ------------------------------------------------------------------------


def engine_first_rank(engine_index: int, tensor_parallel_size: int) -> int:
    """Refit rank of tensor-parallel worker 0 of engine `engine_index` (rank 0 is the trainer's sender)."""
    return 1 + engine_index * tensor_parallel_size


def refit_world_size(num_engines: int, tensor_parallel_size: int) -> int:
    return 1 + num_engines * tensor_parallel_size


# -- where and on which stream the trainer gathers (GPU-only decisions, pinned by CPU tests) --------


def refit_device(trainer_device: torch.device, current_index: Callable[[], int] | None = None) -> torch.device:
    """The device the NCCL refit communicator is built on and the packed tensors it sends live on: the
    trainer's own GPU, with its index. Never a parameter's device: under FSDP2's CPUOffloadPolicy the
    sharded parameters are on the host, and the communicator would be built on CPU.
    vllm/distributed/device_communicators/pynccl.py, PyNcclCommunicator.broadcast asserts
    `tensor.device == self.device` (so 'cuda' without an index refuses 'cuda:0' tensors), and
    nccl_common.trainer_init takes torch.accelerator.current_device_index() for its own trainer."""
    if trainer_device.type != "cuda":
        raise ValueError(f"the NCCL refit needs a trainer on CUDA, not {trainer_device}: set refit.backend=gloo")
    if trainer_device.index is not None:
        return trainer_device
    index = current_index() if current_index is not None else torch.accelerator.current_device_index()
    return torch.device("cuda", index)


def gather_device(shard_device: torch.device, trainer_device: torch.device) -> torch.device:
    """Where a parameter's local shard is all-gathered: where it is, unless it is on the host while
    the trainer computes on a GPU (FSDP2 CPUOffloadPolicy keeps sharded parameters in host memory:
    torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _init_sharded_param: `if self.offload_to_cpu`).
    Then it goes (already cast to the engine dtype) to the trainer's GPU first: the trainer's group
    is 'cpu:gloo,cuda:nccl' (molt.train), which runs a host tensor's all-gather over gloo and a GPU
    tensor's over NCCL."""
    if shard_device.type == "cpu" and trainer_device.type == "cuda":
        return trainer_device
    return shard_device


def gather_stream(device_type: str, current_stream: Callable[[], object]):
    """The stream a gathered tensor is produced on: on CUDA the stream current when the tensor is
    pulled from the gather generator. Inside vLLM's packed producer that is the producer's own stream
    (vllm/distributed/weight_transfer/packed_tensor.py, packed_nccl_broadcast_producer:
    `with torch.cuda.stream(streams[buffer_idx]): chunk = pack_tensors(iterator, ...)`, and
    pack_tensors calls `next(iterator)`), so the cast, the all-gather, the pack (torch.cat) and the
    broadcast are ordered on one stream; a gather on the default stream is not waited for by the
    producer's streams. Before gathering, that stream waits for the stream the trainer computed on
    (the optimizer's writes). None on CPU: no streams."""
    return current_stream() if device_type == "cuda" else None


def gather_full_tensor(param: torch.Tensor, dtype: torch.dtype, trainer_device: torch.device) -> torch.Tensor:
    """The full tensor of `param` in `dtype`: the local shard is cast first (a bf16 engine halves the
    all-gather of fp32 masters), moved to `gather_device`, then all-gathered (every trainer rank
    calls this in the same order: it is a collective). The same code on CPU (gloo) and GPU (NCCL)."""
    if not isinstance(param, DTensor):
        local = param.detach().to(dtype)
        return local.to(gather_device(local.device, trainer_device))
    local = param.to_local().detach().to(dtype)
    local = local.to(gather_device(local.device, trainer_device))
    # from_local with the global shape and stride: FSDP2's uneven Shard(0) pads as the parameter does.
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride()).full_tensor()


# -- the interface -----------------------------------------------------------------------------


class WeightSender(ABC):
    """The trainer half. Every trainer rank has one, since every rank takes part in the FSDP2 gathers;
    only the sending rank (the controller, refit rank 0) talks to the engines.

    Per group (at start, and again after a failed refit): `group_message` (what each engine's join
    message carries, to which the caller adds the engine's first rank), then `connect` (blocks until
    every worker joined, within refit.timeout_seconds). Per refit: `broadcast`."""

    backend: ClassVar[str]

    def __init__(self, model: torch.nn.Module, *, is_sender: bool, bucket_bytes: int, timeout_seconds: float,
                 engine_dtype: str | None = None, device: torch.device | None = None):
        """`engine_dtype`: what the engines serve (model.dtype); each local shard is cast to it before
        the gather, so the gathers, the wire and the engines' buffers carry engine-sized bytes. None
        keeps each parameter's own dtype. `device`: where the trainer computes (None: the host)."""
        self.model = model
        self.is_sender = is_sender
        self.bucket_bytes = bucket_bytes
        self.timeout_seconds = timeout_seconds
        self.device = device if device is not None else torch.device("cpu")
        params = dict(model.named_parameters())
        entries = []
        # Each entry's source: a parameter, and where in it the entry's tensor sits (a fused MoE expert
        # parameter goes out as the per-expert tensors the checkpoint held, which is what vLLM loads).
        self._sources: dict[str, tuple[str, tuple]] = {}
        for name, p in params.items():
            for key, index, shape in checkpoint_entries(name, tuple(p.shape)):
                entries.append(BucketEntry(key, engine_dtype or str(p.dtype).removeprefix("torch."), shape))
                self._sources[key] = (name, index)
        self.buckets = self.plan(entries)
        self._params = params

    def plan(self, entries: list[BucketEntry]) -> list[list[BucketEntry]]:
        """This backend's bucket plan over the entries, in order."""
        return plan_buckets(entries, self.bucket_bytes)

    @property
    def wire_plan(self) -> list[list[list]]:
        """The bucket plan as msgpack-friendly lists, sent once to each engine at join."""
        return [[[e.name, e.dtype, list(e.shape)] for e in bucket] for bucket in self.buckets]

    @abstractmethod
    def group_message(self, host: str, world_size: int) -> dict:
        """Sender: set up a fresh group of `world_size` refit ranks; return what every engine's join
        message carries (msgpack-friendly: 'backend', the rendezvous, 'timeout_seconds', 'plan')."""

    @abstractmethod
    def connect(self) -> None:
        """Sender: form the group with every worker (they join meanwhile); RefitSendError past the timeout."""

    @abstractmethod
    def close_group(self) -> None:
        """Sender: drop the group (a later `group_message` + `connect` builds a new one)."""

    @abstractmethod
    def deliver(self, gathered: Iterator[tuple[BucketEntry, torch.Tensor]]) -> int:
        """Sender: send every entry `gathered` yields (plan order, full tensors in the entry's dtype,
        gathered when pulled). Returns the bytes sent; RefitSendError on failure. It must pull every
        entry whatever happens on the wire: each pull is a collective of all trainer ranks."""

    def broadcast(self, *, send: bool = True) -> int:
        """Gather every entry from the shards (all trainer ranks) and deliver it (the sender, when
        `send`). Returns bytes sent.

        A failed send raises RefitSendError on the sender, but only after the remaining entries were
        gathered: every trainer rank runs the same gathers whatever happens on the wire, so a
        failure towards the engines never leaves a trainer rank waiting in a collective."""
        with torch.no_grad():
            gathered = self.gathered()
            if not (send and self.is_sender):
                drain(gathered)
                return 0
            try:
                return self.deliver(gathered)
            finally:
                drain(gathered)  # after a failure part-way: the other ranks' gathers still need this one

    def gathered(self) -> Iterator[tuple[BucketEntry, torch.Tensor]]:
        """Each entry of the plan, in order, with its full tensor in the entry's dtype, gathered when
        pulled (`gather_full_tensor`, on the stream current at the pull: `gather_stream`). A parameter
        split over several entries (a fused MoE expert parameter) is gathered once: its entries are
        consecutive in the plan."""
        # Taken now, not at the first pull (a generator's body runs then, inside the producer's stream):
        # the stream the trainer computed on, whose writes (the optimizer's) each gather must wait for.
        compute_stream = torch.cuda.current_stream() if self.device.type == "cuda" else None

        def pull() -> Iterator[tuple[BucketEntry, torch.Tensor]]:
            last_name, last_full, gathered_on = None, None, None
            for bucket in self.buckets:
                for entry in bucket:
                    name, index = self._sources[entry.name]
                    stream = gather_stream(self.device.type, torch.cuda.current_stream)
                    if name != last_name:
                        last_full = None  # free the previous parameter before gathering the next
                        if stream is not None:
                            stream.wait_stream(compute_stream)
                        last_name, gathered_on = name, stream
                        last_full = gather_full_tensor(self._params[name], getattr(torch, entry.dtype), self.device)
                    elif stream is not None and stream != gathered_on:
                        # A fused expert parameter straddling two chunks, packed on the producer's other
                        # stream: that stream waits for the gather, and the allocator for that stream.
                        stream.wait_stream(gathered_on)
                        last_full.record_stream(stream)
                        gathered_on = stream
                    yield entry, last_full[index]

        return pull()


def drain(iterator: Iterator) -> None:
    """Pull what is left of `iterator` (the gathers every trainer rank runs in lockstep)."""
    for _ in iterator:
        pass


class EngineWeightSync(ABC):
    """The engine half, on a rollout rank: drives its engine's workers (vLLM's AsyncLLM `llm`)."""

    backend: ClassVar[str]

    @abstractmethod
    async def join(self, llm, group: dict) -> None:
        """Join every worker to the group `group` describes (a join message: see `WeightSender.group_message`)."""

    @abstractmethod
    async def prepare(self, llm, version: int) -> None:
        """With generation paused and before acknowledging it: make the workers ready to receive."""

    @abstractmethod
    async def receive(self, llm, version: int) -> None:
        """Receive one broadcast and load it into every worker."""

    @abstractmethod
    async def recover(self, llm) -> bool:
        """After a failed `prepare`/`receive`: leave the workers ready for the next group and attempt.
        True when their weights are still the old ones (nothing was loaded), False when the failure
        may have left a mix of old and new weights: the engine must not serve until a refit succeeds."""

    @abstractmethod
    async def leave(self, llm) -> None:
        """Leave the group."""

    async def abandon(self, llm) -> None:
        """After the controller's 'refit_cancel' (with the workers prepared, nothing received): tear the
        group down at once, loading nothing; the trainer rebuilds it for the retry."""
        await self.recover(llm)
        await self.leave(llm)


# -- the watchdog ------------------------------------------------------------------------------


class Watchdog:
    """Calls `on_expiry` from a daemon thread unless disarmed within `timeout_seconds`.

    NCCL never times out by itself: a collective whose peer is gone waits forever. The NCCL
    backend arms one around each blocking step and aborts the communicator on expiry, which
    makes the blocked call return (or fail); the step then raises because `fired` is set.

        with Watchdog(60, abort, "refit v3 broadcast") as watchdog:
            blocking_step()
        if watchdog.fired: raise ...
    """

    def __init__(self, timeout_seconds: float, on_expiry: Callable[[], None], what: str):
        self.timeout_seconds = timeout_seconds
        self.on_expiry = on_expiry
        self.what = what
        self.fired = False
        self._done = threading.Event()
        self._lock = threading.Lock()  # fired, or disarmed in time: never both
        self._disarmed = False
        self._thread = threading.Thread(target=self._watch, name=f"molt-watchdog: {what}", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.disarm()

    def disarm(self) -> None:
        """Stop watching; if it already fired, wait until `on_expiry` has returned."""
        with self._lock:
            self._disarmed = True
        self._done.set()
        if self.fired:
            self._thread.join()

    def _watch(self) -> None:
        if self._done.wait(self.timeout_seconds):
            return
        with self._lock:
            if self._disarmed:
                return
            self.fired = True
        logger.error("%s: still blocked after %.0fs; aborting it", self.what, self.timeout_seconds)
        try:
            self.on_expiry()
        except Exception:
            logger.exception("%s: the abort failed", self.what)

