"""How a model is laid out on the trainer ranks: precision, activation checkpointing, CPU offload and
FSDP2 sharding, applied in torchtitan's order (each decoder block is checkpointed, then sharded as
its own FSDP unit; the root unit holds the embeddings, final norm and head).

The actor, the critic, the frozen reference and `--dry-run` all go through `shard_model`, so what the
dry run measures is what the trainer builds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from molt.config import MoltConfig, parse_activation_checkpointing


@dataclass(frozen=True, kw_only=True)
class ShardingPlan:
    """What `shard_model` does to a model (train.param_dtype, compute_dtype, activation_checkpointing,
    cpu_offload)."""

    param_dtype: torch.dtype = torch.float32  # stored (master) weights, gradients, AdamW state
    compute_dtype: torch.dtype | None = None  # forward/backward; None = param_dtype
    checkpoint_every: int = 0  # checkpoint blocks 0, k, 2k, ...; 0 = none, 1 = every block
    cpu_offload: bool = False  # GPU only: shards, gradients and optimizer state in host memory

    @classmethod
    def from_config(cls, cfg: MoltConfig) -> ShardingPlan:
        train = cfg.train
        return cls(param_dtype=getattr(torch, train.param_dtype),
                   compute_dtype=getattr(torch, train.compute_dtype or cfg.model.dtype),
                   checkpoint_every=parse_activation_checkpointing(train.activation_checkpointing),
                   cpu_offload=train.cpu_offload)

    @property
    def forward_dtype(self) -> torch.dtype:
        return self.compute_dtype or self.param_dtype

    def frozen(self) -> ShardingPlan:
        """The plan of a model that is never updated (the KL reference): stored in the compute dtype,
        which gives the same forward as master weights cast at every forward, at its memory cost; no
        activation checkpointing (it never runs backward)."""
        return ShardingPlan(param_dtype=self.forward_dtype, cpu_offload=self.cpu_offload)

    def mixed_precision(self) -> MixedPrecisionPolicy:
        """FSDP2 casts the gathered parameters to the compute dtype; gradients below 32 bits are
        reduced in float32, so the data-parallel sum of bf16 gradients does not round each addend."""
        compute = self.forward_dtype
        return MixedPrecisionPolicy(param_dtype=compute if compute != self.param_dtype else None,
                                    reduce_dtype=torch.float32 if compute.itemsize < 4 else None)

    def offload(self) -> OffloadPolicy:
        return CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()


def shard_model(model: nn.Module, blocks: nn.ModuleList, *, mesh: DeviceMesh, plan: ShardingPlan) -> None:
    """Apply activation checkpointing and FSDP2 in place: one unit per block of `blocks` (the decoder
    layers), then the root unit. Parameter names are unchanged (composable checkpointing and FSDP2
    add no wrapper prefixes), which is what refit and checkpoints rely on."""
    options = dict(mesh=mesh, mp_policy=plan.mixed_precision(), offload_policy=plan.offload())
    for index, block in enumerate(blocks):
        if plan.checkpoint_every and index % plan.checkpoint_every == 0:
            checkpoint(block)  # non-reentrant: only the block's input is kept for backward
        fully_shard(block, **options)
    fully_shard(model, **options)


def shard_causal_lm(model: nn.Module, *, mesh: DeviceMesh, plan: ShardingPlan | None = None) -> None:
    """`shard_model` over a Hugging Face causal LM's decoder layers (`model.model.layers`)."""
    shard_model(model, model.model.layers, mesh=mesh, plan=plan or ShardingPlan())


def count_checkpointed_blocks(num_blocks: int, checkpoint_every: int) -> int:
    return len(range(0, num_blocks, checkpoint_every)) if checkpoint_every else 0
