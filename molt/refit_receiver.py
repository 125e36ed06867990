"""The engine side of refit. vLLM loads this class into each of its worker processes
(`worker_extension_cls`); Molt calls its methods through `collective_rpc`.

The worker joins a refit process group (rank 0 = the trainer's sending rank), receives each
bucket as one flat tensor and loads the weights in place with vLLM's `reload_weights`.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger("molt")


class RefitReceiver:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's."""

    def molt_join_refit_group(self, *, host: str, port: int, rank: int, world_size: int,
                              timeout_seconds: float, plan: list[list[list]]) -> None:
        from molt.refit import make_refit_group

        # Every in-place reload warns that the rotary cache and a tied lm_head got no checkpoint
        # tensor; both are expected here (the lm_head is re-tied below).
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self._molt_group = make_refit_group(host, port, rank, world_size, timeout_seconds, is_server=False)
        self._molt_plan = plan  # buckets of [name, dtype, shape]
        # Receive buffers allocated once: reused every refit (vLLM copies out of them on reload).
        self._molt_buffers = [torch.empty(sum(_numel(shape) for _, _, shape in bucket), dtype=getattr(torch, bucket[0][1]))
                              for bucket in plan]

    def molt_receive_weights(self, version: int) -> None:
        """Receive the buckets of refit `version` and load them in place."""
        weights = self.molt_receive_buckets()
        self.molt_load_weights(weights)

    def molt_receive_buckets(self) -> list[tuple[str, torch.Tensor]]:
        weights: list[tuple[str, torch.Tensor]] = []
        for bucket, flat in zip(self._molt_plan, self._molt_buffers):
            numels = [_numel(shape) for _, _, shape in bucket]
            options = dist.BroadcastOptions()
            options.rootRank = 0
            self._molt_group.broadcast([flat], options).wait()
            for (name, _, shape), chunk in zip(bucket, flat.split(numels)):
                weights.append((name, chunk.view(shape)))
        return weights

    def molt_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        # One reload for the whole model: vLLM re-packs CPU weights after loading, per call.
        self.model_runner.reload_weights(weights_iterator=iter(weights))
        self._molt_retie_embeddings()

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

    def molt_leave_refit_group(self) -> None:
        self._molt_group = None
        self._molt_plan = None
        self._molt_buffers = None


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count

