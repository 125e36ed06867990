"""The PPO critic (a value model sharded like the actor, its optimizer and loss) and the frozen
reference policy used for KL (DESIGN section 8)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel

from molt.distributed.parallelize import ShardingPlan, TrainerMesh
from molt.models.hf_checkpoint import build_empty_model
from molt.models.vision_language import is_vision_language
from molt.objectives import compute_value_loss
from molt.trainer.batch import MicroBatch
from molt.trainer.scoring import score_micro_batch
from molt.trainer.sharded_model import build_actor_model, shard_and_load
from molt.trainer.trainable import TrainableModel, compute_window_denominator


class ValueModel(nn.Module):
    """A Hugging Face decoder backbone (no LM head) with a scalar value head on every position.

    `forward(input_ids, attention_mask=None, position_ids=None)` returns per-position values (at
    least float32) aligned like `score_tokens`: column t is the value of the state in which token t
    is about to be emitted, read from the hidden state at position t - 1; 0 at each sequence's first
    token. So GAE reads the value of each action's state at that action's own column. Padded rows
    must be right-padded; a packed row carries per-sequence `position_ids`.
    """

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.model = backbone  # named like a causal LM's `model`, so parameter names match it
        parameter = next(backbone.parameters())
        self.value_head = nn.Linear(backbone.config.hidden_size, 1, dtype=parameter.dtype, device=parameter.device)
        self.reset_value_head()

    @torch.no_grad()
    def reset_value_head(self) -> None:
        # Zero weight and bias: every initial value is exactly 0, so the first advantages are the
        # plain returns rather than noise from a random projection of large hidden states.
        for parameter in self.value_head.parameters():
            parameter.zero_()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).last_hidden_state  # [rows, len, hidden]
        values = self.value_head(hidden).squeeze(-1)  # [rows, len]: value after reading token t
        values = values.to(torch.promote_types(values.dtype, torch.float32))
        shifted = F.pad(values[:, :-1], (1, 0))
        return shifted if position_ids is None else shifted.masked_fill(position_ids == 0, 0.0)


def build_value_model(model_path: str, *, mesh: TrainerMesh, device: torch.device, plan: ShardingPlan) -> ValueModel:
    """The backbone of a Hugging Face causal LM with a zero value head, sharded and loaded like
    `build_actor_model` (meta device, `shard_model`, each rank reading its own slices)."""
    if is_vision_language(AutoConfig.from_pretrained(model_path)):
        raise ValueError(f"model.path={model_path!r} is a vision-language model; a critic (GAE, "
                         f"algorithm.advantage_estimator) on one is not supported yet: use a group estimator "
                         f"such as grpo")
    model = ValueModel(build_empty_model(model_path, dtype=plan.param_dtype, auto_class=AutoModel))
    shard_and_load(model, model.model, model_path, mesh=mesh, device=device, plan=plan,
                   not_in_checkpoint="value_head.")
    model.reset_value_head()
    return model


class Critic(TrainableModel):
    """The PPO critic: the FSDP2 value model and its own AdamW (see TrainableModel)."""

    @torch.no_grad()
    def compute_values(self, micro_batch: MicroBatch) -> torch.Tensor:
        """[batch, seq] values under the current weights, aligned as in `ValueModel` (collective)."""
        self.model.eval()
        micro_batch = micro_batch.to(self.device)
        values = micro_batch.to_rows(self.model(**micro_batch.model_inputs()))
        # FSDP2 keeps the root unit's parameters gathered after a forward with no backward; a
        # later forward would then reuse them even after the optimizer changed the shards.
        self.model.reshard()
        return values

    def train_window(self, micro_batches: list[MicroBatch], *, old_values: list[torch.Tensor],
                     returns: list[torch.Tensor], clip_range: float | None) -> dict[str, float]:
        """One optimizer step on the clipped value loss (skipped when the loss or the gradient norm is
        not finite on some rank); returns metrics reduced over the group.

        Args:
            old_values: one [batch, seq] tensor per micro-batch, the values the returns were
                computed with (`compute_values` before the window).
            returns: one [batch, seq] tensor per micro-batch, the value targets.
            clip_range: see `compute_value_loss`; None for the unclipped loss.
        """
        if not len(micro_batches) == len(old_values) == len(returns):
            raise ValueError(f"need old_values and returns for each micro-batch, got {len(micro_batches)} "
                             f"micro-batches, {len(old_values)} old_values and {len(returns)} returns")
        sums = self.compute_window_gradients(micro_batches, old_values=old_values, returns=returns,
                                             clip_range=clip_range)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.group)
        loss, tokens, clipped, error_sum, value_sum, return_sum, return_square_sum = sums.tolist()
        grad_norm, stepped = self.step_optimizer(loss_is_finite=math.isfinite(loss))
        per_token = 1.0 / max(tokens, 1.0)
        # 1 - MSE / Var(returns): 1 is a perfect fit, 0 no better than the mean return; NaN when
        # the returns do not vary (nothing to explain).
        return_variance = return_square_sum * per_token - (return_sum * per_token) ** 2
        explained_variance = 1.0 - error_sum * per_token / return_variance if return_variance > 0 else float("nan")
        return {"value_loss": loss, "value_clip_fraction": clipped * per_token, "value_grad_norm": grad_norm,
                "explained_variance": explained_variance, "value_mean": value_sum * per_token,
                "return_mean": return_sum * per_token, "value_skipped_nonfinite": float(not stepped)}

    def compute_window_gradients(self, micro_batches: list[MicroBatch], *, old_values: list[torch.Tensor],
                                 returns: list[torch.Tensor], clip_range: float | None) -> torch.Tensor:
        """Accumulate the token-mean value-loss gradient of the window into `.grad`.

        Returns this rank's sums [loss, action_tokens, clipped_tokens, error_sum, value_sum,
        return_sum, return_square_sum] (float64, on `self.device`); summed over ranks they
        describe the whole window.
        """
        self.model.train()
        denominator = compute_window_denominator(micro_batches, group=self.group, device=self.device)
        sums = torch.zeros(7, dtype=torch.float64, device=self.device)
        for micro_batch, micro_old_values, micro_returns in zip(micro_batches, old_values, returns):
            if not micro_old_values.shape == micro_returns.shape == micro_batch.input_ids.shape:
                raise ValueError(f"old_values {tuple(micro_old_values.shape)} and returns {tuple(micro_returns.shape)} "
                                 f"must match the micro-batch's input_ids {tuple(micro_batch.input_ids.shape)}")
            micro_batch = micro_batch.to(self.device)
            values = micro_batch.to_rows(self.model(**micro_batch.model_inputs()))
            loss, stats = compute_value_loss(values, micro_old_values.to(self.device), micro_returns.to(self.device),
                                             micro_batch.action_mask, clip_range=clip_range, denominator=denominator)
            loss.backward()
            sums += torch.stack([loss.detach(), micro_batch.action_mask.sum(), stats["value_clipped_tokens"],
                                 stats["value_error_sum"], stats["value_sum"], stats["return_sum"],
                                 stats["return_square_sum"]]).to(torch.float64)
        return sums


def build_reference_model(model_path: str, *, mesh: TrainerMesh, device: torch.device, plan: ShardingPlan,
                          logprob_chunk_tokens: int = 1024) -> nn.Module:
    """The initial policy, frozen, for the KL to the reference: sharded like the actor, no grads,
    stored in the compute dtype (`ShardingPlan.frozen`)."""
    model = build_actor_model(model_path, mesh=mesh, device=device, plan=plan.frozen(),
                              logprob_chunk_tokens=logprob_chunk_tokens)
    model.requires_grad_(False)
    model.eval()
    return model


@torch.no_grad()
def compute_reference_logprobs(model: nn.Module, micro_batch: MicroBatch) -> torch.Tensor:
    """[batch, seq] token log-probs of a micro-batch under the reference model, aligned as
    `score_tokens`. Collective over its mesh. Each token at the temperature it was sampled at
    (`MicroBatch.temperatures`), as the actor scores it, so the KL compares the same
    distributions the policy loss uses."""
    logprobs, _ = score_micro_batch(model, micro_batch)
    model.reshard()  # see Critic.compute_values
    return logprobs
