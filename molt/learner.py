"""One training step on a trainer rank: what the objective needs before the update (reference
log-probs, critic values, advantages), then the policy and critic updates (DESIGN section 8).

Every method is collective over the trainer group: all ranks call it with the same number of
micro-batches. Group advantages are computed on every rank from the whole step's rewards (a few
numbers per experience), so a rollout whose segments or group-mates sit on other ranks still
counts once; token advantages are whitened over the action tokens of all ranks.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from molt.actor import Actor, PolicyLoss
from molt.batch import MicroBatch, compute_group_advantages
from molt.config import GROUP_ESTIMATORS, MoltConfig
from molt.critic import Critic, build_reference_model, build_value_model, compute_reference_logprobs
from molt.objectives import (AdaptiveKLController, compute_gae_advantages, compute_kl_estimate,
                             compute_reinforce_pp_advantages, whiten)
from molt.objectives.advantages import Moments, masked_moments


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
    def __init__(self, cfg: MoltConfig, actor: Actor, *, mesh: DeviceMesh, group: dist.ProcessGroup,
                 device: torch.device):
        algo = cfg.algorithm
        self.algo = algo
        self.actor = actor
        self.group = group
        self.device = device
        self.temperature = cfg.rollout.temperature
        dtype = getattr(torch, cfg.model.dtype)
        self.kl_coef = algo.kl_coef
        self.kl_controller = (AdaptiveKLController(coef=algo.kl_coef, target_kl=algo.kl_target,
                                                   horizon=algo.kl_horizon) if algo.kl_target > 0 else None)
        # The reference is the initial policy, frozen; it exists only when the KL is on.
        self.reference = (build_reference_model(cfg.model.path, mesh=mesh, device=device, dtype=dtype)
                          if algo.kl_coef > 0 else None)
        self.critic = None
        if algo.advantage_estimator == "gae":
            self.critic = Critic(build_value_model(cfg.model.path, mesh=mesh, device=device, dtype=dtype),
                                 group=group, device=device, lr=algo.critic_learning_rate,
                                 betas=tuple(cfg.train.adam_betas), weight_decay=cfg.train.weight_decay,
                                 max_grad_norm=cfg.train.max_grad_norm)

    def policy_loss(self) -> PolicyLoss:
        algo = self.algo
        importance = None
        if algo.importance_level != "off":
            importance = (algo.importance_level, algo.importance_mode, *algo.importance_band)
        return PolicyLoss(clip_eps_low=algo.clip_eps_low, clip_eps_high=algo.clip_eps_high,
                          dual_clip=algo.dual_clip or None, importance=importance, entropy_coef=algo.entropy_coef,
                          kl_coef=self.kl_coef if algo.kl_placement == "loss" else 0.0,
                          kl_estimator=algo.kl_estimator)

    def state_dict(self) -> dict:
        """What a checkpoint keeps beyond the models: the (adaptive) KL coefficient."""
        return {"kl_coef": self.kl_coef}

    def load_state_dict(self, state: dict) -> None:
        self.kl_coef = state["kl_coef"]
        if self.kl_controller is not None:
            self.kl_controller.coef = self.kl_coef

    def train_step(self, micro_batches: list[MicroBatch], info: BatchInfo) -> dict[str, float]:
        """Fill in the objective's inputs, update the actor (and critic); metrics for the step."""
        micro_batches = [micro_batch.to(self.device) for micro_batch in micro_batches]
        metrics: dict[str, float] = {}
        if self.reference is not None:
            metrics.update(self._score_reference(micro_batches))
        if self.critic is not None:
            for micro_batch in micro_batches:
                values = self.critic.compute_values(micro_batch.input_ids, micro_batch.attention_mask)
                micro_batch.old_values = values * micro_batch.action_mask
        self._set_advantages(micro_batches, info)
        metrics.update(self.actor.train_window(micro_batches, self.policy_loss()))
        if self.critic is not None:
            metrics.update(self.critic.train_window(
                micro_batches, old_values=[m.old_values for m in micro_batches],
                returns=[m.returns for m in micro_batches], clip_range=self.algo.value_clip or None))
        if self.kl_controller is not None:
            # Ziegler et al. count the horizon in samples: this step's rollouts.
            self.kl_coef = self.kl_controller.update(metrics["ref_kl_behavior"], len(set(info.rollout_ids)))
        if self.reference is not None:
            metrics["kl_coef"] = self.kl_coef
        return metrics

    # -- the objective's inputs -------------------------------------------------------------

    def _score_reference(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        """Reference log-probs of every micro-batch; the mean per-token KL of the sampled policy
        (behaviour log-probs) to the reference, over all ranks."""
        kl_sum = torch.zeros(2, dtype=torch.float64, device=self.device)  # [kl sum, action tokens]
        for micro_batch in micro_batches:
            logprobs = compute_reference_logprobs(self.reference, micro_batch.input_ids, micro_batch.attention_mask,
                                                  temperature=self.temperature)
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
