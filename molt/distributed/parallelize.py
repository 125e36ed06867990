"""How a model is laid out on the trainer ranks: the trainer mesh (dp_replicate x dp_shard x tp),
tensor parallelism, precision, activation checkpointing, CPU offload and FSDP2 sharding, applied in
torchtitan's order: tensor parallelism first, then each decoder block is checkpointed and sharded
as its own FSDP unit over the data-parallel ranks; the root unit holds the embeddings, final norm
and heads.

The actor, the critic, the frozen reference and `--dry-run` all go through `shard_model`, so what the
dry run measures is what the trainer builds.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
import torch._C._distributed_c10d as c10d
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from molt.config import MoltConfig, parse_activation_checkpointing
from molt.distributed.expert_parallel import ExpertParallelExperts, apply_expert_parallel
from molt.models.moe import count_experts

TRAINER_MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True, kw_only=True)
class TrainerMesh:
    """The trainer ranks as a device mesh, and the pieces of it each consumer needs.

    Trainer rank r has tensor-parallel coordinate r % tp_size and data-parallel index r // tp_size
    (dp_replicate major): the tp ranks of one data-parallel index train on the same micro-batches.
    """

    mesh: DeviceMesh  # ("dp_replicate", "dp_shard", "tp"), without dp_replicate or tp when of size 1
    fsdp_mesh: DeviceMesh  # FSDP2's: 1-D dp_shard, or 2-D (dp_replicate, dp_shard) for HSDP
    tp_mesh: DeviceMesh | None  # the tensor-parallel ranks of this rank; None when tp_size == 1
    dp_group: dist.ProcessGroup  # ranks that train on different data (same tp coordinate): data sums
    dp_rank: int  # this rank's data-parallel index, 0 .. dp_size - 1
    dp_size: int  # dp_replicate x dp_shard
    tp_rank: int
    tp_size: int
    # Expert parallelism: dp_shard = dp_shard_mod_ep x ep, ep the inner (consecutive) ranks.
    ep_mesh: DeviceMesh | None = None  # the ranks that split each MoE layer's experts; None when ep_size == 1
    expert_fsdp_mesh: DeviceMesh | None = None  # FSDP2's for the experts: dp_shard_mod_ep (with dp_replicate)
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def device_type(self) -> str:
        return self.mesh.device_type

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        return None if self.ep_mesh is None else self.ep_mesh.get_group()

    @classmethod
    def from_group(cls, group: dist.ProcessGroup, device_type: str) -> TrainerMesh:
        """Plain FSDP2 over an existing group (tp 1, no replicas): tests and tools. Only the group's
        members call it, and it creates no process group."""
        mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("dp_shard",))
        return cls(mesh=mesh, fsdp_mesh=mesh, tp_mesh=None, dp_group=group, dp_rank=dist.get_rank(group),
                   dp_size=dist.get_world_size(group), tp_rank=0, tp_size=1)


def build_trainer_mesh(*, num_trainer_ranks: int, device_type: str, data_parallel_replicate: int = 1,
                       tensor_parallel_size: int = 1, expert_parallel_size: int = 1,
                       timeout_seconds: float | None = None) -> TrainerMesh | None:
    """The ("dp_replicate", "dp_shard", "tp") mesh over world ranks 0 .. num_trainer_ranks - 1
    (layout.trainer_data_parallel_replicate, layout.trainer_tensor_parallel_size); dp_shard takes
    the ranks left over. With layout.trainer_expert_parallel_size > 1, dp_shard is also split as
    (dp_shard_mod_ep, ep) for the experts (`build_expert_meshes`).

    Collective over the WORLD: creating the mesh's process groups calls `dist.new_group`, which
    every world rank must call in the same order, so rollout ranks call this too (right after the
    trainer group is made) and get None back. A trainer rank on CUDA sets its device first
    (`torch.cuda.set_device`), or DeviceMesh picks LOCAL_RANK's.

    `timeout_seconds`: the collective timeout of every group the mesh makes (FSDP2's gathers and
    reductions run on them while rank 0 may wait on engines: molt.distributed.timeouts.trainer_group_timeout);
    None keeps torch's default.
    """
    replicate, tp = data_parallel_replicate, tensor_parallel_size
    if replicate < 1 or tp < 1 or num_trainer_ranks % (replicate * tp):
        raise ValueError(f"{num_trainer_ranks} trainer ranks do not split into trainer_data_parallel_replicate="
                         f"{replicate} x trainer_tensor_parallel_size={tp} x a whole number of shards")
    shard = num_trainer_ranks // (replicate * tp)
    ranks = torch.arange(num_trainer_ranks).view(replicate, shard, tp)
    # Dims of size 1 other than dp_shard are left out: each costs a process group per trainer rank.
    sizes = dict(zip(TRAINER_MESH_DIMS, ranks.shape))
    names = tuple(name for name, size in sizes.items() if size > 1 or name == "dp_shard")
    rank = dist.get_rank()
    # A rollout rank builds the same groups as a "cpu" mesh: a CUDA mesh would select a CUDA device
    # in that process (LOCAL_RANK's, perhaps not among its engine's visible GPUs).
    timeout = None if timeout_seconds is None else datetime.timedelta(seconds=timeout_seconds)
    mesh = DeviceMesh(device_type if rank < num_trainer_ranks else "cpu", ranks.view(*(sizes[name] for name in names)),
                      mesh_dim_names=names, backend_override=mesh_backend_override(names, device_type, timeout))
    # Ranks with one tp coordinate train on different data. With one replica that is the dp_shard
    # dimension's own group; with several, a new group per tp coordinate (every world rank calls).
    dp_groups = ([] if replicate == 1 else
                 [dist.new_group(ranks[..., c].flatten().tolist(), timeout=timeout) for c in range(tp)])
    ep_mesh, expert_fsdp_mesh = build_expert_meshes(mesh, expert_parallel_size, shard=shard, tp_size=tp,
                                                    device_type=device_type, timeout=timeout,
                                                    is_trainer=rank < num_trainer_ranks)
    if rank >= num_trainer_ranks:
        return None
    fsdp_mesh = mesh["dp_shard"] if replicate == 1 else mesh["dp_replicate", "dp_shard"]
    return TrainerMesh(mesh=mesh, fsdp_mesh=fsdp_mesh, tp_mesh=mesh["tp"] if tp > 1 else None,
                       dp_group=fsdp_mesh.get_group() if replicate == 1 else dp_groups[rank % tp],
                       dp_rank=rank // tp, dp_size=replicate * shard, tp_rank=rank % tp, tp_size=tp,
                       ep_mesh=ep_mesh, expert_fsdp_mesh=expert_fsdp_mesh, ep_size=expert_parallel_size,
                       ep_rank=ep_mesh.get_local_rank() if ep_mesh is not None else 0)


def group_options_class(device_type: str) -> str:
    """The name, in torch._C._distributed_c10d, of the options class the trainer mesh's groups get:
    the NCCL backend's own on CUDA, the generic one elsewhere (gloo reads only the timeout)."""
    # torch/distributed/distributed_c10d.py, _new_process_group_helper: for an NCCL backend,
    # `if not isinstance(backend_options, ProcessGroupNCCL.Options): raise AssertionError(...)`;
    # a CUDA trainer's groups are "cpu:gloo,cuda:nccl" (molt.train), and each backend gets the same
    # options object, so they must be the NCCL class. The gloo branch ignores backend_options.
    return "ProcessGroupNCCL.Options" if device_type == "cuda" else "Backend.Options"


def group_options(device_type: str, timeout: datetime.timedelta) -> c10d.Backend.Options:
    """The options of a trainer-mesh group with collective timeout `timeout` (`group_options_class`).
    DeviceMesh passes `options._timeout` on as new_group's timeout (device_mesh.py,
    _init_one_process_group), so the two agree, as _new_process_group_helper wants."""
    if group_options_class(device_type) == "Backend.Options":
        options = c10d.Backend.Options("gloo")
    elif hasattr(c10d, "ProcessGroupNCCL"):
        options = c10d.ProcessGroupNCCL.Options(is_high_priority_stream=False)  # as NCCL's default groups
    else:
        raise RuntimeError(f"device_type={device_type!r} needs NCCL, and this torch {torch.__version__} is built "
                           f"without it (a CPU build?): install a CUDA build of torch, or run with device=cpu")
    options._timeout = timeout
    return options


def mesh_backend_override(names: tuple[str, ...], device_type: str,
                          timeout: datetime.timedelta | None) -> tuple[tuple[None, c10d.Backend.Options | None], ...]:
    """DeviceMesh's backend_override for dims `names`: the default backend, with `timeout` when given.
    One options object per dim: _new_process_group_helper writes the group's name and ranks into the
    object it is given, and an NCCL group keeps a reference to it."""
    return tuple((None, None if timeout is None else group_options(device_type, timeout)) for _ in names)


def build_expert_meshes(mesh: DeviceMesh, ep: int, *, shard: int, tp_size: int, device_type: str,
                        timeout: datetime.timedelta | None,
                        is_trainer: bool) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """(ep mesh, the experts' FSDP2 mesh) when ep > 1, else Nones: `mesh`'s dp_shard dim (of `shard`
    ranks) unflattened into (dp_shard_mod_ep, ep), ep inner so an ep group is consecutive ranks (one
    node, when it fits). Both come from `mesh`'s root, as FSDP2 needs to compose them. Collective
    over the WORLD like `build_trainer_mesh` (it makes the two dims' process groups); a rollout rank
    (not `is_trainer`) makes the groups and gets Nones, as it cannot slice a mesh it is not in."""
    if ep == 1:
        return None, None
    if ep < 1 or shard % ep or tp_size > 1:
        raise ValueError(f"layout.trainer_expert_parallel_size={ep} must divide the dp_shard size {shard} and needs "
                         f"trainer_tensor_parallel_size=1 (got {tp_size}); use a divisor of {shard}")
    names = ("dp_shard_mod_ep", "ep")
    split = mesh._unflatten("dp_shard", (shard // ep, ep), names,
                            backend_override=dict(zip(names, mesh_backend_override(names, device_type, timeout))))
    if not is_trainer:
        return None, None
    replicated = "dp_replicate" in split.mesh_dim_names
    return split["ep"], split["dp_replicate", "dp_shard_mod_ep"] if replicated else split["dp_shard_mod_ep"]


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


def shard_model(model: nn.Module, backbone: nn.Module, *, mesh: TrainerMesh, plan: ShardingPlan) -> None:
    """Lay `model` out in place: tensor parallelism over `mesh.tp_mesh` (when tp > 1, see
    `apply_tensor_parallel`), then activation checkpointing and one FSDP2 unit per decoder block
    of `backbone.layers`, then the root unit, over `mesh.fsdp_mesh` (HSDP when it is 2-D).
    Parameter names are unchanged (tensor parallelism, composable checkpointing and FSDP2 add no
    wrapper prefixes), which is what refit and checkpoints rely on.

    With expert parallelism (mesh.ep_size > 1) each MoE layer's experts are split over the ep
    ranks first (molt.distributed.expert_parallel), and each block's experts module becomes its own FSDP2
    unit over `mesh.expert_fsdp_mesh` (the ranks holding the same experts), inside the block's."""
    if mesh.tp_size > 1:
        apply_tensor_parallel(model, backbone, mesh.tp_mesh)
    if mesh.ep_size > 1:
        apply_expert_parallel(backbone, mesh.ep_mesh)
    options = dict(mesh=mesh.fsdp_mesh, mp_policy=plan.mixed_precision(), offload_policy=plan.offload())
    for index, block in enumerate(backbone.layers):
        if plan.checkpoint_every and index % plan.checkpoint_every == 0:
            checkpoint(block)  # non-reentrant: only the block's input is kept for backward
        experts = getattr(getattr(block, "mlp", None), "experts", None)
        if isinstance(experts, ExpertParallelExperts):
            fully_shard(experts, **{**options, "mesh": mesh.expert_fsdp_mesh})
            # FSDP2's default mean divides by its own mesh's size; the experts' gradients come from
            # every data-parallel rank's tokens, so they divide like the rest (a sum in training).
            experts.set_gradient_divide_factor(float(mesh.dp_size))
        fully_shard(block, **options)
    fully_shard(model, **options)


def shard_causal_lm(model: nn.Module, *, mesh: TrainerMesh, plan: ShardingPlan | None = None) -> None:
    """`shard_model` over a Hugging Face causal LM (its backbone is `model.model`)."""
    shard_model(model, model.model, mesh=mesh, plan=plan or ShardingPlan())


def count_checkpointed_blocks(num_blocks: int, checkpoint_every: int) -> int:
    return len(range(0, num_blocks, checkpoint_every)) if checkpoint_every else 0


def block_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    """Megatron-style tensor parallelism of a Llama / Qwen2 / Qwen3 decoder block with sequence
    parallelism on its norms (torchtitan's Llama plan): the residual stream enters and leaves the
    block sharded on the sequence (a DTensor, so its `.shape` stays global); attention and the MLP
    gather it, run column-wise q/k/v/gate/up and row-wise o/down projections on the local heads
    and columns, and reduce-scatter back onto the sequence."""
    plan = {
        "input_layernorm": SequenceParallel(),
        # Hugging Face's decoder layers pass the attention's input by keyword, the MLP's by position.
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                        use_local_output=True),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                  use_local_output=True),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    if hasattr(block.self_attn, "q_norm"):
        # Qwen3 normalises each head ([batch, seq, local heads, head_dim]): sharded on the heads,
        # so the norm weight's gradient is summed over the tensor-parallel ranks.
        plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def apply_tensor_parallel(model: nn.Module, backbone: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Tensor parallelism over `tp_mesh`, on the meta model, before FSDP2.

    The embedding is vocab-sharded (row-wise) and hands the residual stream over sharded on the
    sequence; each block follows `block_plan`; the final norm runs sequence-parallel and gathers
    its output, so every head computes on the whole, replicated hidden states. The LM head's
    weight is vocab-sharded like the embedding (tied models keep one parameter) and gathered whole
    at use (molt.trainer.scoring.ScoringHead): not a vocab-parallel loss, so each tensor-parallel rank
    computes the same log-probs, at the memory of one whole head weight. Any other parameter
    outside the backbone (the critic's value head) is replicated (`replicate_module`). So every
    parameter is a DTensor on the tp mesh, and after FSDP2 on one (dp..., tp) mesh, which the
    global gradient norm needs.
    """
    check_tensor_parallel_support(backbone, tp_mesh.size())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and head.weight is backbone.embed_tokens.weight
    parallelize_module(backbone, tp_mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "norm": SequenceParallel(),
    })
    # Then gather the final norm's output: its hooks run after SequenceParallel's.
    parallelize_module(backbone.norm, tp_mesh, PrepareModuleOutput(output_layouts=Shard(1),
                                                                   desired_output_layouts=Replicate()))
    for block in backbone.layers:
        parallelize_module(block, tp_mesh, block_plan(block))
    if isinstance(head, nn.Linear):  # a plain head returns whole logits
        parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    elif head is not None and not tied:  # molt.trainer.scoring.ScoringHead gathers its weight itself
        # src_data_rank=None: each rank keeps its own rows of its (meta) copy, no communication.
        head.weight = nn.Parameter(distribute_tensor(head.weight, tp_mesh, [Shard(0)], src_data_rank=None))
    if tied:
        head.weight = backbone.embed_tokens.weight
    backbone_modules = set(backbone.modules())
    for name, module in model.named_modules():
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            if module in backbone_modules:
                raise ValueError(f"layout.trainer_tensor_parallel_size={tp_mesh.size()}: {name} "
                                 f"({type(module).__name__}) of {type(backbone).__name__} has no tensor-parallel "
                                 f"plan; Molt's plan covers Llama, Qwen2 and Qwen3 decoder blocks. Use 1.")
            replicate_module(module, tp_mesh)


def replicate_module(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """For a module whose input and output are the same plain tensor on every tensor-parallel rank
    (the critic's value head): its parameters become Replicate DTensors, so they join the mesh of
    every other parameter, and it computes on whole tensors. Gradients come out the same on every
    rank, as a replicated parameter's must."""

    def replicate_parameters(name: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(submodule.named_parameters(recurse=False)):
            submodule.register_parameter(param_name, nn.Parameter(
                DTensor.from_local(param, mesh, [Replicate()], run_check=False), requires_grad=param.requires_grad))

    distribute_module(
        module, tp_mesh, replicate_parameters,
        input_fn=lambda _, inputs, mesh: tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                                               for x in inputs),
        output_fn=lambda _, output, mesh: output.to_local())


def check_tensor_parallel_support(backbone: nn.Module, tp_size: int) -> None:
    """Refuse, naming the field, a model the tensor-parallel plan cannot split evenly or at all."""
    config = backbone.config
    field = f"layout.trainer_tensor_parallel_size={tp_size}"
    if count_experts(config):
        raise ValueError(f"{field}: {type(backbone).__name__} is a mixture-of-experts model, and Molt does not "
                         f"tensor-parallelise experts; use trainer_tensor_parallel_size=1 (FSDP2 shards experts)")
    sizes = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
             "intermediate_size": getattr(config, "intermediate_size", 0)}
    uneven = {name: size for name, size in sizes.items() if size % tp_size}
    if uneven:
        raise ValueError(f"{field} does not divide the model's {uneven}; choose a size that divides "
                         f"the attention and KV heads and the MLP width")
