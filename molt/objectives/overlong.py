"""DAPO's overlong reward shaping (Yu et al. 2025, "DAPO", arXiv:2503.14476, section 3.4).

A response cut at the length limit gets a reward for an answer it never finished; DAPO either masks
such samples out of the loss (overlong filtering: a zeroed action mask, applied by the learner) or
shapes the reward by length (soft overlong punishment, here). Lengths are per generation, as the
limit (rollout.max_response_tokens) is: a rollout's length is its longest response.
"""

from __future__ import annotations

import torch
from torch import Tensor


def compute_longest_response(action_mask: Tensor) -> Tensor:
    """[batch] long: each row's longest run of consecutive action tokens, from [batch, seq].

    A run is one generation: a turn's context (tool result, template text) sits between two
    generations, and partial rollout continues a generation in place, so it stays one run.
    """
    if action_mask.shape[-1] == 0:
        return torch.zeros(action_mask.shape[:-1], dtype=torch.long, device=action_mask.device)
    is_action = action_mask > 0
    positions = torch.arange(action_mask.shape[-1], device=action_mask.device).expand_as(action_mask)
    # The last non-action position at or before each position (-1 before the first one).
    last_gap = torch.where(is_action, torch.full_like(positions, -1), positions).cummax(dim=-1).values
    run_lengths = torch.where(is_action, positions - last_gap, torch.zeros_like(positions))
    return run_lengths.max(dim=-1).values


def compute_overlong_penalty(
    response_lengths: Tensor, *, max_response_tokens: int, buffer_tokens: int, factor: float = 1.0
) -> Tensor:
    """[...] float64 soft overlong punishment (DAPO eq. 13), added to each rollout's reward.

    With L_max = `max_response_tokens`, L_cache = `buffer_tokens` and |y| = `response_lengths`:
    0 while |y| <= L_max - L_cache, then ((L_max - L_cache) - |y|) / L_cache * factor, falling
    linearly to -factor at L_max, and -factor beyond. `buffer_tokens` = 0 turns it off (all 0).
    """
    if not 0 <= buffer_tokens <= max_response_tokens or factor < 0:
        raise ValueError(f"need 0 <= buffer_tokens <= max_response_tokens and factor >= 0, got buffer_tokens="
                         f"{buffer_tokens}, max_response_tokens={max_response_tokens}, factor={factor}")
    lengths = response_lengths.to(torch.float64)
    if buffer_tokens == 0:
        return torch.zeros_like(lengths)
    expected = max_response_tokens - buffer_tokens
    return ((expected - lengths) / buffer_tokens * factor).clamp(min=-factor, max=0.0)
