"""A Hugging Face model laid out on the trainer mesh: built on the meta device, sharded (tensor
parallelism, then FSDP2 units) and filled rank by rank from its checkpoint, with the attention
kernel chosen for the device. The actor and its frozen reference are built here, the critic's
value model (molt.trainer.critic) with the same `shard_and_load`."""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from molt.distributed.expert_parallel import freeze_routers
from molt.distributed.parallelize import ShardingPlan, TrainerMesh, shard_model
from molt.models.hf_checkpoint import build_empty_model, load_sharded_weights
from molt.models.vision_language import text_backbone, vision_tower
from molt.trainer.scoring import install_scoring_head

logger = logging.getLogger("molt")


def build_actor_model(model_path: str, *, mesh: TrainerMesh, device: torch.device, plan: ShardingPlan,
                      logprob_chunk_tokens: int = 1024, freeze_router: bool = False) -> nn.Module:
    """A Hugging Face causal LM (or vision-language model: molt.models.vision_language) laid out on `mesh`
    (the trainer ranks only) and loaded without ever holding the whole model on one rank.

    The model is built on the meta device, its LM head becomes a `ScoringHead` (chunked log-probs),
    `shard_model` applies tensor parallelism (when the mesh has tp > 1) and the plan (activation
    checkpointing, mixed precision, offload, one FSDP unit per decoder block and the root), and
    then each rank reads only its own slices of the safetensors files (molt.models.hf_checkpoint).
    Parameter names stay the Hugging Face names (neither adds wrapper prefixes), which is what
    vLLM's weight loading expects at refit. `freeze_router` (train.freeze_router): an MoE model's
    routers get no gradient and no update (molt.distributed.expert_parallel.freeze_routers).
    """
    model = build_empty_model(model_path, dtype=plan.param_dtype)
    backbone, vision = text_backbone(model), vision_tower(model)
    if vision is not None and mesh.tp_size > 1:
        raise ValueError(f"layout.trainer_tensor_parallel_size={mesh.tp_size}: {type(model).__name__} is a "
                         f"vision-language model, which Molt's trainer does not tensor-parallelise; use 1")
    install_scoring_head(model, chunk_tokens=logprob_chunk_tokens)
    if freeze_router:
        freeze_routers(backbone)
    shard_and_load(model, backbone, model_path, mesh=mesh, device=device, plan=plan)
    if vision is not None:
        # The vision tower and connector stay in the root FSDP unit, gathered on every rank at every
        # forward: a rank whose micro-batch holds no image skips them, so a unit of their own would
        # miss its all-gather there. Such a rank's unused vision parameters then reduce zero gradients,
        # so every rank reduce-scatters the same parameters.
        model.set_reduce_scatter_unused_params(True)
    if model.config.tie_word_embeddings and model.get_output_embeddings() is not None:
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            raise RuntimeError("sharding untied the input and output embeddings of a tied model")
    return model


def shard_and_load(model: nn.Module, backbone: nn.Module, model_path: str, *, mesh: TrainerMesh,
                   device: torch.device, plan: ShardingPlan, not_in_checkpoint: str = "") -> None:
    """The steps every trainer model shares, on a model built on the meta device: pick the
    attention implementation, lay it out with `shard_model` (tensor parallelism over the backbone
    and heads, then one FSDP unit per block of `backbone.layers` and the root), and fill each
    rank's shards from `model_path`. Parameters the checkpoint lacks stop the start, except those
    named with the prefix `not_in_checkpoint` (the critic's value head)."""
    if device.type != mesh.device_type:
        raise ValueError(f"device {device} does not match the mesh's device type {mesh.device_type!r}")
    choose_attention(backbone, device, plan.forward_dtype)
    shard_model(model, backbone, mesh=mesh, plan=plan)
    report = load_sharded_weights(model, model_path, device=torch.device("cpu") if plan.cpu_offload else device)
    missing = [name for name in report.missing if not (not_in_checkpoint and name.startswith(not_in_checkpoint))]
    if missing:
        raise RuntimeError(f"{model_path} has no weights for {len(missing)} parameters of its own architecture, "
                           f"e.g. {missing[:3]}: is it a complete Hugging Face checkpoint?")


FLASH_ATTENTION_DTYPES = (torch.float16, torch.bfloat16)


def attention_implementation(device_type: str, compute_dtype: torch.dtype, flash_available: bool) -> str | None:
    """"flash_attention_2" on CUDA with flash-attn installed and a 16-bit compute dtype; else None,
    which keeps the model's own (Hugging Face's sdpa for the models Molt trains)."""
    # flash-attn's kernels take fp16 and bf16 only (flash_attn csrc/flash_attn/flash_api.cpp:
    # "FlashAttention only support fp16 and bf16 data type"); transformers 5.19 passes fp32 queries
    # through unchanged when the Linear weights are fp32 (transformers/integrations/flash_attention.py,
    # get_target_dtype) and only warns about the dtype (modeling_utils.py, _flash_attn_can_dispatch:
    # "Flash Attention 2 only supports torch.float16 and torch.bfloat16 dtypes"), so fp32 compute
    # would fail at the first forward.
    if device_type == "cuda" and flash_available and compute_dtype in FLASH_ATTENTION_DTYPES:
        return "flash_attention_2"
    return None


def choose_attention(model: nn.Module, device: torch.device, compute_dtype: torch.dtype) -> None:
    """Set `attention_implementation`'s choice on `model`. Flash attention takes a packed row's
    per-sequence position ids as variable-length sequences; elsewhere Hugging Face's sdpa builds a
    [rows, 1, L, L] block-diagonal causal mask from them, and each packed row is only as wide as the
    longest experience (molt.trainer.batch.LAYOUTS "rows"), so its cost is rows x L^2. On CUDA, a warning
    says when and why flash attention is off. Not yet run on a GPU."""
    flash_available = importlib.util.find_spec("flash_attn") is not None
    implementation = attention_implementation(device.type, compute_dtype, flash_available)
    if device.type == "cuda" and implementation is None:
        reason = ("flash-attn is not installed (pip install flash-attn)" if not flash_available else
                  f"the compute dtype is {compute_dtype}, and flash-attn takes float16 or bfloat16 only "
                  f"(set train.compute_dtype=bfloat16)")
        logger.warning("attention: %s; using %s, which masks each packed row with a dense [rows, 1, L, L] "
                       "block-diagonal mask and packs rows only as wide as the longest experience (cost rows x L^2)",
                       reason, model.config._attn_implementation)
        return
    if implementation is None:
        return
    try:
        model.set_attn_implementation(implementation)
    except (ImportError, ValueError) as error:  # e.g. a flash-attn build that does not match torch
        logger.warning("attention: %s unavailable (%s); using %s, packed rows as wide as the longest experience",
                       implementation, error, model.config._attn_implementation)
        return
    logger.info("attention: %s (packed rows as variable-length sequences)", implementation)
