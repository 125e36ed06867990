"""The FSDP2 actor: a Hugging Face causal LM sharded over the trainer group, its optimizer and loss."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from molt.batch import MicroBatch
from molt.objectives import compute_ppo_clip_loss

logger = logging.getLogger("molt")


def build_actor_model(
    model_path: str,
    *,
    mesh: DeviceMesh,
    device: torch.device,
    dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Load a Hugging Face causal LM and shard it with FSDP2 over `mesh` (the trainer group only).

    Each decoder block is its own FSDP unit; the root unit holds the embeddings, final norm and
    LM head, so tied input/output embeddings stay one shared parameter inside one unit. FSDP moves
    the shards onto the mesh's device; the full model only ever exists in host memory.
    Parameter names stay the Hugging Face names (FSDP2 adds no wrapper prefixes), which is what
    vLLM's `load_weights` expects at refit.

    Args:
        dtype: the stored parameter dtype (and so the optimizer state's).
        compute_dtype: if set, parameters are cast to it for forward/backward while gradients are
            reduced in float32 (FSDP2 mixed precision); e.g. dtype=float32, compute_dtype=bfloat16.
    """
    if device.type != mesh.device_type:
        raise ValueError(f"device {device} does not match the mesh's device type {mesh.device_type!r}")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.config.use_cache = False
    mp_policy = MixedPrecisionPolicy()
    if compute_dtype is not None:
        mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if model.config.tie_word_embeddings and model.get_output_embeddings() is not None:
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            raise RuntimeError("sharding untied the input and output embeddings of a tied model")
    return model


def compute_token_logprobs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float
) -> torch.Tensor:
    """[batch, seq] log p(input_ids[:, t] | input_ids[:, :t]) under logits / temperature; column 0 is 0.

    Uses gather minus logsumexp, so no [batch, seq, vocab] log-softmax is kept beyond the
    float32 logits themselves. Expects right padding (positions then count from 0 in every row).
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    # At least float32 (bf16 log-probs are too coarse for importance ratios), float64 stays float64.
    logits = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)  # [batch, seq - 1, 1]
    logprobs = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return F.pad(logprobs, (1, 0))


class Actor:
    """The policy being trained: the FSDP2 model, AdamW, and one optimizer step per window.

    Every method that runs the model is collective over `group`: all trainer ranks call it,
    with the same number of micro-batches.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        group: dist.ProcessGroup,
        device: torch.device,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        max_grad_norm: float = 1.0,
        temperature: float = 1.0,
    ) -> None:
        self.model = model
        self.group = group
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.temperature = temperature
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, eps=eps
        )
        # The loss divides by the window's GLOBAL action-token count, so each rank's gradient is
        # already its share of the token mean and the shares must be SUMMED across ranks. FSDP2
        # averages by default (divides by the data-parallel size); a divide factor of 1 turns
        # that into a sum, and forcing plain SUM collectives keeps it a sum on every backend
        # (gloo has no PREMUL_SUM; NCCL can use zero-copy SUM).
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    def train_window(
        self, micro_batches: list[MicroBatch], *, clip_eps_low: float, clip_eps_high: float
    ) -> dict[str, float]:
        """One optimizer step over all micro-batches; returns metrics reduced over the trainer group."""
        sums = self.compute_window_gradients(
            micro_batches, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high
        )
        grad_norm = self.step_optimizer()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.group)
        loss, action_tokens, clipped_tokens, ratio_sum, approx_kl_sum = sums.tolist()
        per_token = 1.0 / max(action_tokens, 1.0)
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "clip_fraction": clipped_tokens * per_token,
            "approx_kl": approx_kl_sum * per_token,
            "ratio_mean": ratio_sum * per_token,
            "num_action_tokens": action_tokens,
            "lr": self.optimizer.param_groups[0]["lr"],
        }

    def compute_window_gradients(
        self, micro_batches: list[MicroBatch], *, clip_eps_low: float, clip_eps_high: float
    ) -> torch.Tensor:
        """Accumulate the token-mean gradient of the window into `.grad`.

        Returns this rank's sums [loss, action_tokens, clipped_tokens, ratio_sum, approx_kl_sum]
        (float64, on `self.device`); summed over ranks they describe the whole window.
        """
        self.model.train()
        local_tokens = sum(micro_batch.num_action_tokens for micro_batch in micro_batches)
        window_tokens = torch.tensor(local_tokens, dtype=torch.int64, device=self.device)
        dist.all_reduce(window_tokens, op=dist.ReduceOp.SUM, group=self.group)
        if window_tokens.item() == 0:
            logger.warning("optimizer window has no action tokens on any rank; its gradient is zero")
        denominator = float(max(window_tokens.item(), 1))

        sums = torch.zeros(5, dtype=torch.float64, device=self.device)
        for micro_batch in micro_batches:
            micro_batch = micro_batch.to(self.device)
            logprobs = compute_token_logprobs(
                self.model,
                micro_batch.input_ids,
                micro_batch.attention_mask,
                temperature=self.temperature,
            )
            loss, stats = compute_ppo_clip_loss(
                logprobs,
                micro_batch.behavior_logprobs,
                micro_batch.advantages,
                micro_batch.action_mask,
                clip_eps_low=clip_eps_low,
                clip_eps_high=clip_eps_high,
                denominator=denominator,
            )
            loss.backward()
            sums += torch.stack([
                loss.detach(),
                stats["action_tokens"],
                stats["clipped_tokens"],
                stats["ratio_sum"],
                stats["approx_kl_sum"],
            ]).to(torch.float64)
        return sums

    def step_optimizer(self) -> float:
        """Clip the global gradient norm, step AdamW, zero the gradients; returns the pre-clip norm."""
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = 0.0
        if parameters:
            total_norm = torch.nn.utils.get_total_norm([p.grad for p in parameters], foreach=True)
            if isinstance(total_norm, DTensor):
                total_norm = total_norm.full_tensor()  # sharded partial norms -> global norm
            if self.max_grad_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(parameters, self.max_grad_norm, total_norm)
            grad_norm = total_norm.item()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    @torch.no_grad()
    def compute_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[batch, seq] token log-probs under the current weights (collective over the group)."""
        self.model.eval()
        logprobs = compute_token_logprobs(
            self.model,
            input_ids.to(self.device),
            attention_mask.to(self.device),
            temperature=self.temperature,
        )
        # FSDP2 keeps the root unit's parameters gathered after a forward with no backward; a
        # later forward would then reuse them even after the optimizer changed the shards.
        self.model.reshard()
        return logprobs
