"""One training step on a trainer rank: what the objective needs before the update (reference
log-probs, critic values, advantages), then the policy and critic updates (DESIGN section 8).

Every method is collective over the trainer group: all ranks call it with the same number of
micro-batches. Group advantages are computed on every rank from the whole step's rewards (a few
numbers per experience), so a rollout whose segments or group-mates sit on other ranks still
counts once; token advantages are whitened over the action tokens of all ranks.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from molt.actor import Actor, PolicyLoss, WindowResult, summarize_windows
from molt.batch import MicroBatch, compute_group_advantages
from molt.config import GROUP_ESTIMATORS, MoltConfig
from molt.critic import Critic, build_reference_model, build_value_model, compute_reference_logprobs
from molt.diagnostics import StepDiagnostics
from molt.objectives import (AdaptiveKLController, compute_gae_advantages, compute_kl_estimate,
                             compute_reinforce_pp_advantages, whiten)
from molt.objectives.advantages import Moments, masked_moments
from molt.optimizer import OptimizerSettings
from molt.parallelize import ShardingPlan, TrainerMesh


@dataclass(kw_only=True)
class BatchInfo:
    """What every trainer rank knows about the step's whole batch: per experience, in batch order."""

    rollout_ids: list[int]
    group_ids: list[int]
    rewards: list[float]
    own: list[int]  # batch indices of this rank's experiences, in the order the rank holds them

    def to_dict(self) -> dict:
        return {"rollout_ids": self.rollout_ids, "group_ids": self.group_ids, "rewards": self.rewards,
                "own": self.own}


class Learner:
    def __init__(self, cfg: MoltConfig, actor: Actor, *, mesh: TrainerMesh, device: torch.device):
        """Data sums (token counts, KL, metrics) run over `mesh.dp_group`: the ranks of one
        tensor-parallel group hold the same data and count once."""
        algo, train = cfg.algorithm, cfg.train
        self.algo = algo
        self.actor = actor
        self.group = mesh.dp_group
        self.device = device
        self.ppo_epochs = train.ppo_epochs
        plan = ShardingPlan.from_config(cfg)
        self.kl_coef = algo.kl_coef
        self.kl_controller = (AdaptiveKLController(coef=algo.kl_coef, target_kl=algo.kl_target,
                                                   horizon=algo.kl_horizon) if algo.kl_target > 0 else None)
        # The reference is the initial policy, frozen; it exists only when the KL is on.
        self.reference = (build_reference_model(cfg.model.path, mesh=mesh, device=device, plan=plan,
                                                logprob_chunk_tokens=train.logprob_chunk_tokens)
                          if algo.kl_coef > 0 else None)
        self.critic = None
        if algo.advantage_estimator == "gae":
            self.critic = Critic(build_value_model(cfg.model.path, mesh=mesh, device=device, plan=plan),
                                 group=mesh.dp_group, device=device, max_grad_norm=train.max_grad_norm,
                                 optimizer=optimizer_settings(cfg, lr=algo.critic_learning_rate))

    def policy_loss(self) -> PolicyLoss:
        algo = self.algo
        importance = None
        if algo.importance_level != "off":
            importance = (algo.importance_level, algo.importance_mode, *algo.importance_band)
        return PolicyLoss(clip_eps_low=algo.clip_eps_low, clip_eps_high=algo.clip_eps_high,
                          dual_clip=algo.dual_clip or None, importance=importance, entropy_coef=algo.entropy_coef,
                          kl_coef=self.kl_coef if algo.kl_placement == "loss" else 0.0,
                          kl_estimator=algo.kl_estimator, kind=algo.policy_loss,
                          router_aux_coef=self.actor.routing.aux_loss_coef if self.actor.routing else 0.0)

    def state_dict(self) -> dict:
        """What a checkpoint keeps beyond the models: the (adaptive) KL coefficient, the LR schedules."""
        state = {"kl_coef": self.kl_coef, "actor_lr_schedule": self.actor.schedule_state()}
        if self.critic is not None:
            state["critic_lr_schedule"] = self.critic.schedule_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.kl_coef = state["kl_coef"]
        if self.kl_controller is not None:
            self.kl_controller.coef = self.kl_coef
        if "actor_lr_schedule" in state:
            self.actor.load_schedule_state(state["actor_lr_schedule"])
        if self.critic is not None and "critic_lr_schedule" in state:
            self.critic.load_schedule_state(state["critic_lr_schedule"])

    def train_step(self, windows: list[list[MicroBatch]], info: BatchInfo,
                   diagnostics: StepDiagnostics | None = None) -> dict[str, float]:
        """Fill in the objective's inputs, then run `ppo_epochs` passes over the optimizer windows
        (PPO mini-batches), one actor (and critic) optimizer step each; metrics for the step.

        Every window divides by its own all-reduced action-token count (DESIGN section 8). With more
        than one optimizer step, a no-grad pass first records the proximal log-probs the decoupled
        PPO ratio is taken against. A window whose loss or gradient norm is not finite takes no
        step and ends the step's policy updates ("skipped_nonfinite"; "updated" says whether any
        window stepped).

        `diagnostics` (molt.diagnostics) checks every micro-batch's model inputs and takes the
        log-probs of the forwards before the step's first update, no extra forward: the proximal
        pass when there is one, else the first window's (all of the step's tokens when it has one
        window; with several and no importance correction, only the first window's)."""
        windows = [[micro_batch.to(self.device) for micro_batch in window] for window in windows]
        micro_batches = [micro_batch for window in windows for micro_batch in window]
        if diagnostics is not None:
            for micro_batch in micro_batches:
                diagnostics.check_model_inputs(micro_batch)
        metrics: dict[str, float] = self._padding_share(micro_batches)
        if self.reference is not None:
            metrics.update(self._score_reference(micro_batches))
        if self.critic is not None:
            for micro_batch in micro_batches:
                micro_batch.old_values = self.critic.compute_values(micro_batch) * micro_batch.action_mask
        self._set_advantages(micro_batches, info)
        loss = self.policy_loss()
        if loss.importance is not None and len(windows) * self.ppo_epochs > 1:
            for micro_batch in micro_batches:
                micro_batch.proximal_logprobs = self.actor.score(micro_batch, diagnostics) * micro_batch.action_mask
            diagnostics = None  # taken from the proximal pass
        metrics["lr"] = self.actor.lr
        results, critic_metrics = self._run_windows(windows, loss, diagnostics)
        metrics.update(summarize_windows(results, loss, num_windows=len(windows)))
        metrics["skipped_nonfinite"] = float(not all(result.stepped for result in results))
        metrics["updated"] = float(any(result.stepped for result in results))
        metrics.update(critic_metrics)
        self.actor.advance_schedule()
        if self.critic is not None:
            self.critic.advance_schedule()
        if self.kl_controller is not None:
            # Ziegler et al. count the horizon in samples: this step's rollouts.
            self.kl_coef = self.kl_controller.update(metrics["ref_kl_behavior"], len(set(info.rollout_ids)))
        if self.reference is not None:
            metrics["kl_coef"] = self.kl_coef
        return metrics

    def _run_windows(self, windows: list[list[MicroBatch]], loss: PolicyLoss,
                     diagnostics: StepDiagnostics | None = None) -> tuple[list[WindowResult], dict]:
        """`diagnostics` goes to the first window only: the one whose forward precedes every update."""
        results, critic_results = [], []
        for _ in range(self.ppo_epochs):
            for window in windows:
                result = self.actor.train_window(window, loss, diagnostics)
                diagnostics = None
                results.append(result)
                if not result.stepped:  # the step's updates end here, the critic's with the actor's
                    return results, _mean_metrics(critic_results)
                if self.critic is not None:
                    critic_results.append(self.critic.train_window(
                        window, old_values=[m.old_values for m in window], returns=[m.returns for m in window],
                        clip_range=self.algo.value_clip or None))
        return results, _mean_metrics(critic_results)

    def _padding_share(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        """Share of the positions the model computes that are padding, over all ranks."""
        counts = torch.tensor([[m.num_real_tokens, m.num_model_tokens] for m in micro_batches],
                              dtype=torch.float64, device=self.device).sum(dim=0)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.group)
        real, computed = counts.tolist()
        return {"padding_share": 1.0 - real / computed if computed else 0.0}

    # -- the objective's inputs -------------------------------------------------------------

    def _score_reference(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        """Reference log-probs of every micro-batch; the mean per-token KL of the sampled policy
        (behaviour log-probs) to the reference, over all ranks."""
        kl_sum = torch.zeros(2, dtype=torch.float64, device=self.device)  # [kl sum, action tokens]
        for micro_batch in micro_batches:
            logprobs = compute_reference_logprobs(self.reference, micro_batch)
            micro_batch.ref_logprobs = logprobs * micro_batch.action_mask
            kl = self._token_kl(micro_batch)
            kl_sum += torch.stack([kl.sum(), micro_batch.action_mask.sum()]).to(torch.float64)
        dist.all_reduce(kl_sum, op=dist.ReduceOp.SUM, group=self.group)
        return {"ref_kl_behavior": (kl_sum[0] / kl_sum[1].clamp(min=1)).item()}

    def _token_kl(self, micro_batch: MicroBatch) -> torch.Tensor:
        """[batch, seq] per-token KL estimate of the sampling policy to the reference, 0 off actions."""
        kl = compute_kl_estimate(micro_batch.behavior_logprobs, micro_batch.ref_logprobs,
                                 estimator=self.algo.kl_estimator)
        return kl * micro_batch.action_mask

    def _kl_in_reward(self, micro_batch: MicroBatch) -> tuple[torch.Tensor | None, float]:
        if self.reference is None or self.algo.kl_placement != "reward":
            return None, 0.0
        return self._token_kl(micro_batch), self.kl_coef

    def _set_advantages(self, micro_batches: list[MicroBatch], info: BatchInfo) -> None:
        algo = self.algo
        if algo.advantage_estimator in GROUP_ESTIMATORS:
            advantages = compute_group_advantages(info.rollout_ids, info.group_ids,
                                                  self._rewards_after_kl(micro_batches, info),
                                                  estimator=algo.advantage_estimator)
            for micro_batch in micro_batches:
                row_advantages = [advantages[info.own[row]] if row >= 0 else 0.0 for row in micro_batch.rows]
                column = torch.tensor(row_advantages, dtype=micro_batch.action_mask.dtype, device=self.device)
                micro_batch.advantages = column[:, None] * micro_batch.action_mask
            return
        raw = []
        for micro_batch in micro_batches:
            token_kl, kl_coef = self._kl_in_reward(micro_batch)
            if algo.advantage_estimator == "reinforce_pp":
                raw.append(compute_reinforce_pp_advantages(
                    micro_batch.rewards, micro_batch.action_mask, gamma=algo.gamma, token_kl=token_kl,
                    kl_coef=kl_coef, whiten_returns=False))
            else:  # gae
                advantages, micro_batch.returns = compute_gae_advantages(
                    micro_batch.rewards, micro_batch.old_values, micro_batch.action_mask, gamma=algo.gamma,
                    lam=algo.gae_lambda, token_kl=token_kl, kl_coef=kl_coef, whiten_advantages=False)
                raw.append(advantages)
        whitened = algo.advantage_estimator == "reinforce_pp" or algo.whiten_advantages
        moments = self._global_moments(raw, micro_batches) if whitened else None
        for micro_batch, advantages in zip(micro_batches, raw):
            if whitened:
                advantages = whiten(advantages, micro_batch.action_mask, moments=moments)
            micro_batch.advantages = advantages.to(micro_batch.action_mask.dtype)

    def _rewards_after_kl(self, micro_batches: list[MicroBatch], info: BatchInfo) -> list[float]:
        """Each experience's rollout reward, minus kl_coef x the rollout's summed token KL when the
        KL is placed in the reward (summed over all its segments, wherever they are trained)."""
        if self.reference is None or self.algo.kl_placement != "reward":
            return info.rewards
        kl_sums = torch.zeros(len(info.rewards), dtype=torch.float64, device=self.device)
        for micro_batch in micro_batches:
            row_kl = self._token_kl(micro_batch).sum(dim=1).to(torch.float64)
            for row, index in enumerate(micro_batch.rows):
                if index >= 0:
                    kl_sums[info.own[index]] = row_kl[row]
        dist.all_reduce(kl_sums, op=dist.ReduceOp.SUM, group=self.group)
        rollout_kl: dict[int, float] = defaultdict(float)
        for rollout_id, kl in zip(info.rollout_ids, kl_sums.tolist()):
            rollout_kl[rollout_id] += kl
        return [reward - self.kl_coef * rollout_kl[rollout_id]
                for reward, rollout_id in zip(info.rewards, info.rollout_ids)]

    def _global_moments(self, values: list[torch.Tensor], micro_batches: list[MicroBatch]) -> Moments:
        parts = [masked_moments(v, m.action_mask) for v, m in zip(values, micro_batches)]
        totals = torch.stack([torch.stack(part) for part in parts]).sum(dim=0) if parts else \
            torch.zeros(3, dtype=torch.float64, device=self.device)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.group)
        return Moments(*totals)


def optimizer_settings(cfg: MoltConfig, *, lr: float | None = None) -> OptimizerSettings:
    """The train section's AdamW and schedule settings (lr: the critic's own peak, else train.learning_rate)."""
    train = cfg.train
    return OptimizerSettings(lr=train.learning_rate if lr is None else lr, betas=tuple(train.adam_betas),
                             eps=train.adam_eps, weight_decay=train.weight_decay,
                             no_weight_decay_on=tuple(train.no_weight_decay_on), schedule=train.lr_schedule,
                             num_steps=train.num_steps, warmup_steps=train.warmup_steps,
                             min_lr_ratio=train.min_lr_ratio)


def _mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per-key mean over the windows (the critic's metrics); the skip flag is their max."""
    if not rows:
        return {}
    merged = {key: statistics.fmean(row[key] for row in rows) for key in rows[0]}
    merged["value_skipped_nonfinite"] = max(row["value_skipped_nonfinite"] for row in rows)
    return merged
