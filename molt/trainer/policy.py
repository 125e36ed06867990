"""The policy as both ways in build it: molt.train's Trainer and molt.sft's run_sft start from the
same sharded actor (model, MoE routers, AdamW and its schedule), pad token and micro-batch layout,
so a warm start trains exactly the model, precision and packing that RL then trains."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from torch import nn

from molt.config import MoltConfig
from molt.distributed.parallelize import ShardingPlan, TrainerMesh
from molt.trace.experience import Experience
from molt.trainer.actor import Actor
from molt.trainer.batch import build_micro_batches
from molt.trainer.optimizer import optimizer_settings
from molt.trainer.routing_replay import RoutingReplay
from molt.trainer.sharded_model import build_actor_model

logger = logging.getLogger("molt")


@dataclass(frozen=True, kw_only=True)
class Policy:
    """The actor and how its micro-batches are built."""

    actor: Actor
    pad_token_id: int  # fills padded rows: the model's pad token, else its eos, else 0
    micro_batch_layout: str  # molt.trainer.batch.LAYOUTS: train.packing's layout, or "padded"


def build_policy(cfg: MoltConfig, *, mesh: TrainerMesh, device: torch.device, num_steps: int,
                 temperature: float = 1.0, routing_replay: bool = False) -> Policy:
    """model.path's actor on `mesh`, sharded and trained per the train section (collective): its MoE
    routers ready (algorithm.router_aux_loss_coef; `routing_replay` replays the engines' routes), an
    LR schedule over `num_steps` steps, scoring at `temperature` (the rollouts' sampling temperature;
    SFT has none and scores at 1), and train.packing's layout checked on it (`choose_layout`)."""
    plan = ShardingPlan.from_config(cfg)
    model = build_actor_model(cfg.model.path, mesh=mesh, device=device, plan=plan,
                              logprob_chunk_tokens=cfg.train.logprob_chunk_tokens,
                              freeze_router=cfg.train.freeze_router)
    routing = RoutingReplay.install(model, replay=routing_replay,
                                   aux_loss_coef=cfg.algorithm.router_aux_loss_coef)  # None: a dense model
    actor = Actor(model, group=mesh.dp_group, device=device, max_grad_norm=cfg.train.max_grad_norm,
                  optimizer=replace(optimizer_settings(cfg), num_steps=num_steps), temperature=temperature,
                  routing=routing)
    pad_token_id = resolve_pad_token_id(model)
    layout = choose_layout(actor, pad_token_id, plan.forward_dtype) if cfg.train.packing else "padded"
    return Policy(actor=actor, pad_token_id=pad_token_id, micro_batch_layout=layout)


def resolve_pad_token_id(model: nn.Module) -> int:
    config = model.config
    for candidate in (config.pad_token_id, config.eos_token_id, 0):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)


def packing_layout(model: nn.Module) -> str:
    """The packed layout (molt.trainer.batch.LAYOUTS) the model's attention implementation runs best:
    one row for flash attention's variable-length kernels, else rows as wide as the longest
    experience (a block-diagonal mask costs the whole row's square)."""
    implementation = getattr(model.config, "_attn_implementation", None) or ""
    return "row" if implementation.startswith("flash") else "rows"


def choose_layout(actor: Actor, pad_token_id: int, compute_dtype: torch.dtype) -> str:
    """train.packing's layout for this model, after checking that it keeps packed sequences apart:
    score three short random sequences packed (two share a row) and padded (collective, a few
    positions). Hugging Face's sdpa, eager and flash attention implementations honour per-sequence
    position ids; one that does not would let a sequence attend to the one before it, so the run
    then pads, with a warning."""
    layout = packing_layout(actor.model)
    generator = torch.Generator().manual_seed(0)
    vocab_size = actor.model.config.get_text_config().vocab_size
    experiences = []
    for rollout_id, length in enumerate((7, 4, 3)):
        token_ids = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
        experiences.append(Experience(token_ids=token_ids, action_mask=[0] + [1] * (length - 1),
                                      behavior_logprobs=[0.0] * length, policy_versions=[0] * length,
                                      reward=0.0, score=0.0, group_id=0, rollout_id=rollout_id))
    packed, padded = (build_micro_batches(experiences, max_tokens_per_micro_batch=64, pad_token_id=pad_token_id,
                                          layout=name, temperature=actor.temperature)[0] for name in (layout, "padded"))
    mask = padded.attention_mask.to(actor.device)
    gap = ((actor.score(packed) - actor.score(padded)).abs() * mask).max().item()
    tolerance = 1e-3 if compute_dtype.itemsize >= 4 else 5e-2  # bf16 kernels differ more; a leak differs by far more
    if gap <= tolerance:
        return layout
    logger.warning("train.packing: packed and padded log-probs differ by %.3g (> %.0e) under attention "
                   "implementation %r, which does not keep packed sequences apart; training pads instead",
                   gap, tolerance, getattr(actor.model.config, "_attn_implementation", "?"))
    return "padded"
