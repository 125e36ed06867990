"""The nccl backend of weight sync (molt.refit.weight_sync): GPU to GPU through vLLM 0.32's NCCL
weight-transfer engine (vllm/distributed/weight_transfer/nccl_engine.py), driven by Molt's
control flow instead of vLLM's trainer helper, which assumes a single engine.

- Rendezvous: the trainer mints an NCCL unique id and sends it, base64, in Molt's own msgpack join
  message; every engine worker and the trainer build the communicator from it. vLLM's default
  rendezvous (a TCPStore that pickles) is never used: Molt allows no pickle on any socket.
- Ranks: the trainer's sender is rank 0; engine `e` gets rank offset `1 + e * TP`, to which vLLM adds
  each worker's own rank inside the engine (nccl_common.worker_init_process_group).
- Device: the sender's communicator and packed tensors are on the trainer's GPU (`refit_device`),
  also under train.cpu_offload, where the parameters are on the host.
- Wire: ONE call of vLLM's packed producer per refit (as vLLM's own trainer,
  NCCLTrainerWeightTransferEngine._broadcast), over a generator that gathers each tensor when the
  producer pulls it, so on the producer's stream (molt.refit.weight_sync.gather_stream), with each shard
  cast to the engine dtype before its all-gather; its double buffering overlaps the gathers of chunk
  i + 1 with the broadcast of chunk i. Molt's plan follows the producer's own cuts
  (plan_packed_buckets) with a buffer of refit.bucket_megabytes raised to the largest tensor
  (`packed_buffer_bytes`: vLLM warns for every larger tensor on every refit), so each bucket is one
  packed broadcast; the rollout rank sends one update per bucket with that bucket's names, dtypes
  (the engine dtype) and shapes, and vLLM's consumer on the workers cuts it into that one broadcast.
  The consumer allocates each bucket's receive buffer; vLLM's layerwise reload keeps it alive only
  until the layers viewing it are complete (molt.refit.receiver says what that reload retains).
- Timeouts: NCCL never times out. A watchdog (molt.refit.weight_sync.Watchdog) on the trainer aborts the
  communicator after refit.timeout_seconds (the producer then sends nothing more: GuardedLink, but
  every gather still runs); one in each worker, armed at the first bucket (after the controller's
  'refit_go', so it never counts other engines' pause), aborts the worker's, after which no
  update_weights is issued. The step then raises RefitSendError (trainer) or RefitError (worker), and
  the trainer rebuilds the group from a fresh unique id, so refit.max_attempts works as with gloo.
- A 'refit_cancel' (an engine missed the pause) ends the prepared update session and shuts the
  worker's communicator down without receiving (EngineWeightSync.abandon).

NOTHING IN THIS MODULE HAS RUN ON A GPU: the machines Molt is tested on have no GPU and no CUDA
build of vLLM. The CPU tests (tests/test_weight_sync.py) cover the messages (checked against vLLM's
own init and update dataclasses), the ranks, the plan against vLLM's pack_tensors, the producer and
consumer over a stand-in link, the device and stream decisions, the watchdogs and the control flow
with stand-in communicators; the NCCL calls themselves (unique id, communicator init, packed
broadcast, abort, and vLLM's worker side) are unverified. A `gpu` test checks the gathers on CUDA
streams with a stand-in communicator; it has not run yet either.
"""

from __future__ import annotations

import base64
import logging
import threading

from collections.abc import Callable, Iterator

import torch

from molt.refit.weight_sync import (BucketEntry, EngineWeightSync, RefitSendError, Watchdog, WeightSender,
                                    plan_packed_buckets, refit_device)

logger = logging.getLogger("molt")

PACKED_NUM_BUFFERS = 2  # vLLM's default double buffering; both sides must agree


def mint_unique_id() -> str:
    """A fresh NCCL unique id, standard base64 (what vLLM's `nccl_unique_id_b64` expects)."""
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    return base64.b64encode(bytes(NCCLLibrary().ncclGetUniqueId().internal)).decode()


def worker_init_info(group: dict) -> dict:
    """The `init_info` of `AsyncLLM.init_weight_transfer_engine` for the engine whose join message is
    `group` (its 'rank' is the engine's first refit rank: vLLM's rank offset)."""
    return {"nccl_unique_id_b64": group["nccl_unique_id_b64"], "rank_offset": group["rank"],
            "world_size": group["world_size"], "packed": True,
            "packed_buffer_size_bytes": group["packed_buffer_size_bytes"],
            "packed_num_buffers": group["packed_num_buffers"]}


def bucket_update_infos(plan: list[list[list]]) -> list[dict]:
    """One `update_info` of `AsyncLLM.update_weights` per bucket of a wire plan."""
    return [{"names": [name for name, _, _ in bucket], "dtype_names": [dtype for _, dtype, _ in bucket],
             "shapes": [list(shape) for _, _, shape in bucket]} for bucket in plan]


def packed_buffer_bytes(bucket_bytes: int, entries: list[BucketEntry]) -> int:
    """vLLM's packed buffer size for a refit: refit.bucket_megabytes, raised to the largest tensor.
    pack_tensors (vllm/distributed/weight_transfer/packed_tensor.py) warns for every tensor larger
    than its buffer, on every refit; sized so, it never does."""
    return max([bucket_bytes] + [entry.num_bytes for entry in entries])


class GuardedLink:
    """What vLLM's packed producer broadcasts through: the sender's communicator, until its watchdog
    fired. After that nothing more is put on the wire (the producer keeps pulling, so every gather
    still runs); `sent` counts the bytes of the broadcasts issued on a live communicator."""

    def __init__(self, communicator, fired: Callable[[], bool]):
        self.communicator = communicator
        self.fired = fired
        self.sent = 0

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        if self.fired():
            return
        self.communicator.broadcast(tensor, src=src, stream=stream)
        if not self.fired():
            self.sent += tensor.numel()  # uint8: bytes


class NcclSender(WeightSender):
    """The trainer half over NCCL (vLLM's PyNcclCommunicator and packed producer)."""

    backend = "nccl"

    def __init__(self, model: torch.nn.Module, **kwargs):
        super().__init__(model, **kwargs)
        self.communicator = None  # vLLM's PyNcclCommunicator, sender only
        self._unique_id: str | None = None
        self._world_size = 0
        self._watchdog: Watchdog | None = None

    def plan(self, entries: list[BucketEntry]) -> list[list[BucketEntry]]:
        """vLLM's own cuts (plan_packed_buckets), so one producer call sends one bucket per chunk."""
        self.packed_buffer_bytes = packed_buffer_bytes(self.bucket_bytes, entries)
        return plan_packed_buckets(entries, self.packed_buffer_bytes)

    def group_message(self, host: str, world_size: int) -> dict:
        self._unique_id, self._world_size = mint_unique_id(), world_size
        return {"backend": self.backend, "nccl_unique_id_b64": self._unique_id, "world_size": world_size,
                "packed_buffer_size_bytes": self.packed_buffer_bytes, "packed_num_buffers": PACKED_NUM_BUFFERS,
                "timeout_seconds": self.timeout_seconds, "plan": self.wire_plan}

    def connect(self) -> None:
        """Join as rank 0 (with the warm-up all-reduce every peer runs) on the trainer's GPU
        (`refit_device`). The unique-id rendezvous has no barrier and cannot be interrupted: past the
        timeout the init is left behind in its thread."""
        from vllm.distributed.weight_transfer.nccl_common import uid_init_process_group

        device = refit_device(self.device)
        result: dict = {}

        def init() -> None:
            try:
                result["communicator"] = uid_init_process_group(base64.b64decode(self._unique_id), 0,
                                                                self._world_size, device)
            except Exception as error:
                result["error"] = error

        thread = threading.Thread(target=init, name="molt-nccl-init", daemon=True)
        thread.start()
        thread.join(self.timeout_seconds)
        if "communicator" not in result:
            raise RefitSendError(f"the NCCL refit group of {self._world_size} ranks did not form within "
                                 f"refit.timeout_seconds={self.timeout_seconds:g}: "
                                 f"{result.get('error', 'an engine worker never joined')}")
        self.communicator = result["communicator"]

    def close_group(self) -> None:
        if self.communicator is not None:
            self.communicator.destroy()
            self.communicator = None

    def broadcast(self, *, send: bool = True) -> int:
        """As WeightSender.broadcast; on the sender a watchdog aborts the communicator after
        refit.timeout_seconds, after which the remaining entries are only gathered."""
        if not (send and self.is_sender):
            return super().broadcast(send=False)
        with Watchdog(self.timeout_seconds, self._abort, "refit broadcast (nccl)") as self._watchdog:
            return super().broadcast(send=True)

    def _abort(self) -> None:
        """The watchdog's action: abort the communicator (vLLM's destroy is ncclCommAbort), which ends
        the blocked broadcast; nothing more is sent on it (GuardedLink)."""
        self.communicator.destroy()

    def deliver(self, gathered: Iterator[tuple[BucketEntry, torch.Tensor]]) -> int:
        """ONE call of vLLM's packed producer over the whole refit, as vLLM's own trainer
        (nccl_engine.py, NCCLTrainerWeightTransferEngine._broadcast): each tensor is gathered when
        the producer pulls it, on the producer's stream (`gather_stream`), and chunk i + 1 is packed
        while chunk i is on the wire (double buffering across buckets; a call per bucket would drain
        the streams at each). The chunks are the plan's buckets (plan_packed_buckets)."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        self._check_alive()
        link = GuardedLink(self.communicator, self._fired)
        error = None
        try:
            packed_nccl_broadcast_producer(iterator=((entry.name, tensor) for entry, tensor in gathered),
                                           group=link, src=0, post_iter_func=lambda item: item[1],
                                           buffer_size_bytes=self.packed_buffer_bytes,
                                           num_buffers=PACKED_NUM_BUFFERS)
        except RuntimeError as failure:  # an NCCL error; the caller gathers what is left
            error = str(failure)
        if error is None and self._fired():
            error = (f"no progress within refit.timeout_seconds={self.timeout_seconds:g}; "
                     f"the NCCL communicator was aborted")
        if error is not None:
            raise RefitSendError(f"{self.backend} broadcast failed after {link.sent} bytes: {error}")
        return link.sent

    def _fired(self) -> bool:
        return self._watchdog is not None and self._watchdog.fired

    def _check_alive(self) -> None:
        if self._fired():
            raise RefitSendError(f"no progress within refit.timeout_seconds={self.timeout_seconds:g}; "
                                 f"the NCCL communicator was aborted")


class NcclEngineSync(EngineWeightSync):
    """The engine half over NCCL: vLLM's weight-transfer API on the AsyncLLM (the engine is started
    with `weight_transfer_config={'backend': 'nccl'}`), plus Molt's worker watchdog
    (molt.refit.receiver). Never run on a GPU."""

    backend = "nccl"

    def __init__(self):
        self.update_infos: list[dict] = []
        self.timeout_seconds = 0.0
        self.joined = False
        # Set from the first update_weights until an update finishes: the model may hold a mix of old
        # and new weights (an aborted broadcast loads whatever its buffer held).
        self.mixed = False

    async def join(self, llm, group: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if group.get("backend") != self.backend:
            raise RuntimeError(f"the trainer sends weights over {group.get('backend')}, but this engine was "
                               f"started for {self.backend} (refit.backend resolves differently on the two sides)")
        if self.joined:
            await llm.shutdown_weight_transfer_engine()
            self.joined = False
        self.update_infos = bucket_update_infos(group["plan"])
        self.timeout_seconds = group["timeout_seconds"]
        await llm.collective_rpc("molt_quiet_expected_reload_warnings")
        await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=worker_init_info(group)))
        self.joined = True

    async def prepare(self, llm, version: int) -> None:
        """Opens vLLM's update session; the watchdog is armed only at the first bucket (after the
        controller's 'refit_go'), so it never counts other engines' pause time."""
        await llm.start_weight_update()

    async def receive(self, llm, version: int) -> None:
        """One `molt_update_weights` per bucket: each worker arms its watchdog at the first and
        refuses any bucket once it fired (an aborted communicator would 'receive' uninitialised
        buffers), then runs vLLM's update_weights."""
        self.mixed = True
        what = f"refit v{version} (nccl)"
        for index, update_info in enumerate(self.update_infos):
            await llm.collective_rpc("molt_update_weights", kwargs={
                "update_info": update_info, "first": index == 0, "timeout_seconds": self.timeout_seconds,
                "what": what})
        # Raises if the watchdog fired during the last bucket: an aborted broadcast returns as if it had received.
        await llm.collective_rpc("molt_disarm_watchdog")
        await llm.finish_weight_update()
        await llm.collective_rpc("molt_retie_embeddings")  # vLLM's reload puts the old tied lm_head back
        self.mixed = False

    async def recover(self, llm) -> bool:
        await llm.collective_rpc("molt_abandon_weight_update")
        return not self.mixed

    async def leave(self, llm) -> None:
        if self.joined:
            await llm.shutdown_weight_transfer_engine()
            self.joined = False
