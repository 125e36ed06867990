"""The actor: the policy being trained, its loss over each optimizer window (DESIGN section 8) and
the step's policy metrics. How it is built: molt.trainer.policy; what it shares with the critic:
molt.trainer.trainable."""

from __future__ import annotations

import contextlib
import math
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from molt.objectives import (aggregate_tokens, compute_cispo_loss, compute_entropy_bonus, compute_gspo_loss,
                             compute_importance_weights, compute_kl_estimate, compute_loss_denominator,
                             compute_ppo_clip_loss, compute_trust_region_weights)
from molt.trainer.batch import MicroBatch
from molt.trainer.diagnostics import StepDiagnostics
from molt.trainer.routing_replay import RoutingReplay
from molt.trainer.scoring import compute_token_logprobs, score_micro_batch
from molt.trainer.trainable import TrainableModel, compute_window_counts


@dataclass(kw_only=True)
class PolicyLoss:
    """Which terms make up the policy loss (docs/objectives.md); every term is aggregated over the
    window alike (`aggregation`, molt.objectives.compute_loss_denominator)."""

    clip_eps_low: float
    clip_eps_high: float
    dual_clip: float | None = None
    importance: tuple[str, str, float, float] | None = None  # (level, mode, low, high); None = off
    entropy_coef: float = 0.0
    kl_coef: float = 0.0  # KL-to-reference term in the loss; needs MicroBatch.ref_logprobs when > 0
    kl_estimator: str = "k3"
    kl_clamp: float = 0.0  # cap on each token's k3 estimate (algorithm.kl_clamp); 0 = uncapped
    kind: str = "ppo"  # ppo | gspo | cispo (algorithm.policy_loss); dual_clip is PPO's only
    router_aux_coef: float = 0.0  # MoE: the model's load-balancing loss (needs Actor.routing keeping logits)
    aggregation: str = "token_mean"  # token_mean | seq_mean_token_mean | constant (algorithm.loss_aggregation)
    constant_tokens: int = 0  # constant aggregation: tokens per sequence in the divisor
    trust_region: tuple[float, float] | None = None  # (max_kl, weight_cap): sequence trust region; None = off

    @property
    def decoupled(self) -> bool:
        """The ratio is taken against the trainer's log-probs before the update (importance correction
        or trust region), not against the behaviour log-probs."""
        return self.importance is not None or self.trust_region is not None


def is_maximum(statistic: str) -> bool:
    """Statistics add across micro-batches, ranks and windows, except maxima (named "..._max")."""
    return statistic.endswith("_max")


@dataclass(kw_only=True)
class WindowResult:
    """One optimizer window: this window's statistics summed over micro-batches and ranks."""

    totals: dict[str, float]  # "loss" (the window's aggregated loss), "action_tokens", objective sums (and maxima)
    grad_norm: float  # global, before clipping (nan/inf when not finite)
    stepped: bool  # False: a non-finite loss or gradient norm on some rank; no optimizer step anywhere


class Actor(TrainableModel):
    """The policy being trained (see TrainableModel). Micro-batches are scored at their tokens' own
    sampling temperatures (`MicroBatch.temperatures`); `temperature`, the run's, is for
    `compute_logprobs` and the micro-batches built here (`choose_layout`). `routing`: an MoE
    model's routers (molt.trainer.routing_replay), handed each micro-batch's recorded routes."""

    def __init__(self, model: nn.Module, *, temperature: float = 1.0, routing: RoutingReplay | None = None,
                 **settings) -> None:
        super().__init__(model, **settings)
        self.temperature = temperature
        self.routing = routing

    def routes_of(self, micro_batch: MicroBatch) -> contextlib.AbstractContextManager:
        """Around a micro-batch's forward and backward: its recorded routes for the routers (a no-op
        for a dense model)."""
        if self.routing is None:
            return contextlib.nullcontext()
        scored = micro_batch.model_layout(predicts_action(micro_batch.action_mask), fill=False)
        attention_mask = micro_batch.model_layout(micro_batch.attention_mask, fill=0)
        return self.routing.use(micro_batch.model_routed_experts(), scored, attention_mask)

    def train_window(self, micro_batches: list[MicroBatch], loss: PolicyLoss,
                     diagnostics: StepDiagnostics | None = None) -> WindowResult:
        """One optimizer step over the window's micro-batches (skipped if anything is not finite);
        `diagnostics`, when given, takes each micro-batch's log-probs and entropy (molt.trainer.diagnostics)."""
        sums = self.compute_window_gradients(micro_batches, loss, diagnostics)
        total = {}
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            # every rank has the same terms, so the same names and the same collectives
            names = sorted(name for name in sums if is_maximum(name) == (op == dist.ReduceOp.MAX))
            if names:
                totals = torch.stack([sums[name] for name in names])
                dist.all_reduce(totals, op=op, group=self.group)
                total.update(zip(names, totals.tolist()))
        grad_norm, stepped = self.step_optimizer(loss_is_finite=math.isfinite(total["loss"]))
        return WindowResult(totals=total, grad_norm=grad_norm, stepped=stepped)

    def compute_window_gradients(self, micro_batches: list[MicroBatch], loss: PolicyLoss,
                                 diagnostics: StepDiagnostics | None = None) -> dict[str, torch.Tensor]:
        """Accumulate the gradient of the window's loss (aggregated per `loss.aggregation`) into `.grad`.

        Every token's term divides by a number made of the window's action-token and sequence counts
        over all micro-batches and ranks (all-reduced once, before the first micro-batch) and its own
        row's tokens (molt.objectives.compute_loss_denominator); importance and trust-region weights
        act inside each token's term and never change it. Returns this rank's float64 sums ("loss",
        "action_tokens", and the objectives' statistics; maxima for "..._max"); summed (maxed) over
        ranks they describe the window.
        """
        self.model.train()
        window_tokens, window_sequences = compute_window_counts(micro_batches, group=self.group, device=self.device)
        sums: dict[str, torch.Tensor] = {}
        for micro_batch in micro_batches:
            micro_batch = micro_batch.to(self.device)
            denominator = compute_loss_denominator(
                micro_batch.action_mask, aggregation=loss.aggregation, window_tokens=window_tokens,
                window_sequences=window_sequences, constant_tokens=loss.constant_tokens)
            with self.routes_of(micro_batch):  # activation checkpointing reruns the forward in backward
                terms, stats = self._micro_batch_loss(micro_batch, loss, denominator, diagnostics)
                total = sum(terms)
                total.backward()
            stats["loss"] = total.detach()
            for name, value in stats.items():
                value = value.detach().to(torch.float64)
                if name not in sums:
                    sums[name] = value
                else:
                    sums[name] = torch.maximum(sums[name], value) if is_maximum(name) else sums[name] + value
        return sums

    def _micro_batch_loss(self, micro_batch: MicroBatch, loss: PolicyLoss, denominator: float | torch.Tensor,
                          diagnostics: StepDiagnostics | None = None
                          ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """The loss terms of one micro-batch and their statistics (masked sums). `denominator`: each
        token's divisor, one number or [rows, 1] (molt.objectives.compute_loss_denominator)."""
        mask = micro_batch.action_mask
        logprobs, entropy = score_micro_batch(self.model, micro_batch,
                                              with_entropy=loss.entropy_coef > 0 or diagnostics is not None)
        if diagnostics is not None:
            diagnostics.add_logprobs(logprobs, micro_batch.behavior_logprobs, entropy, mask)
        stats: dict[str, torch.Tensor] = {}
        aux_loss = None
        if self.routing is not None:
            self.routing.report(diagnostics)
            aux_loss = self.routing.load_balancing_loss()
        weights, ratio_base = None, micro_batch.behavior_logprobs
        if loss.decoupled:
            # Decoupled PPO: the ratio is taken against the proximal policy (the actor before the
            # step's first update: recorded by a no-grad pass when the step has several windows, the
            # current log-probs detached when it has one), and the engine/trainer mismatch is
            # corrected by each token's weight against the behaviour log-probs: the importance
            # correction's, then the trust region's, which rejects whole rows and caps the rest.
            ratio_base = micro_batch.proximal_logprobs
            if ratio_base is None:
                ratio_base = logprobs.detach()
        if loss.importance is not None:
            level, mode, low, high = loss.importance
            weights, importance_stats = compute_importance_weights(
                ratio_base, micro_batch.behavior_logprobs, mask, level=level, mode=mode, low=low, high=high)
            stats.update(importance_stats)
        if loss.trust_region is not None:
            max_kl, weight_cap = loss.trust_region
            weights, trust_stats = compute_trust_region_weights(
                ratio_base, micro_batch.behavior_logprobs, mask, max_kl=max_kl, weight_cap=weight_cap,
                importance_weights=weights)
            stats.update(trust_stats)
        clip = dict(clip_eps_low=loss.clip_eps_low, clip_eps_high=loss.clip_eps_high, denominator=denominator,
                    importance_weights=weights)
        if loss.kind == "ppo":
            policy, policy_stats = compute_ppo_clip_loss(logprobs, ratio_base, micro_batch.advantages, mask,
                                                         dual_clip=loss.dual_clip, **clip)
        else:
            compute = compute_gspo_loss if loss.kind == "gspo" else compute_cispo_loss
            policy, policy_stats = compute(logprobs, ratio_base, micro_batch.advantages, mask, **clip)
        stats.update(policy_stats)
        terms = [policy]
        if loss.kl_coef > 0:
            # compute_kl_loss's term, whose one-number denominator cannot take a per-row aggregation
            token_kl = compute_kl_estimate(logprobs, micro_batch.ref_logprobs, estimator=loss.kl_estimator,
                                           clamp=loss.kl_clamp)
            terms.append(loss.kl_coef * aggregate_tokens(token_kl, mask, denominator=denominator))
            stats["ref_kl_sum"] = aggregate_tokens(token_kl.detach(), mask, denominator=1.0)
        if loss.entropy_coef > 0:
            bonus, entropy_stats = compute_entropy_bonus(entropy, mask, coef=loss.entropy_coef,
                                                         denominator=denominator)
            terms.append(bonus)
            stats.update(entropy_stats)
        if loss.router_aux_coef > 0 and aux_loss is not None:
            # The model's per-token-mean auxiliary loss, weighted by this micro-batch's share of the
            # window's loss weight (its tokens' 1 / denominator), so it aggregates like every other term.
            share = aggregate_tokens(torch.ones_like(mask), mask, denominator=denominator)
            terms.append(loss.router_aux_coef * aux_loss * share)
            stats["router_aux_loss_sum"] = aux_loss.detach() * mask.sum()
        return terms, stats

    @torch.no_grad()
    def score(self, micro_batch: MicroBatch, diagnostics: StepDiagnostics | None = None) -> torch.Tensor:
        """[batch, seq] token log-probs of a micro-batch under the current weights (collective);
        `diagnostics`, when given, takes them with the entropy (molt.trainer.diagnostics)."""
        self.model.eval()
        micro_batch = micro_batch.to(self.device)
        with self.routes_of(micro_batch):
            logprobs, entropy = score_micro_batch(self.model, micro_batch, with_entropy=diagnostics is not None)
            if self.routing is not None:
                self.routing.report(diagnostics)
        if diagnostics is not None:
            diagnostics.add_logprobs(logprobs, micro_batch.behavior_logprobs, entropy, micro_batch.action_mask)
        # FSDP2 keeps the root unit's parameters gathered after a forward with no backward; a
        # later forward would then reuse them even after the optimizer changed the shards.
        self.model.reshard()
        return logprobs

    @torch.no_grad()
    def compute_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[batch, seq] token log-probs of right-padded rows under the current weights, at `temperature`
        (collective)."""
        self.model.eval()
        logprobs = compute_token_logprobs(self.model, input_ids.to(self.device), attention_mask.to(self.device),
                                          temperature=self.temperature)
        self.model.reshard()  # see score
        return logprobs


def summarize_windows(results: list[WindowResult], loss: PolicyLoss, *, num_windows: int) -> dict[str, float]:
    """The step's policy metrics from its windows: per-token statistics pooled over every window
    run (all epochs), the loss and gradient norm averaged over them (so a non-finite one shows)."""
    total: dict[str, float] = {}
    for result in results:
        for name, value in result.totals.items():
            total[name] = max(total.get(name, value), value) if is_maximum(name) else total.get(name, 0.0) + value
    per_token = 1.0 / max(total.get("action_tokens", 0.0), 1.0)
    stepped = [result for result in results if result.stepped]
    metrics = {
        "loss": statistics.fmean(r.totals["loss"] for r in results),
        "grad_norm": statistics.fmean(r.grad_norm for r in results),
        "clip_fraction": total.get("clipped_tokens", 0.0) * per_token,
        "ratio_mean": total.get("ratio_sum", 0.0) * per_token,
        # KL(behaviour || trainer) per token: how far the engine's sampler is from the trainer.
        "mismatch_kl": total.get("mismatch_kl_sum", total.get("approx_kl_sum", 0.0)) * per_token,
        "num_action_tokens": sum(r.totals.get("action_tokens", 0.0) for r in results[:num_windows]),
        "optimizer_steps": float(len(stepped)),
    }
    if loss.dual_clip:
        metrics["dual_clip_fraction"] = total.get("dual_clipped_tokens", 0.0) * per_token
    if loss.importance:
        metrics["importance_rejected_share"] = total.get("rejected_tokens", 0.0) * per_token
        metrics["importance_weight_mean"] = total.get("weight_sum", 0.0) / max(total.get("kept_tokens", 0.0), 1.0)
    if loss.trust_region:
        sequences = max(total.get("trust_region_sequences", 0.0), 1.0)
        metrics["trust_region_rejected_share"] = total.get("trust_region_rejected_sequences", 0.0) / sequences
        metrics["trust_region_kl_mean"] = total.get("trust_region_kl_sum", 0.0) / sequences
        metrics["trust_region_kl_max"] = total.get("trust_region_kl_max", 0.0)
    if "ref_kl_sum" in total:
        metrics["ref_kl"] = total["ref_kl_sum"] * per_token
    if "entropy_sum" in total:
        metrics["entropy"] = total["entropy_sum"] * per_token
    if "router_aux_loss_sum" in total:
        metrics["router_aux_loss"] = total["router_aux_loss_sum"] * per_token
    return metrics


def predicts_action(action_mask: torch.Tensor) -> torch.Tensor:
    """[batch, seq] bool: the positions whose logits score an action token (t - 1 for token t)."""
    return F.pad(action_mask[..., 1:], (0, 1)) > 0
