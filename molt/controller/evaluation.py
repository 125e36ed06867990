"""Evaluation of the policy on a fixed prompt set: the eval set, its rollout requests, and the
metrics of their outcomes (avg@k, pass@k).

The same agent file judges eval rollouts as training ones; only the sampling differs (eval.*).
During training the controller sends the requests to the rollout ranks and collects the outcomes
apart from training's: an eval rollout is never an experience, never in a payload store and never
in the rollout accounting (molt.controller.pool). `python -m molt.eval` runs the same requests on one
engine of its own.

Each eval sample carries its own sampling seed, a function of the run's seed, the prompt's
position in the eval set and the sample's index (not of the step): every eval draws the same
random numbers, so what changes between two evals is the policy, and an eval leaves the
engine's seeds of training requests where they were.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from dataclasses import dataclass, field

from molt.agents.base import RolloutOutcome
from molt.config import ConfigError, MoltConfig
from molt.controller.prompts import PromptRow, load_field_rows

EVAL_SEED_SALT = 0x6576616C  # keeps eval seeds apart from other seeds derived from the run's seed


def split_eval_rows(cfg: MoltConfig, rows: list[PromptRow]) -> tuple[list[PromptRow], list[PromptRow]]:
    """(training rows, eval rows) from data.train_path's `rows`. eval.holdout_rows takes that many
    rows out of training, chosen by the run's seed; they keep their file index (PromptRow.index).
    eval.data_path reads its own file and leaves training whole. eval.max_prompts keeps the first."""
    evaluation = cfg.eval
    rows = [row if row.index >= 0 else dataclasses.replace(row, index=index) for index, row in enumerate(rows)]
    if evaluation.holdout_rows:
        if evaluation.holdout_rows + cfg.rollout.prompts_per_step > len(rows):
            raise ConfigError(f"eval.holdout_rows={evaluation.holdout_rows} leaves {len(rows) - evaluation.holdout_rows} "
                              f"of data.train_path's {len(rows)} rows for training, fewer than "
                              f"rollout.prompts_per_step={cfg.rollout.prompts_per_step}: hold out fewer rows")
        held = set(random.Random(cfg.seed).sample(range(len(rows)), evaluation.holdout_rows))
        training = [row for position, row in enumerate(rows) if position not in held]
        eval_rows = [row for position, row in enumerate(rows) if position in held]
    elif evaluation.data_path:
        training = rows
        eval_rows = load_field_rows("eval.data_path", evaluation.data_path)
    else:
        training, eval_rows = rows, []
    if evaluation.max_prompts:
        eval_rows = eval_rows[:evaluation.max_prompts]
    return training, eval_rows


def eval_sample_seed(run_seed: int, prompt_position: int, sample_index: int) -> int:
    """The sampling seed of one eval sample (SamplingParams.seed); the engine mixes it with each
    request's prompt ids (molt.rollout.engine.rollout_request_seed)."""
    return hash((run_seed, EVAL_SEED_SALT, prompt_position, sample_index)) & (2**63 - 1)


def build_rollout_request(cfg: MoltConfig, row: PromptRow, *, group_id: int, sample_index: int, sampling: dict,
                          policy_version: int) -> dict:
    """One rollout request as the wire carries it, without its rollout_id: the row's prompt, the
    `sampling` settings (molt.rollout.engine's SamplingParams) and the run's length and turn limits.
    Training's (molt.controller.pool) and the eval's requests differ only in their ids and sampling."""
    return {"group_id": group_id, "sample_index": sample_index,
            "messages": row.messages, "label": row.label, "tools": row.tools, "sampling": sampling,
            "max_length": cfg.rollout.max_length, "max_turns": cfg.agent.max_turns,
            "policy_version": policy_version, "metadata": row.metadata, "images": row.images}


def build_eval_requests(cfg: MoltConfig, rows: list[PromptRow], policy_version: int) -> list[dict]:
    """One rollout request (the wire dict, without rollout_id) per eval sample: eval.n_samples per
    row, the row's position as group_id, the eval sampling settings and the sample's seed."""
    evaluation = cfg.eval
    max_tokens = evaluation.max_response_tokens or cfg.rollout.max_response_tokens
    return [build_rollout_request(cfg, row, group_id=position, sample_index=sample_index, policy_version=policy_version,
                                  sampling={"max_tokens": max_tokens, "temperature": evaluation.temperature,
                                            "top_p": evaluation.top_p,
                                            "seed": eval_sample_seed(cfg.seed, position, sample_index)})
            for position, row in enumerate(rows) for sample_index in range(evaluation.n_samples)]


@dataclass(kw_only=True)
class EvalSample:
    """What one eval rollout scored (a failed one scores 0 and solves nothing)."""

    prompt_position: int  # position in the eval set
    sample_index: int
    reward: float  # the rollout's reward (each of its segments carries it)
    num_response_tokens: int  # tokens the policy sampled, over all turns
    truncated: bool
    failure: str = ""  # '' or the rollout's failure reason
    response_token_ids: list[int] = field(default_factory=list)  # the sampled tokens, in order

    def to_dict(self) -> dict:
        return dict(vars(self))


def sample_from_outcome(outcome: RolloutOutcome, sample_index: int) -> EvalSample:
    """An eval outcome (group_id = the prompt's position) as an EvalSample."""
    experiences = outcome.experiences
    if outcome.failure or not experiences:
        return EvalSample(prompt_position=outcome.group_id, sample_index=sample_index, reward=0.0,
                          num_response_tokens=0, truncated=False, failure=outcome.failure or "no_experience")
    response = [token for e in experiences for token, is_action in zip(e.token_ids, e.action_mask) if is_action]
    return EvalSample(prompt_position=outcome.group_id, sample_index=sample_index, reward=experiences[0].reward,
                      num_response_tokens=len(response), truncated=any(e.truncated for e in experiences),
                      response_token_ids=response)


def pass_at(num_samples: int, num_correct: int, j: int) -> float:
    """Unbiased pass@j of one prompt from n samples with c correct: 1 - C(n-c, j) / C(n, j)
    (Chen et al. 2021, arXiv:2107.03374); with j = n, 1 if any sample is correct."""
    if num_samples - num_correct < j:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, j) / math.comb(num_samples, j)


def compute_eval_metrics(samples: list[EvalSample], *, k: int, success_threshold: float) -> dict[str, float]:
    """eval/avg@k (mean reward over every sample), eval/pass@1 and eval/pass@k (mean over prompts of
    the unbiased estimate), response length, truncated and failed shares, prompt and sample counts."""
    by_prompt: dict[int, list[EvalSample]] = {}
    for sample in samples:
        by_prompt.setdefault(sample.prompt_position, []).append(sample)
    correct = {position: sum(s.reward >= success_threshold for s in group) for position, group in by_prompt.items()}
    metrics = {
        f"eval/avg@{k}": statistics.fmean(s.reward for s in samples) if samples else math.nan,
        "eval/response_length_mean": statistics.fmean(s.num_response_tokens for s in samples) if samples else math.nan,
        "eval/truncated_share": statistics.fmean(s.truncated for s in samples) if samples else math.nan,
        "eval/failed": float(sum(bool(s.failure) for s in samples)),
        "eval/num_prompts": float(len(by_prompt)),
        "eval/num_samples": float(len(samples)),
    }
    for j in sorted({1, k}):
        estimates = [pass_at(len(by_prompt[p]), correct[p], j) for p in by_prompt if len(by_prompt[p]) >= j]
        metrics[f"eval/pass@{j}"] = statistics.fmean(estimates) if estimates else math.nan
    return metrics


@dataclass
class EvalRun:
    """One evaluation in flight on the rollout ranks: which rollout ids are its, and what came back."""

    step: int  # training steps the evaluated policy has had
    policy_version: int
    started: float  # time.monotonic() at dispatch
    sample_indices: dict[int, int] = field(default_factory=dict)  # rollout id -> sample index, until back
    samples: list[EvalSample] = field(default_factory=list)

    def take(self, outcome: RolloutOutcome) -> None:
        self.samples.append(sample_from_outcome(outcome, self.sample_indices.pop(outcome.rollout_id)))

    @property
    def done(self) -> bool:
        return not self.sample_indices
