"""The FSDP2 actor: a Hugging Face causal LM sharded over the trainer group, its optimizer and loss."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from molt.batch import MicroBatch
from molt.objectives import (compute_entropy_bonus, compute_importance_weights, compute_kl_loss,
                             compute_ppo_clip_loss, token_entropy_from_logits)

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
    shard_causal_lm(model, mesh=mesh, mp_policy=mp_policy)
    if model.config.tie_word_embeddings and model.get_output_embeddings() is not None:
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            raise RuntimeError("sharding untied the input and output embeddings of a tied model")
    return model


def shard_causal_lm(model: nn.Module, *, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """Apply FSDP2 in place: one unit per decoder block (`model.model.layers`), then the root unit
    (embeddings, final norm, LM head). `molt.dry_run` shards a meta-device copy the same way."""
    mp_policy = mp_policy or MixedPrecisionPolicy()
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def _next_token_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       temperature: float) -> torch.Tensor:
    """[batch, seq - 1, vocab] logits / temperature predicting tokens 1.. (at least float32)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    # At least float32 (bf16 log-probs are too coarse for importance ratios), float64 stays float64.
    return logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)) / temperature


def _gather_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    targets = input_ids[:, 1:].unsqueeze(-1)  # [batch, seq - 1, 1]
    return F.pad(logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1), (1, 0))


def compute_token_logprobs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float
) -> torch.Tensor:
    """[batch, seq] log p(input_ids[:, t] | input_ids[:, :t]) under logits / temperature; column 0 is 0.

    Uses gather minus logsumexp, so no [batch, seq, vocab] log-softmax is kept beyond the
    float32 logits themselves. Expects right padding (positions then count from 0 in every row).
    """
    return _gather_logprobs(_next_token_logits(model, input_ids, attention_mask, temperature), input_ids)


def compute_token_logprobs_and_entropy(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute_token_logprobs` plus the entropy of each token's distribution ([batch, seq], column
    0 is 0), from the same forward."""
    logits = _next_token_logits(model, input_ids, attention_mask, temperature)
    return _gather_logprobs(logits, input_ids), F.pad(token_entropy_from_logits(logits), (1, 0))


@dataclass(kw_only=True)
class PolicyLoss:
    """Which terms make up the policy loss (README: Objectives); all divide by the window's tokens."""

    clip_eps_low: float
    clip_eps_high: float
    dual_clip: float | None = None
    importance: tuple[str, str, float, float] | None = None  # (level, mode, low, high); None = off
    entropy_coef: float = 0.0
    kl_coef: float = 0.0  # KL-to-reference term in the loss; needs MicroBatch.ref_logprobs when > 0
    kl_estimator: str = "k3"


def set_gradient_sum_reduction(model: nn.Module) -> None:
    """Make FSDP2 SUM gradients over the data-parallel ranks instead of averaging them.

    The losses divide by the window's GLOBAL action-token count, so each rank's gradient is
    already its share of the token mean and the shares must be summed. FSDP2 averages by default
    (divides by the data-parallel size); a divide factor of 1 turns that into a sum, and forcing
    plain SUM collectives keeps it a sum on every backend (gloo has no PREMUL_SUM; NCCL can use
    zero-copy SUM).
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def compute_window_denominator(
    micro_batches: list[MicroBatch], *, group: dist.ProcessGroup, device: torch.device
) -> float:
    """The window's action-token count over all micro-batches and ranks (at least 1).

    One all-reduce over `group`, before the first micro-batch, so every loss term of the window
    divides by the same number however the window is split (DESIGN section 8).
    """
    local_tokens = sum(micro_batch.num_action_tokens for micro_batch in micro_batches)
    window_tokens = torch.tensor(local_tokens, dtype=torch.int64, device=device)
    dist.all_reduce(window_tokens, op=dist.ReduceOp.SUM, group=group)
    if window_tokens.item() == 0:
        logger.warning("optimizer window has no action tokens on any rank; its gradient is zero")
    return float(max(window_tokens.item(), 1))


def step_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float
) -> float:
    """Clip the global gradient norm, step, zero the gradients; returns the pre-clip norm.

    `max_grad_norm <= 0` disables clipping (the norm is still measured).
    """
    parameters = [p for p in model.parameters() if p.grad is not None]
    grad_norm = 0.0
    if parameters:
        total_norm = torch.nn.utils.get_total_norm([p.grad for p in parameters], foreach=True)
        if isinstance(total_norm, DTensor):
            total_norm = total_norm.full_tensor()  # sharded partial norms -> global norm
        if max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(parameters, max_grad_norm, total_norm)
        grad_norm = total_norm.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


class TrainableModel:
    """An FSDP2 model with its own AdamW and one optimizer step per window; gradients are summed
    across the data-parallel ranks (the losses divide by the window's global token count).

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
    ) -> None:
        self.model = model
        self.group = group
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, eps=eps
        )
        set_gradient_sum_reduction(model)

    def step_optimizer(self) -> float:
        """Clip the global gradient norm, step AdamW, zero the gradients; returns the pre-clip norm."""
        return step_optimizer(self.model, self.optimizer, max_grad_norm=self.max_grad_norm)


class Actor(TrainableModel):
    """The policy being trained (see TrainableModel); log-probs at the sampling `temperature`."""

    def __init__(self, model: nn.Module, *, temperature: float = 1.0, **optimizer) -> None:
        super().__init__(model, **optimizer)
        self.temperature = temperature

    def train_window(self, micro_batches: list[MicroBatch], loss: PolicyLoss) -> dict[str, float]:
        """One optimizer step over all micro-batches; returns metrics reduced over the trainer group."""
        sums = self.compute_window_gradients(micro_batches, loss)
        grad_norm = self.step_optimizer()
        names = sorted(sums)  # every rank has the same terms, so the same names
        totals = torch.stack([sums[name] for name in names])
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.group)
        total = dict(zip(names, totals.tolist()))
        per_token = 1.0 / max(total["action_tokens"], 1.0)
        metrics = {
            "loss": total["loss"],
            "grad_norm": grad_norm,
            "clip_fraction": total["clipped_tokens"] * per_token,
            "ratio_mean": total["ratio_sum"] * per_token,
            # KL(behaviour || trainer) per token: how far the engine's sampler is from the trainer.
            "mismatch_kl": total.get("mismatch_kl_sum", total["approx_kl_sum"]) * per_token,
            "num_action_tokens": total["action_tokens"],
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        if loss.dual_clip:
            metrics["dual_clip_fraction"] = total["dual_clipped_tokens"] * per_token
        if loss.importance:
            metrics["importance_rejected_share"] = total["rejected_tokens"] * per_token
            metrics["importance_weight_mean"] = total["weight_sum"] / max(total["kept_tokens"], 1.0)
        if "ref_kl_sum" in total:
            metrics["ref_kl"] = total["ref_kl_sum"] * per_token
        if "entropy_sum" in total:
            metrics["entropy"] = total["entropy_sum"] * per_token
        return metrics

    def compute_window_gradients(self, micro_batches: list[MicroBatch], loss: PolicyLoss) -> dict[str, torch.Tensor]:
        """Accumulate the token-mean gradient of the window into `.grad`.

        Every term divides by the window's action-token count over all micro-batches and ranks
        (all-reduced once, before the first micro-batch); importance weights act inside each
        token's term and never change it. Returns this rank's float64 sums ("loss",
        "action_tokens", and the objectives' statistics); summed over ranks they describe the window.
        """
        self.model.train()
        denominator = compute_window_denominator(micro_batches, group=self.group, device=self.device)
        sums: dict[str, torch.Tensor] = {}
        for micro_batch in micro_batches:
            micro_batch = micro_batch.to(self.device)
            terms, stats = self._micro_batch_loss(micro_batch, loss, denominator)
            total = sum(terms)
            total.backward()
            stats["loss"] = total.detach()
            for name, value in stats.items():
                sums[name] = sums.get(name, 0) + value.detach().to(torch.float64)
        return sums

    def _micro_batch_loss(self, micro_batch: MicroBatch, loss: PolicyLoss,
                          denominator: float) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """The loss terms of one micro-batch and their statistics (masked sums)."""
        mask = micro_batch.action_mask
        if loss.entropy_coef > 0:
            logprobs, entropy = compute_token_logprobs_and_entropy(
                self.model, micro_batch.input_ids, micro_batch.attention_mask, temperature=self.temperature)
        else:
            logprobs = compute_token_logprobs(
                self.model, micro_batch.input_ids, micro_batch.attention_mask, temperature=self.temperature)
        stats: dict[str, torch.Tensor] = {}
        weights, ratio_base = None, micro_batch.behavior_logprobs
        if loss.importance is not None:
            # Decoupled correction: the PPO ratio is taken against the trainer's own log-probs before
            # this step (one optimizer step per window, so the current ones, detached), and the
            # engine/trainer mismatch is corrected by the importance weight of each token.
            level, mode, low, high = loss.importance
            ratio_base = logprobs.detach()
            weights, importance_stats = compute_importance_weights(
                ratio_base, micro_batch.behavior_logprobs, mask, level=level, mode=mode, low=low, high=high)
            stats.update(importance_stats)
        policy, policy_stats = compute_ppo_clip_loss(
            logprobs, ratio_base, micro_batch.advantages, mask, clip_eps_low=loss.clip_eps_low,
            clip_eps_high=loss.clip_eps_high, denominator=denominator, dual_clip=loss.dual_clip,
            importance_weights=weights)
        stats.update(policy_stats)
        terms = [policy]
        if loss.kl_coef > 0:
            kl, kl_stats = compute_kl_loss(logprobs, micro_batch.ref_logprobs, mask, estimator=loss.kl_estimator,
                                           coef=loss.kl_coef, denominator=denominator)
            terms.append(kl)
            stats.update(kl_stats)
        if loss.entropy_coef > 0:
            bonus, entropy_stats = compute_entropy_bonus(entropy, mask, coef=loss.entropy_coef,
                                                         denominator=denominator)
            terms.append(bonus)
            stats.update(entropy_stats)
        return terms, stats

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
