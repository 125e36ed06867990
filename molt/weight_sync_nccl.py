"""The nccl backend of weight sync (molt.weight_sync): GPU to GPU through vLLM 0.32's NCCL
weight-transfer engine (vllm/distributed/weight_transfer/nccl_engine.py), driven by Molt's
control flow instead of vLLM's trainer helper, which assumes a single engine.

- Rendezvous: the trainer mints an NCCL unique id and sends it, base64, in Molt's own msgpack join
  message; every engine worker and the trainer build the communicator from it. vLLM's default
  rendezvous (a TCPStore that pickles) is never used: Molt allows no pickle on any socket.
- Ranks: the trainer's sender is rank 0; engine `e` gets rank offset `1 + e * TP`, to which vLLM adds
  each worker's own rank inside the engine (nccl_common.worker_init_process_group).
- Wire: each bucket of Molt's plan goes through vLLM's packed producer (trainer) and consumer
  (workers) with the same geometry on both sides: buffer size = refit.bucket_megabytes, so one
  bucket is one packed broadcast; the rollout rank sends one `update_weights` per bucket with that
  bucket's names, dtypes (the engine dtype) and shapes. The consumer allocates each bucket's
  receive buffer; vLLM's layerwise reload keeps it alive only until the layers viewing it are
  complete (molt.refit_receiver says what that reload retains).
- Timeouts: NCCL never times out. A watchdog (molt.weight_sync.Watchdog) on the trainer and in each
  worker aborts the communicator after refit.timeout_seconds; the step then raises RefitSendError
  (trainer) or RefitError (worker), and the trainer rebuilds the group from a fresh unique id, so
  refit.max_attempts works as with gloo.

NOTHING IN THIS MODULE HAS RUN ON A GPU: the machines Molt is tested on have no GPU and no CUDA
build of vLLM. The CPU tests (tests/test_weight_sync.py) cover the messages (checked against vLLM's
own init and update dataclasses), the ranks, the watchdog and the control flow with a stand-in
communicator; the NCCL calls themselves (unique id, communicator init, packed broadcast, abort,
and vLLM's worker side) are unverified.
"""

from __future__ import annotations

import base64
import logging
import threading

import torch

from molt.weight_sync import BucketEntry, EngineWeightSync, RefitSendError, Watchdog, WeightSender

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


class NcclSender(WeightSender):
    """The trainer half over NCCL (vLLM's PyNcclCommunicator and packed producer)."""

    backend = "nccl"

    def __init__(self, model: torch.nn.Module, **kwargs):
        super().__init__(model, **kwargs)
        self.communicator = None  # vLLM's PyNcclCommunicator, sender only
        self._unique_id: str | None = None
        self._world_size = 0
        self._watchdog: Watchdog | None = None

    def group_message(self, host: str, world_size: int) -> dict:
        self._unique_id, self._world_size = mint_unique_id(), world_size
        return {"backend": self.backend, "nccl_unique_id_b64": self._unique_id, "world_size": world_size,
                "packed_buffer_size_bytes": self.bucket_bytes, "packed_num_buffers": PACKED_NUM_BUFFERS,
                "timeout_seconds": self.timeout_seconds, "plan": self.wire_plan}

    def connect(self) -> None:
        """Join as rank 0 (with the warm-up all-reduce every peer runs). The unique-id rendezvous has
        no barrier and cannot be interrupted: past the timeout the init is left behind in its thread."""
        from vllm.distributed.weight_transfer.nccl_common import uid_init_process_group

        device = next(iter(self._params.values())).device
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
        refit.timeout_seconds, after which the remaining buckets are only gathered."""
        if not (send and self.is_sender):
            return super().broadcast(send=False)
        with Watchdog(self.timeout_seconds, self._abort, "refit broadcast (nccl)") as self._watchdog:
            return super().broadcast(send=True)

    def _abort(self) -> None:
        """The watchdog's action: abort the communicator (vLLM's destroy is ncclCommAbort), which ends
        the blocked broadcast; later broadcasts on it do nothing, and send_bucket raises."""
        self.communicator.destroy()

    def send_bucket(self, bucket: list[BucketEntry], tensors: list[torch.Tensor]) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        self._check_alive()
        pairs = ((entry.name, tensor.detach().to(getattr(torch, entry.dtype)).contiguous())
                 for entry, tensor in zip(bucket, tensors))
        try:
            packed_nccl_broadcast_producer(iterator=pairs, group=self.communicator, src=0,
                                           post_iter_func=lambda item: item[1],
                                           buffer_size_bytes=self.bucket_bytes, num_buffers=PACKED_NUM_BUFFERS)
        except RuntimeError as error:  # an NCCL error
            raise RefitSendError(str(error)) from error
        self._check_alive()

    def _check_alive(self) -> None:
        if self._watchdog is not None and self._watchdog.fired:
            raise RefitSendError(f"no progress within refit.timeout_seconds={self.timeout_seconds:g}; "
                                 f"the NCCL communicator was aborted")


class NcclEngineSync(EngineWeightSync):
    """The engine half over NCCL: vLLM's weight-transfer API on the AsyncLLM (the engine is started
    with `weight_transfer_config={'backend': 'nccl'}`), plus Molt's worker watchdog
    (molt.refit_receiver). Never run on a GPU."""

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
        self.update_infos = bucket_update_infos(group["plan"])
        self.timeout_seconds = group["timeout_seconds"]
        await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=worker_init_info(group)))
        self.joined = True

    async def prepare(self, llm, version: int) -> None:
        await llm.collective_rpc("molt_arm_watchdog", kwargs={"timeout_seconds": self.timeout_seconds,
                                                              "what": f"refit v{version} (nccl)"})
        await llm.start_weight_update()

    async def receive(self, llm, version: int) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self.mixed = True
        for update_info in self.update_infos:
            await llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        # Raises if the watchdog fired: an aborted broadcast returns as if it had received.
        await llm.collective_rpc("molt_disarm_watchdog")
        await llm.finish_weight_update()
        self.mixed = False

    async def recover(self, llm) -> bool:
        await llm.collective_rpc("molt_abandon_weight_update")
        return not self.mixed

    async def leave(self, llm) -> None:
        if self.joined:
            await llm.shutdown_weight_transfer_engine()
            self.joined = False
