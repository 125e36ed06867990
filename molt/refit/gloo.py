"""The gloo backend of weight sync (molt.refit.weight_sync): host memory over one gloo process group
outside torch.distributed's world, the trainer's sender as rank 0 and every engine worker as one
more rank. What CPU runs use; the engine workers' side is molt.refit.receiver.

The bucket plan (names, dtypes, shapes) travels once, in the join message. Each bucket is one flat
tensor and one broadcast, so the collectives per refit are the buckets.
"""

from __future__ import annotations

import datetime
import logging
import itertools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from molt.refit.weight_sync import BucketEntry, EngineWeightSync, RefitSendError, WeightSender, gather_device

logger = logging.getLogger("molt")


def serve_refit_rendezvous(host: str, world_size: int, timeout_seconds: float) -> dist.TCPStore:
    """The sender's rendezvous store, listening on a port the OS picked (its `.port`): the port is
    named to the engines only once it is bound, so no other process can take it meanwhile."""
    return dist.TCPStore(host, 0, world_size=world_size, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_seconds), wait_for_workers=False)


def join_refit_rendezvous(host: str, port: int, world_size: int, timeout_seconds: float) -> dist.TCPStore:
    """An engine worker's connection to the sender's rendezvous."""
    return dist.TCPStore(host, port, world_size=world_size, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_seconds))


def arrival_key(rank: int) -> str:
    """The rendezvous key an engine worker sets on arrival, so that a rendezvous that times out can
    name the ranks that never came (the others were waiting for them)."""
    return f"molt-arrived/{rank}"


def make_refit_group(store: dist.Store, rank: int, world_size: int, timeout_seconds: float) -> dist.ProcessGroup:
    """A gloo group outside torch.distributed's world: the trainer's sender and the engine workers."""
    timeout = datetime.timedelta(seconds=timeout_seconds)
    return dist.ProcessGroupGloo(dist.PrefixStore("molt-refit", store), rank, world_size, timeout)


class RefitSender(WeightSender):
    """The trainer half over gloo; the gloo group's own timeout (refit.timeout_seconds) bounds each
    broadcast, so no watchdog is needed."""

    backend = "gloo"

    def __init__(self, model: torch.nn.Module, **kwargs):
        super().__init__(model, **kwargs)
        self.group: dist.ProcessGroup | None = None
        self._rendezvous: dist.TCPStore | None = None  # the next group's, served by this sender
        self._world_size = 0  # the next group's
        self._buffers: dict[str, list[torch.Tensor]] = {}  # dtype -> two flat buffers (see _flat_buffer)

    def group_message(self, host: str, world_size: int) -> dict:
        """Serve a fresh rendezvous; the message names the port it listens on."""
        self._rendezvous = serve_refit_rendezvous(host, world_size, self.timeout_seconds)
        self._world_size = world_size
        return {"backend": self.backend, "host": host, "port": self._rendezvous.port, "world_size": world_size,
                "timeout_seconds": self.timeout_seconds, "plan": self.wire_plan}

    def connect(self) -> None:
        """Join the group as rank 0 (blocks until every worker joined)."""
        world_size = self._world_size
        try:
            self.group = make_refit_group(self._rendezvous, 0, world_size, self.timeout_seconds)
        except RuntimeError as error:  # the store's timeout
            absent = [rank for rank in range(1, world_size) if not self._rendezvous.check([arrival_key(rank)])]
            raise RefitSendError(f"not every engine worker joined the gloo refit group of {world_size} ranks "
                                 f"within refit.timeout_seconds={self.timeout_seconds:g} (refit ranks that never "
                                 f"came: {absent}): {error}", absent_ranks=absent) from error

    def close_group(self) -> None:
        self.group = None
        self._rendezvous = None

    def deliver(self, gathered: Iterator[tuple[BucketEntry, torch.Tensor]]) -> int:
        """Bucket by bucket; bucket i + 1 is gathered while bucket i is on the wire (at most one send in
        flight). After a failed send the remaining buckets are only gathered."""
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

        for bucket in self.buckets:
            tensors = [tensor for _, tensor in itertools.islice(gathered, len(bucket))]
            finish_in_flight()
            if error is not None:
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

    def send_bucket(self, bucket: list[BucketEntry], tensors: list[torch.Tensor]) -> Callable[[], None] | None:
        """Copy the bucket (full tensors, already in the engine dtype) into a flat buffer and start its
        broadcast; gloo runs it on its own thread while the caller gathers the next bucket. Returns its
        wait (None: already delivered). RefitSendError on failure, from either."""
        flat = self._flat_buffer(bucket)
        offset = 0
        for tensor in tensors:
            flat[offset:offset + tensor.numel()].copy_(tensor.detach().reshape(-1))
            offset += tensor.numel()
        options = dist.BroadcastOptions()
        options.rootRank = 0
        try:
            work = self.group.broadcast([flat], options)
        except RuntimeError as error:  # gloo: a closed connection
            raise RefitSendError(str(error)) from error

        def wait() -> None:
            try:
                work.wait()
            except RuntimeError as error:  # gloo: the group's timeout, or a closed connection
                raise RefitSendError(str(error)) from error

        return wait

    def _flat_buffer(self, bucket: list[BucketEntry]) -> torch.Tensor:
        """A view of one of two reused buffers per dtype, taken in turn: the bucket being filled
        never shares memory with the one still on the wire. Reused because fresh multi-MB buffers
        every refit would run at first-touch memory speed (the allocator returns large blocks to the OS)."""
        dtype = bucket[0].dtype
        numel = sum(e.num_bytes for e in bucket) // getattr(torch, dtype).itemsize
        buffers = self._buffers.get(dtype)
        if buffers is None:
            largest = max(sum(e.num_bytes for e in b) for b in self.buckets if b[0].dtype == dtype)
            device = gather_device(next(iter(self._params.values())).device, self.device)  # where gathers land
            buffers = self._buffers[dtype] = [torch.empty(largest // getattr(torch, dtype).itemsize,
                                                          dtype=getattr(torch, dtype), device=device) for _ in range(2)]
        buffers.reverse()  # the other one than last time
        return buffers[0][:numel]


class GlooEngineSync(EngineWeightSync):
    """The engine half over gloo: Molt's worker extension (molt.refit.receiver) does the work in
    each worker; this calls it through `collective_rpc`."""

    backend = "gloo"

    async def join(self, llm, group: dict) -> None:
        group = dict(group)
        backend = group.pop("backend", self.backend)
        if backend != self.backend:
            raise RuntimeError(f"the trainer sends weights over {backend}, but this engine was started for "
                               f"{self.backend} (refit.backend resolves differently on the two sides)")
        await llm.collective_rpc("molt_join_refit_group", kwargs=group)

    async def prepare(self, llm, version: int) -> None:
        await llm.collective_rpc("molt_prepare_refit", kwargs={"version": version})

    async def receive(self, llm, version: int) -> None:
        await llm.collective_rpc("molt_receive_weights", kwargs={"version": version})

    async def recover(self, llm) -> bool:
        return all(await llm.collective_rpc("molt_weights_intact"))

    async def leave(self, llm) -> None:
        await llm.collective_rpc("molt_leave_refit_group")
