"""What the actor and the critic share as trainable models on the trainer mesh: gradients summed
over the data-parallel ranks, each window's token count taken once before its first micro-batch,
and one clipped AdamW step per window that every rank skips alike when anything is not finite."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from molt.objectives import count_sequences
from molt.trainer.batch import MicroBatch
from molt.trainer.optimizer import OptimizerSettings, build_optimizer

logger = logging.getLogger("molt")


def set_gradient_sum_reduction(model: nn.Module) -> None:
    """Make FSDP2 SUM gradients over the data-parallel ranks instead of averaging them.

    The losses divide by the window's GLOBAL action-token count, so each rank's gradient is
    already its share of the token mean and the shares must be summed. FSDP2 averages by default
    (divides by the data-parallel size); a divide factor of 1 turns that into a sum, and forcing
    plain SUM collectives keeps it a sum on every backend (gloo has no PREMUL_SUM; NCCL can use
    zero-copy SUM). Under HSDP both the reduce-scatter over dp_shard and the all-reduce over
    dp_replicate sum. Tensor-parallel ranks hold parts of one data-parallel rank, not more data:
    DTensor sums their partial gradients, and FSDP2 reduces over the dp dims only.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def compute_window_counts(micro_batches: list[MicroBatch], *, group: dist.ProcessGroup,
                          device: torch.device) -> tuple[int, int]:
    """The window's action tokens and sequences (rows with an action token) over all micro-batches
    and data-parallel ranks.

    One all-reduce over `group` (the data-parallel group: tp ranks share their data), before the
    first micro-batch, so every loss term of the window divides by numbers that do not depend on
    how the window is split (DESIGN section 8; molt.objectives.compute_loss_denominator).
    """
    local = [(micro_batch.num_action_tokens, count_sequences(micro_batch.action_mask)) for micro_batch in micro_batches]
    counts = torch.tensor([sum(column) for column in zip(*local)] if local else [0, 0], dtype=torch.int64,
                          device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    window_tokens, window_sequences = counts.tolist()
    if window_tokens == 0:
        logger.warning("optimizer window has no action tokens on any rank; its gradient is zero")
    return window_tokens, window_sequences


def compute_window_denominator(micro_batches: list[MicroBatch], *, group: dist.ProcessGroup,
                               device: torch.device) -> float:
    """The window's action-token count over all micro-batches and data-parallel ranks (at least 1):
    the token mean's denominator (`compute_window_counts`)."""
    window_tokens, _ = compute_window_counts(micro_batches, group=group, device=device)
    return float(max(window_tokens, 1))


def group_by_grad_mesh(model: nn.Module) -> list[list[nn.Parameter]]:
    """The parameters with a gradient, one list per device mesh of their (DTensor) gradients:
    expert parallelism puts the experts on a mesh of their own, and DTensor's norm and foreach
    ops take one mesh at a time."""
    groups: dict[DeviceMesh | None, list[nn.Parameter]] = {}
    for param in model.parameters():
        if param.grad is not None:
            groups.setdefault(param.grad.device_mesh if isinstance(param.grad, DTensor) else None, []).append(param)
    return list(groups.values())


class TrainableModel:
    """An FSDP2 model with its own AdamW (molt.trainer.optimizer) and one optimizer step per window;
    gradients are summed across the data-parallel ranks (the losses divide by the window's global
    token count). The LR schedule advances once per training step (`advance_schedule`).

    `group` is the data-parallel group (TrainerMesh.dp_group: the ranks that train on different
    data), over which the window's token count and statistics are summed; under tensor parallelism
    it is not every trainer rank. Every method that runs the model is collective over the whole
    trainer mesh: all trainer ranks call it, the tp ranks of one data-parallel index with the same
    micro-batches, every rank with the same number of them.
    """

    def __init__(self, model: nn.Module, *, group: dist.ProcessGroup, device: torch.device,
                 optimizer: OptimizerSettings, max_grad_norm: float = 1.0) -> None:
        self.model = model
        self.group = group
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.optimizer, self.scheduler = build_optimizer(model, optimizer)
        set_gradient_sum_reduction(model)

    def step_optimizer(self, loss_is_finite: bool = True) -> tuple[float, bool]:
        """Clip the global gradient norm and step, unless the loss or the norm is not finite; zero the
        gradients either way. Returns (pre-clip norm, whether AdamW stepped).

        Both inputs are the same on every rank (the loss all-reduced over the data-parallel ranks and
        computed alike by tp ranks, the norm from the partial norms over every dim of each
        parameter's mesh), so every rank takes the same decision without another collective: a NaN
        or inf on any rank skips the update everywhere, and bad weights never exist.
        `max_grad_norm <= 0` disables clipping (the norm is still measured).
        """
        by_mesh = group_by_grad_mesh(self.model)
        grad_norm = 0.0
        if by_mesh:
            norms = []
            for parameters in by_mesh:
                norm = torch.nn.utils.get_total_norm([p.grad for p in parameters], foreach=True)
                norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # partial norms -> mesh's
            total_norm = torch.linalg.vector_norm(torch.stack(norms))
            grad_norm = total_norm.item()
        stepped = loss_is_finite and math.isfinite(grad_norm)
        if stepped:
            for parameters in by_mesh if self.max_grad_norm > 0 else ():
                torch.nn.utils.clip_grads_with_norm_(parameters, self.max_grad_norm, total_norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, stepped

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def advance_schedule(self) -> None:
        """After a training step: the next step's learning rate."""
        self.scheduler.step()

    def schedule_state(self) -> dict:
        return {key: value for key, value in self.scheduler.state_dict().items() if key != "lr_lambdas"}

    def load_schedule_state(self, state: dict) -> None:
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **state})
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
