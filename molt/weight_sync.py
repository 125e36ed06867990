"""Weight sync: how a refit's weights go from the trainer into every engine's workers (DESIGN
section 6), as one interface with two backends driven by the same control flow:

- 'gloo' (molt.refit): host memory over a gloo group; what CPU runs (and CI) use.
- 'nccl' (molt.weight_sync_nccl): vLLM's NCCL weight-transfer engine, GPU to GPU.

Each backend has a trainer half (`WeightSender`, on every trainer rank) and an engine half
(`EngineWeightSync`, on each rollout rank, driving its engine's workers). One refit:

    controller                      rollout rank (engine)                 engine workers
    'refit' v, attempt   ------->   pause ('wait', or 'keep' with partial rollout)
                                    EngineWeightSync.prepare
                         <-------   'refit_paused'
    (all paused, within the deadline)
    WeightSender.broadcast  ====== EngineWeightSync.receive  ==========>  receive bucket by bucket, load
                                    resume, label the new version
                         <-------   'refit_done'

If an engine does not acknowledge the pause in time, nothing is broadcast, but every trainer rank
still runs the FSDP2 gathers (`broadcast(send=False)`), so no trainer rank waits in a collective.
An engine whose load fails part-way stays paused until a refit succeeds (RolloutEngine.swap_weights).
After a failed attempt the group is rebuilt; an engine that cannot rejoin (its engine died) is named
by its rank's report or, silent, as one that never reached the rendezvous, and the job stops.

Refit ranks: the trainer's sending rank is 0; worker `t` (its tensor-parallel rank) of engine `e`
is `1 + e * TP + t`. The join message carries the engine's first rank; each worker adds its own.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.distributed.tensor import DTensor

from molt.config import ConfigError, MoltConfig
from molt.hf_checkpoint import checkpoint_entries

logger = logging.getLogger("molt")

BACKENDS = ("gloo", "nccl")


class RefitError(RuntimeError):
    """A refit did not complete on every engine; the message names each engine that failed and why."""


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
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * getattr(torch, self.dtype).itemsize


def plan_buckets(entries: list[BucketEntry], bucket_bytes: int) -> list[list[BucketEntry]]:
    """Group parameters, in order, into buckets of one dtype and at most `bucket_bytes` each
    (a larger parameter gets a bucket of its own)."""
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


def bucket_num_bytes(bucket: list[list]) -> int:
    """Bytes of one bucket of a wire plan ([name, dtype, shape] entries)."""
    return sum(BucketEntry(name, dtype, tuple(shape)).num_bytes for name, dtype, shape in bucket)


# -- ranks and backends ------------------------------------------------------------------------


def engine_first_rank(engine_index: int, tensor_parallel_size: int) -> int:
    """Refit rank of tensor-parallel worker 0 of engine `engine_index` (rank 0 is the trainer's sender)."""
    return 1 + engine_index * tensor_parallel_size


def refit_world_size(num_engines: int, tensor_parallel_size: int) -> int:
    return 1 + num_engines * tensor_parallel_size


def resolve_backend(backend: str, trainer_device_type: str, *, colocate: bool = False) -> str:
    """'gloo' or 'nccl' from refit.backend ('auto' = nccl when the trainer computes on CUDA and every
    engine has GPUs of its own; gloo otherwise).

    Colocated (layout.colocate), the sender (trainer rank 0) and engine 0's worker sit on one GPU, and
    NCCL refuses a communicator with two ranks on one device ("Duplicate GPU detected", NCCL's
    init.cc; vLLM's NCCL weight-transfer engine builds exactly that group), so refit goes through host
    memory over gloo. vLLM 0.32's CUDA-IPC engine (vllm/distributed/weight_transfer/ipc_engine.py)
    would share the GPU tensors without a copy: the faster option for later (docs/gpu.md)."""
    if backend not in ("auto", *BACKENDS):
        raise ConfigError(f"refit.backend={backend!r}: use auto, gloo or nccl")
    if backend == "auto":
        return "nccl" if trainer_device_type == "cuda" and not colocate else "gloo"
    if backend == "nccl" and trainer_device_type != "cuda":
        raise ConfigError(f"refit.backend='nccl' but the trainer computes on {trainer_device_type}: NCCL moves GPU "
                          f"memory; set refit.backend=gloo (or auto)")
    if backend == "nccl" and colocate:
        raise ConfigError("refit.backend='nccl' with layout.colocate=True: the sender and an engine share a GPU and "
                          "NCCL refuses a duplicate GPU in one communicator; set refit.backend=auto (gloo)")
    return backend


def build_sender(cfg: MoltConfig, model: torch.nn.Module, *, is_sender: bool, device_type: str) -> WeightSender:
    """The trainer half of the configured backend (every trainer rank builds one)."""
    kwargs = dict(is_sender=is_sender, bucket_bytes=int(cfg.refit.bucket_megabytes * 2**20),
                  timeout_seconds=cfg.refit.timeout_seconds, engine_dtype=cfg.model.dtype)
    if resolve_backend(cfg.refit.backend, device_type, colocate=cfg.layout.colocate) == "nccl":
        from molt.weight_sync_nccl import NcclSender

        return NcclSender(model, **kwargs)
    from molt.refit import RefitSender

    return RefitSender(model, **kwargs)


def build_engine_sync(backend: str) -> EngineWeightSync:
    """The engine half of `backend` ('gloo' or 'nccl')."""
    if backend == "nccl":
        from molt.weight_sync_nccl import NcclEngineSync

        return NcclEngineSync()
    from molt.refit import GlooEngineSync

    return GlooEngineSync()


# -- the interface -----------------------------------------------------------------------------


class WeightSender(ABC):
    """The trainer half. Every trainer rank has one, since every rank takes part in the FSDP2 gathers;
    only the sending rank (the controller, refit rank 0) talks to the engines.

    Per group (at start, and again after a failed refit): `group_message` (what each engine's join
    message carries, to which the caller adds the engine's first rank), then `connect` (blocks until
    every worker joined, within refit.timeout_seconds). Per refit: `broadcast`."""

    backend: ClassVar[str]

    def __init__(self, model: torch.nn.Module, *, is_sender: bool, bucket_bytes: int, timeout_seconds: float,
                 engine_dtype: str | None = None):
        """`engine_dtype`: what the engines serve (model.dtype); the stored (master) weights are cast
        to it inside each bucket, so the wire and the engines' buffers carry engine-sized bytes.
        None keeps each parameter's own dtype."""
        self.model = model
        self.is_sender = is_sender
        self.bucket_bytes = bucket_bytes
        self.timeout_seconds = timeout_seconds
        params = dict(model.named_parameters())
        entries = []
        # Each entry's source: a parameter, and where in it the entry's tensor sits (a fused MoE expert
        # parameter goes out as the per-expert tensors the checkpoint held, which is what vLLM loads).
        self._sources: dict[str, tuple[str, tuple]] = {}
        for name, p in params.items():
            for key, index, shape in checkpoint_entries(name, tuple(p.shape)):
                entries.append(BucketEntry(key, engine_dtype or str(p.dtype).removeprefix("torch."), shape))
                self._sources[key] = (name, index)
        self.buckets = plan_buckets(entries, bucket_bytes)
        self._params = params

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
    def send_bucket(self, bucket: list[BucketEntry], tensors: list[torch.Tensor]) -> Callable[[], None] | None:
        """Sender: start delivering one bucket (full tensors in their stored dtype; each goes on the wire
        cast to its entry's dtype). Returns None when it is delivered, or a function that waits for a
        send still in flight, so the next bucket's gathers overlap it (the caller waits before the
        bucket after that starts). RefitSendError on failure, from either."""

    def broadcast(self, *, send: bool = True) -> int:
        """Gather every bucket from the shards (all trainer ranks) and deliver it (the sender, when
        `send`). Returns bytes sent.

        A failed send raises RefitSendError on the sender, but only after the remaining buckets were
        gathered: every trainer rank runs the same gathers whatever happens on the wire, so a
        failure towards the engines never leaves a trainer rank waiting in a collective."""
        with torch.no_grad():
            return self._broadcast_buckets(send and self.is_sender)

    def _broadcast_buckets(self, send: bool) -> int:
        """Bucket i + 1 is gathered while bucket i is on the wire: at most one send in flight."""
        sent, error, in_flight = 0, None, None  # in_flight: (wait, bytes) of the bucket being sent

        def finish_in_flight() -> None:
            nonlocal sent, error, in_flight
            if in_flight is None:
                return
            wait, num_bytes = in_flight
            in_flight = None
            try:
                wait()
                sent += num_bytes
            except RefitSendError as failure:
                error = failure

        gathered: dict[str, torch.Tensor] = {}
        for bucket in self.buckets:
            tensors = self._gather_bucket(bucket, gathered)
            finish_in_flight()
            if not send or error is not None:
                continue
            num_bytes = sum(entry.num_bytes for entry in bucket)
            try:
                wait = self.send_bucket(bucket, tensors)
            except RefitSendError as failure:
                error = failure
                continue
            if wait is None:
                sent += num_bytes
            else:
                in_flight = (wait, num_bytes)
        finish_in_flight()
        if error is not None:
            raise RefitSendError(f"{self.backend} broadcast failed after {sent} bytes: {error}") from error
        return sent

    def _gather_bucket(self, bucket: list[BucketEntry], gathered: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The full tensor of each entry (all trainer ranks gather). A parameter split over several
        entries is gathered once; `gathered` keeps the last bucket's parameters, since a fused expert
        parameter may straddle two buckets."""
        sources = [self._sources[entry.name] for entry in bucket]  # (parameter name, index into it)
        current = {}
        for name, _ in sources:
            if name not in current:
                current[name] = gathered[name] if name in gathered else _full_tensor(self._params[name])
        gathered.clear()
        gathered.update(current)
        return [current[name][index] for name, index in sources]


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


def _full_tensor(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param
