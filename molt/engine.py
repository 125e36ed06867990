"""The vLLM engine on a rollout rank: generation with token ids and log-probs, pause/resume, refit hooks."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
import logging
import os
from dataclasses import dataclass

from molt.agents.base import SamplingParams
from molt.config import MoltConfig

logger = logging.getLogger("molt")

WORKER_EXTENSION = "molt.refit_receiver.RefitReceiver"


@dataclass(kw_only=True)
class Generation:
    """What one generation call sampled."""

    token_ids: list[int]  # [response_tokens]
    logprobs: list[float]  # [response_tokens] log-prob of each sampled token at the sampling temperature
    policy_version: int  # weight version that sampled every token of this call
    finish_reason: str  # 'stop' | 'length' | 'abort'


@dataclass(kw_only=True)
class GenerationDelta:
    """What one engine step added to a streamed generation."""

    token_ids: list[int]  # [new_tokens]
    logprobs: list[float]  # [new_tokens]
    text: str  # detokenized text of the new tokens
    policy_version: int
    finish_reason: str | None  # set on the last delta: 'stop' | 'length' | 'abort'


class EngineStartError(RuntimeError):
    """The engine could not be built from the configured model."""


class RolloutEngine:
    """One vLLM AsyncLLM (engine core in its own process) plus Molt's weight version."""

    def __init__(self, llm, tokenizer):
        self.llm = llm
        self.tokenizer = tokenizer
        self.policy_version = 0
        self._request_ids = itertools.count()

    @classmethod
    def start(cls, cfg: MoltConfig, *, seed: int) -> RolloutEngine:
        """Build the engine; raises EngineStartError naming the model path on failure."""
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if cfg.rollout.engine_threads > 0:
            os.environ.setdefault("OMP_NUM_THREADS", str(cfg.rollout.engine_threads))
        args = AsyncEngineArgs(
            model=cfg.model.path,
            dtype=cfg.model.dtype,
            seed=seed,
            max_model_len=cfg.rollout.max_length,
            gpu_memory_utilization=cfg.rollout.engine_memory_fraction,
            tensor_parallel_size=cfg.layout.engine_tensor_parallel_size,
            enforce_eager=cfg.rollout.enforce_eager,
            # Behaviour log-probs must be those of the distribution actually sampled from
            # (after temperature), because the trainer recomputes them at that temperature.
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
        )
        try:
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
            llm = AsyncLLM.from_engine_args(args)
        except Exception as error:
            raise EngineStartError(
                f"vLLM could not load model.path={cfg.model.path!r}: {type(error).__name__}: {error}. "
                f"Check that it is a Hugging Face model directory of an architecture vLLM supports "
                f"(tools/make_tiny_model.py writes one)") from error
        return cls(llm, tokenizer)

    async def generate(self, token_ids: list[int], sampling: SamplingParams) -> Generation:
        """The whole generation at once (one engine output, not one per step)."""
        sampled, logprobs, version, finish_reason = [], [], self.policy_version, None
        async for delta in self.stream(token_ids, sampling, incremental=False):
            sampled += delta.token_ids
            logprobs += delta.logprobs
            version, finish_reason = delta.policy_version, delta.finish_reason or finish_reason
        return Generation(token_ids=sampled, logprobs=logprobs, policy_version=version,
                          finish_reason=finish_reason or "abort")

    async def stream(self, token_ids: list[int], sampling: SamplingParams, *, stop: list[str] | None = None,
                     seed: int | None = None, incremental: bool = True) -> AsyncIterator[GenerationDelta]:
        """Generate, yielding what each engine step added (`incremental`), or everything as one
        delta at the end, which spares the per-step outputs when no one reads them as they come.
        Closing the iterator early (e.g. the HTTP client went away) aborts the engine request."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = VllmSamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                    top_p=sampling.top_p, logprobs=0, stop=stop, seed=seed,
                                    output_kind=RequestOutputKind.DELTA if incremental else RequestOutputKind.FINAL_ONLY)
        version = self.policy_version
        async for output in self.llm.generate(TokensPrompt(prompt_token_ids=list(token_ids)), params,
                                              request_id=f"molt-stream-{next(self._request_ids)}"):
            completion = output.outputs[0]
            sampled = list(completion.token_ids)
            yield GenerationDelta(
                token_ids=sampled, logprobs=[float(step[token].logprob) for token, step in zip(sampled, completion.logprobs or [])],
                text=completion.text, policy_version=version,
                finish_reason=completion.finish_reason if output.finished else None)

    async def score(self, token_ids: list[int]) -> list[float]:
        """Log-prob of each token given its prefix at temperature 1 (first entry 0): the refit check."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        params = VllmSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        final = None
        async for output in self.llm.generate(TokensPrompt(prompt_token_ids=list(token_ids)), params,
                                              request_id=f"molt-score-{next(self._request_ids)}"):
            final = output
        return [0.0] + [float(step[token].logprob) for token, step in zip(token_ids[1:], final.prompt_logprobs[1:])]

    async def join_refit_group(self, **kwargs) -> None:
        await self.llm.collective_rpc("molt_join_refit_group", kwargs=kwargs)

    async def receive_weights(self, version: int) -> None:
        """Receive one refit broadcast and load it; generation must be paused by the caller."""
        await self.llm.collective_rpc("molt_receive_weights")
        self.policy_version = version

    async def leave_refit_group(self) -> None:
        await self.llm.collective_rpc("molt_leave_refit_group")

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            # Drop the last reference now: vLLM's __del__ shuts down again, and at interpreter
            # exit (modules half torn down) that second shutdown raises.
            self.llm = None
