"""What the engine sampled, as one call's result or a stream's steps: token ids, their log-probs, the
policy version of each token and the routed experts (DESIGN section 2.4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class Generation:
    """What one generation call sampled."""

    token_ids: list[int]  # [response_tokens]
    logprobs: list[float]  # [response_tokens] log-prob of each sampled token at the sampling temperature
    policy_versions: list[int]  # [response_tokens] weight version that sampled each token
    finish_reason: str  # 'stop' | 'length' | 'abort'
    # Routed experts of the prompt and the response (molt.trace.routes), -1 where not computed; None
    # when capture is off or the model is dense.
    routed_experts: torch.Tensor | None = None  # [prompt + response tokens, layers, top_k] int16

    @property
    def policy_version(self) -> int:
        """The version the call started under (-1 if it sampled nothing): that of every token unless a
        partial-rollout refit landed mid-call, and then the oldest, so a lag computed from it is never
        understated."""
        return self.policy_versions[0] if self.policy_versions else -1


@dataclass(kw_only=True)
class GenerationDelta:
    """What one engine step added to a streamed generation."""

    token_ids: list[int]  # [new_tokens]
    logprobs: list[float]  # [new_tokens]
    text: str  # detokenized text of the new tokens
    finish_reason: str | None  # set on the last delta: 'stop' | 'length' | 'abort'
    # On the last delta only (vLLM reports versions when a request finishes): the weight version
    # that sampled each token of the WHOLE generation, [response_tokens]; None on earlier deltas.
    policy_versions: list[int] | None = None
    stop_reason: str | int | None = None  # on the last delta: the stop string (or token id) that ended it
    # When asked (top_logprobs=k): per new token, the k most likely tokens as (id, log-prob), best first.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # On the last delta only: as Generation.routed_experts, for the whole prompt and response.
    routed_experts: torch.Tensor | None = None  # [prompt + response tokens, layers, top_k] int16
