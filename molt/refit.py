"""The trainer side of refit: bucket the weights, gather them from FSDP2 shards, broadcast them
into every engine's workers through one dedicated process group (DESIGN section 6).

Control traffic per refit is one 'refit' message per rollout rank; the bucket plan (names,
dtypes, shapes) travels once, when the group is built. Each bucket is one flat tensor and one
broadcast, so the number of collectives is the number of buckets.
"""

from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

logger = logging.getLogger("molt")


class RefitError(RuntimeError):
    """A refit did not complete on every engine; the message names each engine that failed and why."""


class RefitSendError(RuntimeError):
    """The sender's broadcast failed (the refit group's timeout, or a peer went away)."""


@dataclass(frozen=True)
class BucketEntry:
    name: str  # Hugging Face parameter name, as vLLM's load_weights expects
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


def make_refit_group(host: str, port: int, rank: int, world_size: int, timeout_seconds: float,
                     *, is_server: bool) -> dist.ProcessGroup:
    """A gloo group outside torch.distributed's world: the trainer's sender and the engine workers."""
    timeout = datetime.timedelta(seconds=timeout_seconds)
    store = dist.TCPStore(host, port, world_size=world_size, is_master=is_server, timeout=timeout,
                          wait_for_workers=False)
    return dist.ProcessGroupGloo(dist.PrefixStore("molt-refit", store), rank, world_size, timeout)


def find_free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class RefitSender:
    """Runs on every trainer rank (all take part in the FSDP2 gathers); only the sending rank
    talks to the engines."""

    def __init__(self, model: torch.nn.Module, *, is_sender: bool, bucket_bytes: int, timeout_seconds: float,
                 engine_dtype: str | None = None):
        """`engine_dtype`: what the engines serve (model.dtype); the stored (master) weights are cast
        to it inside each bucket, so the wire and the engine's buffers carry engine-sized bytes.
        None keeps each parameter's own dtype."""
        self.model = model
        self.is_sender = is_sender
        self.timeout_seconds = timeout_seconds
        self.group: dist.ProcessGroup | None = None
        params = dict(model.named_parameters())
        entries = [BucketEntry(name, engine_dtype or str(p.dtype).removeprefix("torch."), tuple(p.shape))
                   for name, p in params.items()]
        self.buckets = plan_buckets(entries, bucket_bytes)
        self._params = params
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def wire_plan(self) -> list[list[list]]:
        """The bucket plan as msgpack-friendly lists, sent once to each engine worker."""
        return [[[e.name, e.dtype, list(e.shape)] for e in bucket] for bucket in self.buckets]

    def open_group(self, host: str, port: int, world_size: int) -> None:
        """Sender only: serve the rendezvous and join as rank 0 (blocks until all workers join)."""
        self.group = make_refit_group(host, port, 0, world_size, self.timeout_seconds, is_server=True)

    def close_group(self) -> None:
        self.group = None

    def broadcast(self) -> int:
        """Gather every bucket from the shards (all trainer ranks) and send it (sender). Returns bytes sent.

        A failed send raises RefitSendError on the sender, but only after the remaining buckets were
        gathered: every trainer rank runs the same gathers whatever happened on the wire, so a
        failure towards the engines never leaves a trainer rank waiting in a collective."""
        with torch.no_grad():
            return self._broadcast_buckets()

    def _broadcast_buckets(self) -> int:
        sent, error = 0, None
        for bucket in self.buckets:
            tensors = [_full_tensor(self._params[entry.name]) for entry in bucket]
            if not self.is_sender or error is not None:
                continue
            flat = self._flat_buffer(bucket)
            offset = 0
            for tensor in tensors:
                flat[offset:offset + tensor.numel()].copy_(tensor.detach().reshape(-1))  # cast to the engine dtype
                offset += tensor.numel()
            options = dist.BroadcastOptions()
            options.rootRank = 0
            try:
                self.group.broadcast([flat], options).wait()
            except RuntimeError as failure:  # gloo: the group's timeout, or a closed connection
                error = failure
                continue
            sent += flat.numel() * flat.element_size()
        if error is not None:
            raise RefitSendError(f"broadcast failed after {sent} bytes: {error}") from error
        return sent

    def _flat_buffer(self, bucket: list[BucketEntry]) -> torch.Tensor:
        """A view of one reused buffer per dtype: fresh multi-MB buffers every refit would run
        at first-touch memory speed (the allocator returns large blocks to the OS)."""
        dtype = bucket[0].dtype
        numel = sum(e.num_bytes for e in bucket) // getattr(torch, dtype).itemsize
        buffer = self._buffers.get(dtype)
        if buffer is None:
            largest = max(sum(e.num_bytes for e in b) for b in self.buckets if b[0].dtype == dtype)
            device = next(iter(self._params.values())).device
            buffer = self._buffers[dtype] = torch.empty(largest // getattr(torch, dtype).itemsize,
                                                        dtype=getattr(torch, dtype), device=device)
        return buffer[:numel]


def _full_tensor(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param
