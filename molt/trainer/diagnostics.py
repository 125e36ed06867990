"""Consistency diagnostics of every training step, for every model: does the trainer train on what
the engine sampled, and how far apart are their numbers?

- token alignment: the ids the model receives equal the micro-batch's ids at every action token
  (`count_model_input_mismatches`), and the micro-batch's action ids equal the ones the engine
  sampled, checked by the fingerprint the trace carries (`Experience.action_digest`,
  `count_digest_mismatches`). Both counts must be 0.
- numerical consistency: |trainer - behaviour| log-prob of each action token in the forward before
  the step's first update, as a histogram over fixed log-spaced bins per entropy bucket of the
  trainer's distribution (quantiles are read off it), its max, and the mismatch KL.
- named (matched, total) counts from others (route alignment, R3 coverage) as ratios.

`StepDiagnostics` collects a step's share on each rank and `reduce`s it over the data-parallel group
in two all-reduces of fixed size (MAX, then SUM), so every rank runs the same collectives.
`DropWatcher` turns a sudden fall of a ratio into a warning that names the step.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from molt.objectives import compute_kl_estimate
from molt.trace.experience import Experience, compute_action_digest
from molt.trainer.batch import MicroBatch

logger = logging.getLogger("molt")

PREFIX = "diagnostics/"

# Entropy buckets of the trainer's distribution at the action token, in nats. Near-greedy tokens
# (< 0.1) are most of a trained model's tokens and should agree almost exactly; a kernel or dtype
# mismatch shows first among the uncertain ones (> 1 nat, where many logits are close), so the
# buckets split the low end finely and keep the long tail in one.
ENTROPY_EDGES = (0.1, 0.5, 1.0, 2.0)
ENTROPY_BUCKETS = ("0-0.1", "0.1-0.5", "0.5-1", "1-2", "2-inf")

# |trainer - behaviour| log-prob bins: [0, 1e-7), then 20 per decade up to 100, then [100, inf).
# float32 log-probs agree to ~1e-7 at best and a gap of 100 nats is already a broken run, so
# nothing of interest falls outside. A quantile is the upper edge of its bin (capped at the
# bucket's exact max): at most a factor 10^(1/20) = 1.122 above the true value.
DIFF_FLOOR, DIFF_CEILING, BINS_PER_DECADE = 1e-7, 1e2, 20
DIFF_BOUNDARIES = torch.logspace(math.log10(DIFF_FLOOR), math.log10(DIFF_CEILING),
                                 BINS_PER_DECADE * round(math.log10(DIFF_CEILING / DIFF_FLOOR)) + 1,
                                 dtype=torch.float64)  # [181] inner edges
NUM_DIFF_BINS = len(DIFF_BOUNDARIES) + 1  # with the underflow and overflow bins
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}

# Ratios whose sudden fall the trainer warns about (DropWatcher); absent ones are skipped.
WATCHED_RATIOS = (PREFIX + "route_alignment", PREFIX + "r3_coverage")  # fed by molt.trainer.routing_replay


@dataclass(kw_only=True)
class DiagnosticsReport:
    """A step's diagnostics over all data-parallel ranks: scalars for the JSONL and W&B under
    `diagnostics/`, and per entropy bucket the |diff| histogram for W&B."""

    metrics: dict[str, float]
    histograms: dict[str, tuple[list[float], list[float]]]  # name -> (counts, bin edges in log10 |diff|)


class StepDiagnostics:
    """One step's diagnostics on one rank, fed per micro-batch, then `reduce`d (collective)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.histogram = torch.zeros(len(ENTROPY_BUCKETS), NUM_DIFF_BINS, dtype=torch.float64,
                                     device=device)  # [entropy buckets, diff bins] action tokens
        self.bucket_max = torch.zeros(len(ENTROPY_BUCKETS), dtype=torch.float64, device=device)  # [buckets]
        self.kl_sum = torch.zeros((), dtype=torch.float64, device=device)
        # Both token checks on every rank, so the reduction's layout never depends on what a rank saw.
        self.sums: dict[str, torch.Tensor] = {name: torch.zeros((), dtype=torch.float64, device=device)
                                              for name in ("token_mismatches", "model_input_mismatches")}
        self.counts: dict[str, torch.Tensor] = {}  # name -> [matched, total]
        self.entropy_edges = torch.tensor(ENTROPY_EDGES, dtype=torch.float64, device=device)
        self.diff_boundaries = DIFF_BOUNDARIES.to(device)

    def add_logprobs(self, trainer_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, entropy: torch.Tensor,
                     action_mask: torch.Tensor) -> None:
        """One micro-batch's [batch, seq] log-probs (trainer, before the step's first update, and
        behaviour), the trainer distribution's entropy and the action mask."""
        mask = action_mask > 0
        trainer = trainer_logprobs.detach()[mask].to(torch.float64)  # [action tokens]
        behaviour = behavior_logprobs[mask].to(torch.float64)  # [action tokens]
        diff = (trainer - behaviour).abs().nan_to_num(nan=math.inf)  # a NaN lands in the overflow bin and the max
        bucket = torch.bucketize(entropy.detach()[mask].to(torch.float64).nan_to_num(nan=math.inf),
                                 self.entropy_edges, right=True)
        bins = torch.bucketize(diff, self.diff_boundaries, right=True)
        self.histogram.view(-1).index_add_(0, bucket * NUM_DIFF_BINS + bins, torch.ones_like(diff))
        self.bucket_max.scatter_reduce_(0, bucket, diff, reduce="amax")
        # KL(behaviour || trainer), k3, on tokens the behaviour policy sampled (as train/mismatch_kl).
        self.kl_sum += compute_kl_estimate(behaviour, trainer, estimator="k3").nan_to_num(nan=math.inf).sum()

    def add_sum(self, name: str, value: torch.Tensor | float) -> None:
        """Add to the count reported as `diagnostics/<name>`, summed over micro-batches and ranks."""
        total = self.sums.setdefault(name, torch.zeros((), dtype=torch.float64, device=self.device))
        total += torch.as_tensor(value, dtype=torch.float64, device=self.device)

    def add_counts(self, name: str, matched: torch.Tensor | float, total: torch.Tensor | float) -> None:
        """Add (matched, total) to the ratio reported as `diagnostics/<name>` (matched / total over
        micro-batches and ranks; left out where the total is 0). Every rank must add the same names
        (add 0, 0 where it has nothing): `reduce` checks."""
        pair = self.counts.setdefault(name, torch.zeros(2, dtype=torch.float64, device=self.device))
        pair += torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in (matched, total)])

    def check_model_inputs(self, micro_batch: MicroBatch) -> None:
        """Count action tokens whose id as the model receives it differs from the micro-batch's."""
        self.add_sum("model_input_mismatches", count_model_input_mismatches(micro_batch))

    def reduce(self, group: dist.ProcessGroup) -> DiagnosticsReport:
        """The step's diagnostics over `group` (the data-parallel group: tp ranks share their data)."""
        sum_names, count_names = sorted(self.sums), sorted(self.counts)
        layout = zlib.crc32("\0".join(sum_names + ["|"] + count_names).encode())
        # MAX of (n, -n) gives every rank the max and min: unequal names would mismatch the SUM's sizes.
        maxima = torch.cat([self.bucket_max, torch.tensor([layout, -layout], dtype=torch.float64, device=self.device)])
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        if maxima[-2].item() != -maxima[-1].item():
            raise RuntimeError(f"diagnostics: ranks added different names (this rank: sums {sum_names}, counts "
                               f"{count_names}); every rank must add the same names, 0 where it has nothing")
        parts = [self.histogram.view(-1), self.kl_sum.view(1), *(self.sums[n].view(1) for n in sum_names),
                 *(self.counts[n] for n in count_names)]
        totals = torch.cat(parts)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
        histogram = totals[:self.histogram.numel()].view_as(self.histogram).cpu()
        rest = totals[self.histogram.numel():].tolist()
        metrics = summarize_histogram(histogram, maxima[:len(ENTROPY_BUCKETS)].cpu())
        num_tokens = histogram.sum().item()
        if num_tokens:
            metrics[PREFIX + "mismatch_kl"] = rest[0] / num_tokens
        metrics.update({PREFIX + name: value for name, value in zip(sum_names, rest[1:])})
        pairs = rest[1 + len(sum_names):]
        for index, name in enumerate(count_names):
            matched, total = pairs[2 * index: 2 * index + 2]
            if total:
                metrics[PREFIX + name] = matched / total
        return DiagnosticsReport(metrics=metrics, histograms=histogram_charts(histogram))


def summarize_histogram(histogram: torch.Tensor, bucket_max: torch.Tensor) -> dict[str, float]:
    """Quantiles, max and counts of |diff|, over all action tokens and per entropy bucket, from the
    summed [buckets, bins] histogram and each bucket's exact max (quantiles and max only where
    there are tokens)."""
    metrics = {PREFIX + "logprob_diff_count": histogram.sum().item()}
    if histogram.sum():
        metrics[PREFIX + "logprob_diff_max"] = bucket_max.max().item()
    overall = {f"{PREFIX}logprob_diff_{name}": value
               for name, value in histogram_quantiles(histogram.sum(dim=0), bucket_max.max().item()).items()}
    metrics.update(overall)
    for index, bucket in enumerate(ENTROPY_BUCKETS):
        name = f"{PREFIX}logprob_diff_by_entropy/{bucket}/"
        metrics[name + "count"] = histogram[index].sum().item()
        for quantile, value in histogram_quantiles(histogram[index], bucket_max[index].item()).items():
            metrics[name + quantile] = value
    return metrics


def histogram_quantiles(counts: torch.Tensor, exact_max: float) -> dict[str, float]:
    """QUANTILES of |diff| from one [bins] histogram: the upper edge of the bin where the cumulative
    count reaches the quantile, capped at `exact_max`; none for an empty histogram (its count says 0,
    and the JSONL would only get nulls)."""
    total = counts.sum().item()
    if not total:
        return {}
    cumulative = counts.cumsum(0)
    upper_edges = torch.cat([DIFF_BOUNDARIES, torch.tensor([math.inf], dtype=torch.float64)])
    result = {}
    for name, q in QUANTILES.items():
        index = int(torch.searchsorted(cumulative, torch.tensor(q * total, dtype=cumulative.dtype)).item())
        result[name] = min(upper_edges[min(index, NUM_DIFF_BINS - 1)].item(), exact_max)
    return result


def histogram_charts(histogram: torch.Tensor) -> dict[str, tuple[list[float], list[float]]]:
    """Per entropy bucket, (counts, edges) of log10 |diff| for a W&B histogram: the open-ended
    underflow and overflow bins drawn one bin wide below the floor and above the ceiling."""
    low, high = math.log10(DIFF_FLOOR), math.log10(DIFF_CEILING)
    step = 1.0 / BINS_PER_DECADE
    inner = torch.log10(DIFF_BOUNDARIES).tolist()
    edges = [low - step, *inner, high + step]
    return {f"{PREFIX}log10_logprob_diff_by_entropy/{bucket}": (histogram[index].tolist(), edges)
            for index, bucket in enumerate(ENTROPY_BUCKETS)}


def count_model_input_mismatches(micro_batch: MicroBatch) -> torch.Tensor:
    """Action tokens whose id, as the model receives it (`model_inputs()`, packed or padded, mapped
    back to rows by `to_rows`), differs from the micro-batch's `input_ids` (a scalar tensor)."""
    received = micro_batch.to_rows(micro_batch.model_inputs()["input_ids"])
    return ((received != micro_batch.input_ids) & (micro_batch.action_mask > 0)).sum()


def count_digest_mismatches(micro_batches: Iterable[MicroBatch],
                            experiences: list[Experience]) -> tuple[int, list[int]]:
    """Action tokens of the micro-batches' rows whose ids and positions do not hash to their
    experience's `action_digest` (the engine's sampled ids, fingerprinted where the trace was
    made), all of a row's action tokens counted when it differs; and those rows' rollout ids.
    Experiences without a digest are not checked. Rows index `experiences` (`MicroBatch.rows`)."""
    mismatched, rollout_ids = 0, []
    for micro_batch in micro_batches:
        for row, index in enumerate(micro_batch.rows):
            experience = experiences[index] if index >= 0 else None
            if experience is None or experience.action_digest is None:
                continue
            length = experience.num_tokens
            ids, mask = micro_batch.input_ids[row, :length].cpu(), micro_batch.action_mask[row, :length].cpu()
            if compute_action_digest(ids, mask > 0) != experience.action_digest:
                mismatched += int((mask > 0).sum())
                rollout_ids.append(experience.rollout_id)
    return mismatched, sorted(set(rollout_ids))


class DropWatcher:
    """Warns when a ratio metric (route alignment, R3 coverage: values in [0, 1]) falls sharply below
    its recent level: more than `drop` below its exponential moving average (weight `alpha` on the
    newest value, so the level is roughly the last 1/alpha steps) once `warmup_steps` values were
    seen. On thousands of action tokens a step's ratio moves by a few hundredths at most (a binomial
    share of n >= 1000 has a standard deviation <= 0.016), so 0.2 is far above noise and far below
    a real break (a layer's routing lost, captures missing). A drop warns once; it warns again only
    after the value came back within `drop` of the level. NaN values are skipped."""

    def __init__(self, names: Iterable[str], *, drop: float = 0.2, alpha: float = 0.3, warmup_steps: int = 3) -> None:
        self.names = list(names)
        self.drop, self.alpha, self.warmup_steps = drop, alpha, warmup_steps
        self.level: dict[str, float] = {}
        self.seen: dict[str, int] = {}
        self.dropped: set[str] = set()

    def observe(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Check this step's values of the watched names; returns the names that warned."""
        warned = []
        for name in self.names:
            value = metrics.get(name)
            if value is None or not math.isfinite(value):
                continue
            if self._is_new_drop(name, value):
                logger.warning("step %d: %s fell to %.3f from its recent level %.3f (more than %.2f below the "
                               "moving average of the last steps)", step, name, value, self.level[name], self.drop)
                warned.append(name)
            self._update(name, value)
        return warned

    def _is_new_drop(self, name: str, value: float) -> bool:
        if self.seen.get(name, 0) < self.warmup_steps:
            return False
        below = value < self.level[name] - self.drop
        if not below:
            self.dropped.discard(name)
            return False
        new = name not in self.dropped
        self.dropped.add(name)
        return new

    def _update(self, name: str, value: float) -> None:
        level = self.level.get(name)
        self.level[name] = value if level is None else (1 - self.alpha) * level + self.alpha * value
        self.seen[name] = self.seen.get(name, 0) + 1
