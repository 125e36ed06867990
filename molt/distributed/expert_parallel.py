"""Expert parallelism on the trainer (layout.trainer_expert_parallel_size) and the router freeze
(train.freeze_router).

Each MoE layer's routed experts are split over the `ep` ranks of the trainer mesh, which are
carved out of the data-parallel shard ranks (torchtitan's layout: dp_shard = dp_shard_mod_ep x
ep). Every ep rank routes its own tokens; `ExpertParallelExperts` sends each (token, slot) row to
the rank holding its expert with one all-to-all, runs its local experts on what it received, and
sends the results back with a second all-to-all; the routing weights are applied on the token's
own rank, so the router's gradient never leaves it. The backward of an all-to-all is the
all-to-all with the split sizes swapped, which the autograd-aware functional collective does.

The expert weights stay the model's fused `gate_up_proj` [experts, 2 x inter, hidden] and
`down_proj` [experts, hidden, inter] parameters under the same names, as DTensors sharded on the
expert dim over the ep mesh; FSDP2 then shards each rank's experts again over dp_shard_mod_ep
(molt.distributed.parallelize.shard_model), so `full_tensor()` (refit), DCP resharding and the sharded loader
see whole tensors, and gradients are summed over the ranks that hold the same experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from molt.models.moe import count_experts


def find_fused_experts(backbone: nn.Module) -> dict[str, nn.Module]:
    """The fused routed-experts modules of `backbone.layers` by name: a block's `mlp.experts`
    holding 3-D `gate_up_proj` and `down_proj` (transformers 5's layout for Qwen2/Qwen3-MoE,
    Mixtral and others); dense blocks (Qwen3-MoE's mlp_only_layers) have none."""
    found = {}
    for index, block in enumerate(backbone.layers):
        experts = getattr(getattr(block, "mlp", None), "experts", None)
        if experts is None or isinstance(experts, ExpertParallelExperts):
            continue
        weights = [getattr(experts, name, None) for name in ("gate_up_proj", "down_proj")]
        if any(not isinstance(weight, torch.Tensor) or weight.ndim != 3 for weight in weights):
            raise ValueError(f"layers.{index}.mlp.experts ({type(experts).__name__}) is not a fused experts module "
                             f"with 3-D gate_up_proj and down_proj; layout.trainer_expert_parallel_size > 1 "
                             f"supports Hugging Face's fused layout (e.g. Qwen3-MoE). Use 1.")
        if getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False) or \
                not getattr(experts, "is_concatenated", True):
            raise ValueError(f"layers.{index}.mlp.experts ({type(experts).__name__}) has biases, transposed or "
                             f"interleaved gate/up weights, which Molt's expert parallelism does not implement; "
                             f"use layout.trainer_expert_parallel_size=1")
        found[f"layers.{index}.mlp.experts"] = experts
    return found


class ExpertParallelExperts(nn.Module):
    """A fused experts module whose experts are spread over the ep ranks.

    Same call as transformers' experts modules: forward(hidden [tokens, hidden], top_k_index
    [tokens, top_k], top_k_weights [tokens, top_k]) -> [tokens, hidden], so the router, routing
    replay and the load-balancing loss upstream are untouched. Collective over the ep group: every
    ep rank calls it once per MoE layer per forward (and again in a checkpointed block's
    recomputation), with however many tokens it has, none included.
    """

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]
        self.act_fn = experts.act_fn
        self.ep_group = ep_mesh.get_group()
        self.ep_size = ep_mesh.size()
        self.num_local_experts = self.num_experts // self.ep_size
        # src_data_rank=None: each rank keeps its own experts of its (meta) copy, no communication.
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name)
            sharded = distribute_tensor(weight.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            self.register_parameter(name, nn.Parameter(sharded, requires_grad=weight.requires_grad))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        expert_ids = top_k_index.reshape(-1)  # [tokens x top_k]
        order = torch.argsort(expert_ids, stable=True)  # (token, slot) rows grouped by expert, so by owner
        sent_per_expert = torch.bincount(expert_ids, minlength=self.num_experts)  # [experts]
        received_per_expert = self._exchange_counts(sent_per_expert)  # [ep, local experts]
        send_splits = sent_per_expert.view(self.ep_size, -1).sum(1).tolist()
        receive_splits = received_per_expert.sum(1).tolist()
        received = funcol.all_to_all_single_autograd(hidden[order // top_k], receive_splits, send_splits,
                                                     self.ep_group)  # [received rows, hidden]
        outputs = self._run_local_experts(received, received_per_expert)
        returned = funcol.all_to_all_single_autograd(outputs, send_splits, receive_splits, self.ep_group)
        per_slot = torch.empty_like(returned).index_copy(0, order, returned)  # back in (token, slot) order
        # The routing weights apply here, on the token's own rank: the router's gradient stays local.
        weights = top_k_weights.unsqueeze(-1).to(per_slot.dtype)
        return (per_slot.view(num_tokens, top_k, hidden.shape[-1]) * weights).sum(1).to(hidden.dtype)

    def _exchange_counts(self, sent_per_expert: torch.Tensor) -> torch.Tensor:
        """[ep, local experts]: how many rows each ep rank sends to each of this rank's experts."""
        received = torch.empty_like(sent_per_expert)
        dist.all_to_all_single(received, sent_per_expert, group=self.ep_group)
        return received.view(self.ep_size, self.num_local_experts)

    def _run_local_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each received row through its expert's SwiGLU MLP, in the received order (by source
        rank, then local expert). Every local expert runs, on no rows if none came, so each holds a
        gradient (zero when unused) and FSDP2 reduces the same tensors on every rank."""
        gate_up = self.gate_up_proj.to_local() if isinstance(self.gate_up_proj, DTensor) else self.gate_up_proj
        down = self.down_proj.to_local() if isinstance(self.down_proj, DTensor) else self.down_proj
        local_ids = torch.arange(self.num_local_experts, device=rows.device).repeat(self.ep_size)
        row_experts = local_ids.repeat_interleave(counts.reshape(-1))  # [received rows]
        order = torch.argsort(row_experts, stable=True)
        # A loop of dense matmuls, like transformers' eager experts; a grouped GEMM would be faster on GPU.
        chunks = torch.split(rows[order], counts.sum(0).tolist())
        outputs = []
        for expert, chunk in enumerate(chunks):
            gate, up = F.linear(chunk, gate_up[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, down[expert]))
        return torch.empty_like(rows).index_copy(0, order, torch.cat(outputs))


def check_expert_parallel_support(backbone: nn.Module, ep_size: int) -> None:
    """Refuse, naming layout.trainer_expert_parallel_size, a dense model or an expert count the ep
    size does not divide."""
    field = f"layout.trainer_expert_parallel_size={ep_size}"
    num_experts = count_experts(backbone.config)
    if not num_experts:
        raise ValueError(f"{field}: {type(backbone).__name__} is a dense model (no routed experts); use 1")
    if num_experts % ep_size:
        raise ValueError(f"{field} does not divide the model's num_experts={num_experts}; use one of "
                         f"{[size for size in range(1, num_experts + 1) if num_experts % size == 0]}")


def apply_expert_parallel(backbone: nn.Module, ep_mesh: DeviceMesh) -> list[ExpertParallelExperts]:
    """Replace every fused experts module of `backbone.layers` by an `ExpertParallelExperts` over
    `ep_mesh` (on the meta model, before FSDP2); returns the new modules."""
    check_expert_parallel_support(backbone, ep_mesh.size())
    replaced = []
    for name, experts in find_fused_experts(backbone).items():
        parallel = ExpertParallelExperts(experts, ep_mesh)
        backbone.get_submodule(name.rpartition(".")[0]).experts = parallel
        replaced.append(parallel)
    if not replaced:
        raise ValueError(f"layout.trainer_expert_parallel_size={ep_mesh.size()}: found no fused experts module "
                         f"(mlp.experts) in {type(backbone).__name__}'s layers; use 1")
    return replaced


def freeze_routers(backbone: nn.Module) -> list[str]:
    """train.freeze_router: the MoE routers' weights (each block's `mlp.gate.weight`) stop
    training (requires_grad False, so the optimizer skips them; call before FSDP2). RL updates
    move the router most easily, and a moved router changes which experts run, which is the main
    source of trainer/engine mismatch in MoE RL; freezing it trains the experts and the rest
    under a fixed routing function. Returns the frozen parameters' names; refuses a model with none."""
    frozen = []
    for index, block in enumerate(backbone.layers):
        gate = getattr(getattr(block, "mlp", None), "gate", None)
        weight = getattr(gate, "weight", None)
        if isinstance(weight, nn.Parameter) and getattr(gate, "num_experts", None):
            weight.requires_grad_(False)
            frozen.append(f"layers.{index}.mlp.gate.weight")
    if not frozen:
        raise ValueError(f"train.freeze_router=True but {type(backbone).__name__} has no MoE router (mlp.gate with "
                         f"num_experts); set it False for a dense model")
    return frozen
