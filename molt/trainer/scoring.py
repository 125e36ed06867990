"""Scoring tokens under a trainer model: each token's log-prob (and the entropy) given the tokens
before it in its sequence, for the policy loss, the reference KL and the refit check."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from molt.models.vision_language import format_image_inputs
from molt.objectives import token_entropy_from_logits
from molt.trainer.batch import MicroBatch
from molt.trainer.logprobs import check_temperature, compute_chunked_logprobs


class ScoringHead(nn.Module):
    """A causal LM's linear LM head that can also score tokens without materializing the logits.

    It takes the place of `lm_head` holding the same weight Parameter (so parameter names, tied
    embeddings and FSDP2 units are unchanged). Called plainly it returns logits, like the head it
    replaces; inside `scoring(...)` the model's forward returns, in place of the logits, each
    position's log-prob of its target token (and the entropy) computed in chunks of
    `chunk_tokens` positions (molt.trainer.logprobs), inside the root unit's forward, where FSDP2 has the
    weight gathered.

    Under tensor parallelism the weight is vocab-sharded over the tp ranks (like the embedding it
    may be tied to) and gathered whole here, and the hidden states arrive whole (the final norm
    gathers them, molt.distributed.parallelize): every tp rank computes the same log-probs, and the gather's
    backward hands each rank its vocab rows of the (identical) weight gradient. Simpler than a
    vocab-parallel loss, at the cost of one whole head weight per rank during the forward.
    """

    def __init__(self, weight: nn.Parameter, *, chunk_tokens: int) -> None:
        super().__init__()
        self.weight = weight
        self.chunk_tokens = chunk_tokens
        # (targets [rows, len], temperature: one or [rows, len] per position, with_entropy)
        self.request: tuple[torch.Tensor, float | torch.Tensor, bool] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.weight.full_tensor() if isinstance(self.weight, DTensor) else self.weight
        if self.request is None:
            return F.linear(hidden, weight)
        targets, temperature, with_entropy = self.request
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.reshape(-1)
        logprobs, entropy = compute_chunked_logprobs(
            hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), temperature=temperature,
            chunk_tokens=self.chunk_tokens, with_entropy=with_entropy)
        columns = [logprobs, entropy] if with_entropy else [logprobs]
        # A fresh tensor, not a view: FSDP2 hooks the root module's outputs for backward.
        return torch.stack([column.view(hidden.shape[:-1]) for column in columns], dim=-1)  # [batch, seq, 1 or 2]


def install_scoring_head(model: nn.Module, *, chunk_tokens: int) -> None:
    """Replace the model's linear LM head by a `ScoringHead` over the same weight."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(f"{type(model).__name__}'s LM head is {type(head).__name__}"
                         f"{' with a bias' if isinstance(head, nn.Linear) else ''}: Molt scores tokens with a "
                         f"bias-free linear head (the Hugging Face causal LMs it trains have one)")
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} soft-caps its logits (final_logit_softcapping="
                         f"{model.config.final_logit_softcapping}), which Molt's chunked log-probs do not apply")
    model.set_output_embeddings(ScoringHead(head.weight, chunk_tokens=chunk_tokens))


def score_tokens(model: nn.Module, input_ids: torch.Tensor, *, temperature: float | torch.Tensor,
                 with_entropy: bool = False, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, image_inputs: dict[str, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[rows, len] log p(token t | the tokens before it in its sequence) under logits / temperature
    (at least float32), and with `with_entropy` the entropy of that distribution; 0 at each
    sequence's first token (column 0, or where `position_ids` is 0 in a packed row).

    `temperature`: one for every token, or [rows, len] (like `input_ids`) the one each token was
    sampled at, which its log-prob and entropy are then taken at.

    A model with a `ScoringHead` computes both in chunks, never holding [tokens, vocab] logits; a
    plain Hugging Face model (tests, tools) goes through its full logits. Padded rows must be
    right-padded (positions then count from 0 in every row).

    `image_inputs`: a vision-language model's image tensors, concatenated over the images in the
    order of their placeholder tokens in `input_ids` read row by row (molt.trainer.batch.MicroBatch.image_inputs).
    """
    targets = torch.roll(input_ids, -1, dims=-1)  # position t predicts token t + 1
    if isinstance(temperature, torch.Tensor):
        if temperature.shape != input_ids.shape:
            raise ValueError(f"temperature must be one number or [rows, len] = {tuple(input_ids.shape)} like "
                             f"input_ids, got {tuple(temperature.shape)}")
        temperature = torch.roll(temperature, -1, dims=-1)  # ...at the temperature token t + 1 was sampled at
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    if image_inputs:
        inputs.update(format_image_inputs(model.config, image_inputs))
    head = model.get_output_embeddings()
    if isinstance(head, ScoringHead):
        head.request = (targets, temperature, with_entropy)
        try:
            scores = model(**inputs).logits  # [rows, len, 1 or 2]
        finally:
            head.request = None
        logprobs, entropy = scores[..., 0], scores[..., 1] if with_entropy else None
    else:
        check_temperature(temperature)
        logits = model(**inputs).logits
        divisor = temperature.unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / divisor
        logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        entropy = token_entropy_from_logits(logits) if with_entropy else None
    return _align(logprobs, position_ids), _align(entropy, position_ids) if with_entropy else None


def _align(per_position: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """Shift what position t computed for token t + 1 onto column t + 1; 0 at sequence starts."""
    shifted = F.pad(per_position[..., :-1], (1, 0))
    return shifted if position_ids is None else shifted.masked_fill(position_ids == 0, 0.0)


def compute_token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                           temperature: float) -> torch.Tensor:
    """[batch, seq] log p(input_ids[:, t] | input_ids[:, :t]) of right-padded rows; column 0 is 0."""
    return score_tokens(model, input_ids, attention_mask=attention_mask, temperature=temperature)[0]


def score_micro_batch(model: nn.Module, micro_batch: MicroBatch, *,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`score_tokens` of a micro-batch, padded or packed, as [batch, seq] rows, each token at the
    temperature it was sampled at (`MicroBatch.temperatures`)."""
    logprobs, entropy = score_tokens(model, temperature=micro_batch.model_temperatures(), with_entropy=with_entropy,
                                     **micro_batch.model_inputs())
    return micro_batch.to_rows(logprobs), micro_batch.to_rows(entropy) if with_entropy else None
