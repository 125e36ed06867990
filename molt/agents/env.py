"""The Env path: the framework generates, the user's Env judges each step (DESIGN section 3)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from molt.agents.base import (AgentRunnerBase, BadResult, ContextExhausted, Result, RolloutOutcome, RolloutRequest,
                              Sampler, SamplingParams)
from molt.trace.experience import Experience, Segment, compute_action_digest
from molt.trace.images import ImageEncoder, ImageInputs, load_image_bytes, row_messages

logger = logging.getLogger("molt")


@dataclass(kw_only=True)
class StepState:
    """What an Env sees at each step."""

    observation_text: str  # the conversation so far, as the policy saw it (rendered chat text)
    action_text: str  # this turn's sampled text, special tokens removed
    label: str
    turn: int  # 0-based
    sampling_params: SamplingParams
    metadata: dict | None = None  # the prompt row's `metadata`, as written in the prompt file


class Env:
    """Subclass and implement `step`. A fresh instance is made for every rollout."""

    async def step(self, state: StepState) -> Result:
        raise NotImplementedError


class StepEnvRunner(AgentRunnerBase):
    """Drives an Env: render the prompt, generate, let the Env judge, append its observation, repeat."""

    def __init__(self, env_class: type[Env]):
        if not (isinstance(env_class, type) and issubclass(env_class, Env)):
            raise TypeError(f"StepEnvRunner needs an Env subclass, got {env_class!r}")
        self.env_class = env_class
        self._observation_templates: dict[tuple[int, int], tuple[str, str]] = {}
        self._image_encoder: ImageEncoder | None = None  # the model's processor, at the first image

    async def run(self, request: RolloutRequest, sampler: Sampler, tokenizer) -> RolloutOutcome:
        trace = Segment()
        messages, row_blobs = row_messages(request.messages, request.images)
        prompt_text = tokenizer.apply_chat_template(
            messages, tools=request.tools, add_generation_prompt=True, tokenize=False)
        trace.add_context(*self._expand(tokenizer, tokenizer.encode(prompt_text, add_special_tokens=False), row_blobs))
        if len(trace.token_ids) >= request.max_length:
            raise PromptTooLong(f"the prompt has {len(trace.token_ids)} tokens; rollout.max_length is "
                                f"{request.max_length}: raise it or shorten the prompt")
        env = self.env_class()
        total_reward, total_score, info = 0.0, 0.0, {}
        observation_text, truncated = prompt_text, False
        for turn in range(request.max_turns):
            budget = min(request.sampling.max_tokens, request.max_length - len(trace.token_ids))
            if budget <= 0:
                truncated = True
                break
            sampling = SamplingParams(max_tokens=budget, temperature=request.sampling.temperature,
                                      top_p=request.sampling.top_p, seed=request.sampling.seed)
            # A text-only rollout calls the sampler as before images (a test's sampler need not take them).
            images = {"images": trace.images.for_engine()} if trace.images else {}
            generation = await sampler.generate(trace.token_ids, sampling, **images)
            trace.add_action(generation.token_ids, generation.logprobs, generation.policy_versions,
                             temperature=request.sampling.temperature, routes=generation.routed_experts)
            action_text = tokenizer.decode(generation.token_ids, skip_special_tokens=True)
            result = await env.step(StepState(observation_text=observation_text, action_text=action_text,
                                              label=request.label, turn=turn, sampling_params=sampling,
                                              metadata=request.metadata))
            if not isinstance(result, Result):
                raise BadResult(f"{self.env_class.__name__}.step returned {type(result).__name__}, "
                                 f"not molt.agents.Result; return Result(reward=...)")
            total_reward += float(result.reward)
            total_score += float(result.reward if result.score is None else result.score)
            info.update({k: float(v) for k, v in result.info.items()})
            truncated = result.truncated or generation.finish_reason == "length"
            if result.terminated or result.truncated:
                break
            shown = [load_image_bytes(image, where=f"{self.env_class.__name__}.step's Result.images[{index}]",
                                      file_root="/") for index, image in enumerate(result.images or [])]
            context_text = self._render_observation(tokenizer, result.observation, len(shown))
            context_ids, images = self._expand(tokenizer, tokenizer.encode(context_text, add_special_tokens=False), shown)
            if len(trace.token_ids) + len(context_ids) >= request.max_length:
                truncated = True  # no room left for the observation and another response
                break
            observation_text += tokenizer.decode(generation.token_ids, skip_special_tokens=False) + context_text
            trace.add_context(context_ids, images)
        else:
            truncated = True  # ran out of turns without the Env terminating
        experience = Experience(
            token_ids=trace.token_ids, action_mask=trace.action_mask, behavior_logprobs=trace.logprobs,
            policy_versions=trace.versions, routed_experts=trace.routes_or_none(), images=trace.images,
            reward=total_reward,
            score=total_score, group_id=request.group_id, rollout_id=request.rollout_id, truncated=truncated,
            info=info, action_digest=compute_action_digest(trace.token_ids, trace.action_mask))
        return RolloutOutcome(rollout_id=request.rollout_id, group_id=request.group_id, experiences=[experience])

    def _expand(self, tokenizer, token_ids: list[int], blobs: list[bytes]) -> tuple[list[int], ImageInputs | None]:
        """Rendered ids with each image placeholder expanded by the model's processor (molt.trace.images)."""
        if not blobs:
            return token_ids, None
        if self._image_encoder is None:
            self._image_encoder = ImageEncoder(tokenizer.name_or_path)
        return self._image_encoder.expand(token_ids, blobs)

    def _render_observation(self, tokenizer, observation: str, num_images: int = 0) -> str:
        """Text the chat template puts after an assistant turn's end token for a user `observation`
        shown after `num_images` images, up to and including the next generation prompt. Derived
        from the template once per image count, so the appended context matches what the template
        would render for the whole conversation."""
        key = (id(tokenizer), num_images)
        if key not in self._observation_templates:
            marker = "\x00OBSERVATION\x00"
            history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
            before = tokenizer.apply_chat_template(history, tokenize=False)
            content = [{"type": "image"}] * num_images + [{"type": "text", "text": marker}] if num_images else marker
            after = tokenizer.apply_chat_template(
                history + [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
            if not after.startswith(before):
                raise ValueError("the chat template re-renders earlier turns when a user turn is added; "
                                 "multi-turn Envs need a prefix-preserving template")
            eos_text = tokenizer.eos_token or ""
            tail = before[before.rfind(eos_text) + len(eos_text):] if eos_text and eos_text in before else ""
            self._observation_templates[key] = tuple((tail + after[len(before):]).split(marker, 1))
        head, rest = self._observation_templates[key]
        return head + observation + rest


class PromptTooLong(ValueError):
    """The rendered prompt leaves no room for a response within max_length."""


async def run_with_timeout(runner: AgentRunnerBase, request: RolloutRequest, sampler: Sampler, tokenizer,
                           timeout_seconds: float) -> RolloutOutcome:
    """Run one rollout; a timeout, an exception or a bad return value becomes a failed outcome."""
    def failed(reason: str, error: BaseException | str) -> RolloutOutcome:
        return RolloutOutcome(rollout_id=request.rollout_id, group_id=request.group_id, experiences=[],
                              failure=reason, error=str(error))
    try:
        outcome = await asyncio.wait_for(runner.run(request, sampler, tokenizer), timeout_seconds)
    except asyncio.TimeoutError:
        return failed("timeout", f"rollout exceeded agent.rollout_timeout_seconds={timeout_seconds}")
    except BadResult as error:
        return failed("bad_result", error)
    except ContextExhausted as error:
        return failed("context_exhausted", error)
    except PromptTooLong as error:
        return failed("prompt_too_long", error)
    except Exception as error:  # user code: any exception fails this rollout only
        logger.debug("rollout %d failed", request.rollout_id, exc_info=True)
        return failed("agent_error", f"{type(error).__name__}: {error}")
    if not outcome.failure and not any(sum(e.action_mask) for e in outcome.experiences):
        return failed("no_generation", "the agent never called the model")
    return outcome
