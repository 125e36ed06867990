"""One training step on a trainer rank: what the objective needs before the update (reference
log-probs, critic values, advantages), then the policy and critic updates (DESIGN section 8).

Every method is collective over the trainer group: all ranks call it with the same number of
micro-batches. Group advantages are computed on every rank from the whole step's rewards (a few
numbers per experience), so a rollout whose segments or group-mates sit on other ranks still
counts once; token advantages are whitened over the action tokens of all ranks, and a rollout's
segments chain into one episode for them wherever they sit (`link_segments`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from molt.config import GROUP_ESTIMATORS, MoltConfig
from molt.distributed.parallelize import ShardingPlan, TrainerMesh
from molt.objectives import (AdaptiveKLController, compute_gae_advantages, compute_kl_estimate,
                             compute_reinforce_pp_advantages, whiten)
from molt.objectives.advantages import (Moments, SegmentHeads, SegmentLinks, chain_segments, compute_segment_heads,
                                        masked_moments)
from molt.objectives.overlong import compute_longest_response, compute_overlong_penalty
from molt.trainer.actor import Actor, PolicyLoss, WindowResult, summarize_windows
from molt.trainer.batch import MicroBatch, compute_group_advantages
from molt.trainer.critic import Critic, build_reference_model, build_value_model, compute_reference_logprobs
from molt.trainer.diagnostics import StepDiagnostics
from molt.trainer.optimizer import optimizer_settings


@dataclass(kw_only=True)
class BatchInfo:
    """What every trainer rank knows about the step's whole batch: per experience, in batch order."""

    rollout_ids: list[int]
    group_ids: list[int]
    rewards: list[float]
    own: list[int]  # batch indices of this rank's experiences, in the order the rank holds them
    # Each experience's Experience.segment_index, its place in its rollout; None: a rollout's
    # experiences are in segment order in the batch.
    segment_indices: list[int] | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
        self.max_response_tokens = cfg.rollout.max_response_tokens  # DAPO's L_max (overlong penalty)
        # The constant aggregation's tokens per sequence (Dr. GRPO: the generation budget).
        self.loss_constant_tokens = algo.loss_constant_tokens or cfg.rollout.max_response_tokens
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
        trust_region = (algo.trust_region_kl, algo.trust_region_weight_cap) if algo.trust_region_kl > 0 else None
        return PolicyLoss(clip_eps_low=algo.clip_eps_low, clip_eps_high=algo.clip_eps_high,
                          dual_clip=algo.dual_clip or None, importance=importance, entropy_coef=algo.entropy_coef,
                          kl_coef=self.kl_coef if algo.kl_placement == "loss" else 0.0,
                          kl_estimator=algo.kl_estimator, kl_clamp=algo.kl_clamp, kind=algo.policy_loss,
                          router_aux_coef=self.actor.routing.aux_loss_coef if self.actor.routing else 0.0,
                          aggregation=algo.loss_aggregation, constant_tokens=self.loss_constant_tokens,
                          trust_region=trust_region)

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

        Every window aggregates its terms over its own all-reduced token and sequence counts
        (DESIGN section 8, algorithm.loss_aggregation). With more than one optimizer step, a no-grad
        pass first records the proximal log-probs the decoupled PPO ratio (importance correction,
        trust region) is taken against. A window whose loss or gradient norm is not finite takes no
        step and ends the step's policy updates ("skipped_nonfinite"; "updated" says whether any
        window stepped).

        `diagnostics` (molt.trainer.diagnostics) checks every micro-batch's model inputs and takes the
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
        info, truncated, overlong_metrics = self._shape_overlong(micro_batches, info)
        metrics.update(overlong_metrics)
        self._set_advantages(micro_batches, info)
        self._drop_truncated(micro_batches, info, truncated)
        loss = self.policy_loss()
        if loss.decoupled and len(windows) * self.ppo_epochs > 1:
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
                                 estimator=self.algo.kl_estimator, clamp=self.algo.kl_clamp)
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
        set_token_advantages(micro_batches, info, [self._kl_in_reward(m)[0] for m in micro_batches],
                             estimator=algo.advantage_estimator, gamma=algo.gamma, lam=algo.gae_lambda,
                             kl_coef=self.kl_coef, whiten_advantages=algo.whiten_advantages, group=self.group,
                             device=self.device)

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

    # -- DAPO overlong handling (Yu et al. 2025, arXiv:2503.14476) ----------------------------

    def _shape_overlong(self, micro_batches: list[MicroBatch], info: BatchInfo
                        ) -> tuple[BatchInfo, set[int], dict[str, float]]:
        """The batch with the soft overlong penalty added to each rollout's reward (in `info` and in
        the micro-batches' `rewards`, so every estimator sees it once per rollout, as the reward),
        the truncated rollouts to drop from the loss (overlong filtering), and their metrics."""
        algo = self.algo
        if not algo.overlong_filter and algo.overlong_buffer_tokens == 0:
            return info, set(), {}
        rollouts = self._overlong_facts(micro_batches, info)
        num_rollouts = len(rollouts)
        truncated = {rollout_id for rollout_id, (_, cut) in rollouts.items() if cut}
        metrics = {"overlong_truncated_share": len(truncated) / num_rollouts if num_rollouts else math.nan}
        if not algo.overlong_filter:
            truncated = set()
        if algo.overlong_buffer_tokens > 0:
            penalties = compute_overlong_penalty(
                torch.tensor([longest for longest, _ in rollouts.values()], dtype=torch.float64),
                max_response_tokens=self.max_response_tokens, buffer_tokens=algo.overlong_buffer_tokens,
                factor=algo.overlong_penalty_factor)
            penalty_of = dict(zip(rollouts, penalties.tolist()))
            info = dataclasses.replace(info, rewards=[reward + penalty_of[rollout_id] for reward, rollout_id
                                                      in zip(info.rewards, info.rollout_ids, strict=True)])
            for micro_batch in micro_batches:
                row_penalties = [penalty_of[info.rollout_ids[info.own[row]]] if row >= 0 else 0.0
                                 for row in micro_batch.rows]
                micro_batch.rewards = micro_batch.rewards + torch.tensor(
                    row_penalties, dtype=micro_batch.rewards.dtype, device=micro_batch.rewards.device)
            metrics["overlong_penalty_mean"] = penalties.mean().item() if num_rollouts else math.nan
            metrics["overlong_penalized_share"] = (penalties < 0).double().mean().item() if num_rollouts else math.nan
        return info, truncated, metrics

    def _overlong_facts(self, micro_batches: list[MicroBatch], info: BatchInfo) -> dict[int, tuple[int, bool]]:
        """Per rollout of the whole batch: (its longest response in tokens, whether any of its
        experiences is truncated), from every rank's micro-batches (one all-reduce). A response is a
        run of consecutive action tokens: one generation, which rollout.max_response_tokens bounds."""
        facts = torch.zeros(len(info.rollout_ids), 2, dtype=torch.float64, device=self.device)  # [experiences, 2]
        for micro_batch in micro_batches:
            real = [row for row, index in enumerate(micro_batch.rows) if index >= 0]
            if not real:
                continue
            row_facts = torch.stack([compute_longest_response(micro_batch.action_mask).to(torch.float64),
                                     micro_batch.truncated.to(torch.float64)], dim=1)
            targets = torch.tensor([info.own[micro_batch.rows[row]] for row in real], device=self.device)
            facts[targets] = row_facts[torch.tensor(real, device=self.device)]
        dist.all_reduce(facts, op=dist.ReduceOp.MAX, group=self.group)
        rollouts: dict[int, tuple[int, bool]] = {}
        for rollout_id, (longest, cut) in zip(info.rollout_ids, facts.tolist(), strict=True):
            seen_longest, seen_cut = rollouts.get(rollout_id, (0, False))
            rollouts[rollout_id] = (max(seen_longest, int(longest)), seen_cut or cut > 0)
        return rollouts

    def _drop_truncated(self, micro_batches: list[MicroBatch], info: BatchInfo, truncated: set[int]) -> None:
        """Overlong filtering: zero the action mask of every experience of a truncated rollout, after
        the advantages are set (its reward keeps its place in its group's baseline). Its tokens then
        leave every loss term, the token counts the losses divide by, the critic's loss and the
        loss metrics, before the actor sees the batch."""
        if not truncated:
            return
        for micro_batch in micro_batches:
            kept = [row < 0 or info.rollout_ids[info.own[row]] not in truncated for row in micro_batch.rows]
            mask = micro_batch.action_mask
            keep = torch.tensor(kept, dtype=mask.dtype, device=mask.device)[:, None]  # [batch, 1]
            micro_batch.action_mask = mask * keep
            micro_batch.advantages = micro_batch.advantages * keep
            for name in ("returns", "old_values"):  # 0 off the action tokens, like the advantages
                if getattr(micro_batch, name) is not None:
                    setattr(micro_batch, name, getattr(micro_batch, name) * keep)


def set_token_advantages(micro_batches: list[MicroBatch], info: BatchInfo, token_kls: list[torch.Tensor | None], *,
                         estimator: str, gamma: float, lam: float, kl_coef: float, whiten_advantages: bool,
                         group: dist.ProcessGroup, device: torch.device) -> None:
    """A token estimator's advantages (`reinforce_pp`, `gae`; GAE's critic targets too) on every
    micro-batch, in place; collective over `group`. A rollout's segments chain into one episode
    wherever they are trained (`link_segments`); the advantages are whitened over the action tokens
    of every rank (reinforce_pp always, gae when `whiten_advantages`).

    `token_kls`: per micro-batch, the per-token KL placed in the reward (weighted by `kl_coef`), or None."""
    links = link_segments(micro_batches, info, token_kls, estimator=estimator, gamma=gamma, lam=lam,
                          kl_coef=kl_coef, group=group, device=device)
    raw = []
    for micro_batch, token_kl in zip(micro_batches, token_kls):
        rewards, next_values, next_advantages = (micro_batch.rewards, None, None) if links is None else \
            _links_of_rows(links, micro_batch, info)
        if estimator == "reinforce_pp":
            raw.append(compute_reinforce_pp_advantages(
                rewards, micro_batch.action_mask, gamma=gamma, token_kl=token_kl, kl_coef=kl_coef,
                whiten_returns=False, next_returns=next_advantages))
        else:  # gae
            advantages, micro_batch.returns = compute_gae_advantages(
                rewards, micro_batch.old_values, micro_batch.action_mask, gamma=gamma, lam=lam, token_kl=token_kl,
                kl_coef=kl_coef, whiten_advantages=False, next_values=next_values, next_advantages=next_advantages)
            raw.append(advantages)
    whitened = estimator == "reinforce_pp" or whiten_advantages
    moments = _global_moments(raw, micro_batches, group=group, device=device) if whitened else None
    for micro_batch, advantages in zip(micro_batches, raw):
        if whitened:
            advantages = whiten(advantages, micro_batch.action_mask, moments=moments)
        micro_batch.advantages = advantages.to(micro_batch.action_mask.dtype)


def link_segments(micro_batches: list[MicroBatch], info: BatchInfo, token_kls: list[torch.Tensor | None], *,
                  estimator: str, gamma: float, lam: float, kl_coef: float, group: dist.ProcessGroup,
                  device: torch.device) -> SegmentLinks | None:
    """What follows each experience in its rollout (molt.objectives.advantages.chain_segments), for
    the whole batch. The segments of one rollout may sit on different ranks, so each rank puts four
    numbers per experience it holds (its head, action-token count, first value and reward:
    `compute_segment_heads`) into one all-reduce over `group`, and every rank then chains every
    rollout. None when every rollout of the step is one experience: nothing to chain, and every rank
    (seeing the same rollout ids) skips the collective."""
    if len(set(info.rollout_ids)) == len(info.rollout_ids):
        return None
    lam = lam if estimator == "gae" else 1.0  # a REINFORCE++ return is GAE's with 0 values and lambda 1
    summary = torch.zeros(len(info.rollout_ids), 4, dtype=torch.float64, device=device)
    for micro_batch, token_kl in zip(micro_batches, token_kls):
        heads = compute_segment_heads(micro_batch.action_mask, gamma=gamma, lam=lam, token_kl=token_kl, kl_coef=kl_coef,
                                      values=micro_batch.old_values if estimator == "gae" else None)
        numbers = torch.stack([*heads, micro_batch.rewards.to(torch.float64)], dim=1)  # [batch, 4]
        batch_index = _batch_index(micro_batch, info, device)
        real = batch_index >= 0
        summary[batch_index[real]] = numbers[real]
    dist.all_reduce(summary, op=dist.ReduceOp.SUM, group=group)
    order = info.segment_indices if info.segment_indices is not None else list(range(len(info.rollout_ids)))
    return chain_segments(SegmentHeads(*summary[:, :3].unbind(dim=1)), summary[:, 3], torch.tensor(info.rollout_ids),
                          torch.tensor(order), gamma=gamma, lam=lam)


def _batch_index(micro_batch: MicroBatch, info: BatchInfo, device: torch.device) -> torch.Tensor:
    """[batch] long, each row's index in the step's batch; -1 for a filler row."""
    return torch.tensor([info.own[row] if row >= 0 else -1 for row in micro_batch.rows], device=device)


def _links_of_rows(links: SegmentLinks, micro_batch: MicroBatch, info: BatchInfo) -> SegmentLinks:
    """[batch] each row's entries of the batch's `links` (0 for a filler row)."""
    batch_index = _batch_index(micro_batch, info, links.rewards.device)
    real = batch_index >= 0
    return SegmentLinks(*(torch.where(real, part[batch_index.clamp(min=0)], 0.0) for part in links))


def _global_moments(values: list[torch.Tensor], micro_batches: list[MicroBatch], *, group: dist.ProcessGroup,
                    device: torch.device) -> Moments:
    parts = [masked_moments(v, m.action_mask) for v, m in zip(values, micro_batches)]
    totals = torch.stack([torch.stack(part) for part in parts]).sum(dim=0) if parts else \
        torch.zeros(3, dtype=torch.float64, device=device)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
    return Moments(*totals)


def _mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per-key mean over the windows (the critic's metrics); the skip flag is their max."""
    if not rows:
        return {}
    merged = {key: statistics.fmean(row[key] for row in rows) for key in rows[0]}
    merged["value_skipped_nonfinite"] = max(row["value_skipped_nonfinite"] for row in rows)
    return merged
