"""How the policy's micro-batches are laid out: train.packing's layout for the model's attention
implementation, checked on the built actor."""

from __future__ import annotations

import logging

import torch
from torch import nn

from molt.trace.experience import Experience
from molt.trainer.actor import Actor
from molt.trainer.batch import build_micro_batches

logger = logging.getLogger("molt")


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
