"""The engine workers' side of weight sync. vLLM loads this class into each of its worker processes
(`worker_extension_cls`); Molt calls its methods through `collective_rpc`.

gloo: each worker joins the refit group as rank `first rank + its tensor-parallel rank`, receives
every bucket (full Hugging Face tensors; vLLM's weight loaders take this worker's slice) into one
buffer sized for the largest bucket, and feeds the weights to one `reload_weights` call as they
arrive.

What the receive holds in memory. vLLM's layerwise reload
(vllm/model_executor/model_loader/reload/layerwise.py) does not copy a weight when it is handed
one: it keeps a reference to the given tensor until every weight of that layer has arrived
(`info.loaded_weights`), then loads them all and processes the layer. A layer whose weights
straddle two buckets would read the next bucket's bytes out of the reused buffer, so before each
bucket is received the tensors vLLM still holds that view the buffer are cloned
(`_molt_detach_retained`). The bound per worker is therefore the largest bucket, plus the weights
received so far of the layers still incomplete at a bucket boundary (at most one layer when the
plan follows the module order, as the trainer's does), plus the weights of layers vLLM processes
only at the end (attention layers with checkpoint scales, layers whose weights carry padding),
plus vLLM's own transient copy of the layer it is processing. The real model's numbers are in
`molt_receive_stats`.

nccl: vLLM's NCCLWeightTransferEngine does the receiving (molt.refit.nccl); this class adds
one call per bucket that arms the watchdog at the first bucket and refuses any bucket after it fired
(it aborts the worker's communicator when no data comes), the lm_head re-tie after each update, and
the clean-up after a failed or cancelled update. That part has never run on a GPU.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from molt.refit.gloo import arrival_key, join_refit_rendezvous, make_refit_group
from molt.refit.weight_sync import RefitError, Watchdog, bucket_num_bytes

logger = logging.getLogger("molt")


class RefitReceiver:
    """Mixed into vLLM's worker class (through molt.rollout.worker_extension); `self.model_runner` is
    the worker's."""

    # -- gloo ----------------------------------------------------------------------------------

    def molt_join_refit_group(self, *, host: str, port: int, rank: int, world_size: int,
                              timeout_seconds: float, plan: list[list[list]]) -> None:
        """Join the refit group; `rank` is the engine's first refit rank, to which each worker adds
        its tensor-parallel rank."""
        self.molt_quiet_expected_reload_warnings()
        own_rank = rank + self.molt_tensor_parallel_rank()
        rendezvous = join_refit_rendezvous(host, port, world_size, timeout_seconds)
        rendezvous.set(arrival_key(own_rank), "1")
        self._molt_group = make_refit_group(rendezvous, own_rank, world_size, timeout_seconds)
        self._molt_plan = plan  # buckets of [name, dtype, shape]
        # One receive buffer, the largest bucket's size, allocated once and reused by every bucket of
        # every refit (fresh multi-MB buffers would run at first-touch memory speed).
        self._molt_buffer = torch.empty(max(bucket_num_bytes(bucket) for bucket in plan), dtype=torch.uint8)
        self._molt_detached_bytes = self._molt_held_bytes = 0

    def molt_quiet_expected_reload_warnings(self) -> None:
        """Every in-place reload (gloo's, and vLLM's NCCL update) warns 'Failed to load weights' for a
        tied lm_head, which the checkpoint never holds (it is re-tied after each load), and for the
        rotary cache: expected on every refit, so vLLM's layerwise reload logs errors only."""
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)

    def molt_tensor_parallel_rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def molt_prepare_refit(self, version: int) -> None:
        """Called with generation paused, before the engine acknowledges the pause."""
        if getattr(self, "_molt_group", None) is None:
            raise RefitError(f"refit v{version}: this worker is in no refit group (it left, or never joined)")

    def molt_receive_weights(self, version: int) -> None:
        """Receive the buckets of refit `version` and load them in place as they arrive."""
        self.molt_load_weights(self.molt_stream_weights())

    def molt_stream_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) per weight, bucket by bucket; each tensor views the receive buffer, so it is
        valid until the next bucket arrives (what vLLM still holds then is cloned first)."""
        self._molt_detached_bytes = self._molt_held_bytes = 0
        for bucket in self._molt_plan:
            cloned, held = self._molt_detach_retained()
            self._molt_detached_bytes += cloned
            self._molt_held_bytes = max(self._molt_held_bytes, held)
            dtype = getattr(torch, bucket[0][1])
            flat = self._molt_buffer[:bucket_num_bytes(bucket)].view(dtype)
            options = dist.BroadcastOptions()
            options.rootRank = 0
            self._molt_group.broadcast([flat], options).wait()
            numels = [math.prod(shape) for _, _, shape in bucket]
            for (name, _, shape), chunk in zip(bucket, flat.split(numels)):
                self._molt_intact = False  # from here on a failure may leave old and new weights mixed
                yield name, chunk.view(shape)

    def _molt_detach_retained(self) -> tuple[int, int]:
        """Clone each tensor vLLM's layerwise reload still holds (a layer not yet complete) that views
        the receive buffer, before the buffer is overwritten. Returns the bytes cloned, and the bytes
        vLLM holds outside the buffer from then until those layers are complete."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        storage = self._molt_buffer.untyped_storage().data_ptr()
        cloned = held = 0
        for info in list(LAYERWISE_INFO.values()):
            for _, bound in info.loaded_weights:
                for key, value in bound.arguments.items():
                    if not isinstance(value, torch.Tensor) or value.is_meta:
                        continue
                    if value.untyped_storage().data_ptr() == storage:
                        bound.arguments[key] = value = value.clone()
                        cloned += value.nbytes
                    held += value.nbytes
        return cloned, held

    def molt_load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One in-place reload of the whole model, fed lazily: vLLM's loaders take each weight as the
        iterator yields it. (On CPU `model.load_weights` alone fails: the CPU kernels repack weights,
        which the reload undoes and redoes.) A failure part-way leaves the layers loaded so far with
        new weights and the rest with old ones (`molt_weights_intact` says so)."""
        try:
            self.model_runner.reload_weights(weights_iterator=iter(weights))
        except BaseException:
            self._molt_end_abandoned_reload()
            self._molt_retie_embeddings()
            raise
        self._molt_retie_embeddings()
        self._molt_prepack_cpu_experts()
        self._molt_intact = True  # all new

    def molt_weights_intact(self) -> bool:
        """False while the model may hold a mix of old and new weights: after a receive failed part-way,
        until a later one succeeds."""
        return getattr(self, "_molt_intact", True)

    def molt_receive_stats(self) -> dict[str, int]:
        """Receive memory of the last refit: the reused buffer; the bytes cloned out of it, in all; and
        the most that vLLM held outside it at once (weights of layers straddling a bucket boundary)."""
        return {"buffer_bytes": self._molt_buffer.nbytes, "detached_bytes": self._molt_detached_bytes,
                "held_bytes_max": self._molt_held_bytes}

    def _molt_retie_embeddings(self) -> None:
        """With tied embeddings the checkpoint has no lm_head weight, so vLLM's in-place reload
        puts the *old* lm_head tensor back (breaking the tie) and keeps the old packed copy the
        CPU GEMM uses; point it at the new embeddings and re-run its kernel preparation."""
        model = self.model_runner.get_model()
        config = self.model_runner.model_config.hf_config.get_text_config()
        lm_head = getattr(model, "lm_head", None)
        if not getattr(config, "tie_word_embeddings", False) or lm_head is None:
            return
        embeddings = model.model.embed_tokens
        lm_head.weight = embeddings.weight
        lm_head.quant_method.process_weights_after_loading(lm_head)

    def _molt_prepack_cpu_experts(self) -> None:
        """vLLM 0.32's in-place reload of an unquantized MoE layer skips the experts' own post-load
        step on a weight update (UnquantizedFusedMoEMethod._setup_kernel runs it on the first load
        only), and on CPU that step is the prepack into the blocked layout the CPU MoE kernel reads:
        the new expert weights would stay in checkpoint layout. Run it for each CPU MoE layer. Should
        vLLM start doing it itself, the MoE refit check (tests/test_moe_e2e.py) fails."""
        for module in self.model_runner.get_model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            weight = getattr(module, "w13_weight", None)
            if kernel is not None and isinstance(weight, torch.Tensor) and weight.device.type == "cpu":
                kernel.fused_experts.process_weights_after_loading(module)

    def molt_leave_refit_group(self) -> None:
        self._molt_group = None
        self._molt_plan = None
        self._molt_buffer = None

    # -- nccl (never run on a GPU) -------------------------------------------------------------

    def molt_update_weights(self, *, update_info: dict, first: bool, timeout_seconds: float, what: str) -> None:
        """Receive and load one bucket of an NCCL refit (vLLM's Worker.update_weights). The first bucket
        arms the watchdog (not `prepare`: the wait for every engine's pause is not this worker's to
        time). Once the watchdog fired no update runs: the aborted communicator would return at once
        and vLLM would load whatever its receive buffer held."""
        if first:
            self.molt_arm_watchdog(timeout_seconds=timeout_seconds, what=what)
        watchdog = getattr(self, "_molt_watchdog", None)
        if watchdog is None or watchdog.fired:
            raise RefitError(f"{what}: no update after the watchdog fired (or before it was armed); "
                             f"the worker's NCCL communicator was aborted")
        self.update_weights(update_info)

    def molt_retie_embeddings(self) -> None:
        """After an NCCL update: re-tie the lm_head to the new embeddings (see `_molt_retie_embeddings`)."""
        self._molt_retie_embeddings()

    def molt_arm_watchdog(self, *, timeout_seconds: float, what: str) -> None:
        """At an NCCL weight update's first bucket: abort this worker's communicator (vLLM's weight-transfer
        engine's) if the update is still running after `timeout_seconds`; the blocked broadcast then
        returns, and `molt_disarm_watchdog` raises."""
        communicator = self.weight_transfer_engine.model_update_group
        if communicator is None:
            raise RefitError(f"{what}: this worker has no NCCL refit communicator (it never joined)")
        self._molt_watchdog = Watchdog(timeout_seconds, communicator.destroy, what).__enter__()

    def molt_disarm_watchdog(self) -> None:
        watchdog, self._molt_watchdog = getattr(self, "_molt_watchdog", None), None
        if watchdog is None:
            return
        watchdog.disarm()
        if watchdog.fired:
            raise RefitError(f"{watchdog.what}: no weights within refit.timeout_seconds="
                             f"{watchdog.timeout_seconds:g}; the worker's NCCL communicator was aborted")

    def molt_abandon_weight_update(self) -> None:
        """After a failed NCCL update: stop the watchdog, end vLLM's update session and its layerwise
        reload (which otherwise leaves every layer on the meta device), so the next group can join."""
        watchdog, self._molt_watchdog = getattr(self, "_molt_watchdog", None), None
        if watchdog is not None:
            watchdog.disarm()
        self._molt_end_abandoned_reload()
        if getattr(self, "_weight_update_active", False):  # vLLM's Worker: an update session is open
            self.weight_transfer_engine.reset_weight_update_target()
            self._weight_update_active = False

    # -- both ----------------------------------------------------------------------------------

    def _molt_end_abandoned_reload(self) -> None:
        """Finish a layerwise reload that stopped part-way, keeping the old weights of every layer not
        complete (vLLM would otherwise process a half-loaded layer, with uninitialised memory for its
        missing weights); complete layers keep their new ones."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, finalize_layerwise_reload

        model = self.model_runner.get_model()
        infos = [LAYERWISE_INFO[layer] for layer in model.modules() if layer in LAYERWISE_INFO]
        if not any(info.can_load() for info in infos):
            return
        for info in infos:
            if info.can_load() and info.load_numel:
                info.loaded_weights, info.load_numel = [], 0
        finalize_layerwise_reload(model, self.model_runner.model_config)
        logger.warning("a weight load stopped part-way; layers not complete keep their old weights")
