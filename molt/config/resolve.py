"""The rollout settings whose 0 or None means auto, resolved once the machine is known: how long the
engines may take to start (scaled by the checkpoint's size and the engines that read it at once) and
whether they skip CUDA graphs. (rollout.engine_memory resolves the engine's memory budget.)"""

from __future__ import annotations

import os

from molt.config.schema import LayoutConfig, MoltConfig

# Engine start limit when rollout.engine_start_timeout_seconds is 0 (auto): a fixed part for the
# process, compilation and CUDA graph capture, plus a read time per GiB of checkpoint for each engine
# reading it at once from one node's storage (~0.8 GiB/s a node: 8 engines x 57 GiB of Qwen3-30B-A3B
# take ~570 s).
ENGINE_START_BASE_SECONDS = 300.0
ENGINE_START_SECONDS_PER_GIGABYTE = 1.25


def engine_start_seconds(checkpoint_bytes: int, engines_per_node: int = 1) -> float:
    """The engine-start limit for a checkpoint of `checkpoint_bytes`: the `engines_per_node` engines of a
    node read the whole checkpoint at once from its storage, then compile and capture CUDA graphs
    (ENGINE_START_BASE_SECONDS)."""
    return (ENGINE_START_BASE_SECONDS
            + ENGINE_START_SECONDS_PER_GIGABYTE * engines_per_node * checkpoint_bytes / 2**30)


def count_engines_per_node(layout: LayoutConfig) -> int:
    """The most engines one node hosts (molt.distributed.placement.place_ranks: colocated, all on the one node)."""
    if layout.colocate:
        return layout.num_rollout_ranks
    return max(1, min(layout.num_rollout_ranks, layout.gpus_per_node // max(1, layout.engine_tensor_parallel_size)))


def checkpoint_bytes(model_path: str) -> int:
    """Bytes of the weight files (*.safetensors, *.bin) of a Hugging Face directory; 0 where there are none."""
    if not model_path or not os.path.isdir(model_path):
        return 0
    return sum(entry.stat().st_size for entry in os.scandir(model_path)
               if entry.is_file() and entry.name.endswith((".safetensors", ".bin")))


def engine_start_limit_seconds(cfg: MoltConfig, num_bytes: int | None = None) -> float:
    """The longest wait for the engines: rollout.engine_start_timeout_seconds, or when it is 0 (auto)
    engine_start_seconds of model.path's weight files (or of `num_bytes`, given when they are absent)."""
    if cfg.rollout.engine_start_timeout_seconds > 0:
        return cfg.rollout.engine_start_timeout_seconds
    return engine_start_seconds(checkpoint_bytes(cfg.model.path) if num_bytes is None else num_bytes,
                                count_engines_per_node(cfg.layout))


def resolve_enforce_eager(enforce_eager: bool | None, *, on_gpu: bool) -> bool:
    """rollout.enforce_eager, None = auto: CUDA graphs on GPUs (faster decode), eager on CPU, where
    vLLM's CPU backend would compile the model (slow starts, and no route capture: molt.rollout.route_capture)."""
    return not on_gpu if enforce_eager is None else enforce_eager
