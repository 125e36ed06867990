"""Consistency diagnostics (molt.trainer.diagnostics): histogram quantiles and buckets against naive loops,
the reduction over 2 gloo ranks against one rank holding the union, the learner feeding the
pre-update forward, token alignment catching a corrupted packed layout and a corrupted payload,
the drop watcher, and the W&B histogram path offline."""

import dataclasses
import logging
import math
import random
import secrets

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from test_actor import PAD, TEMPERATURE, make_actor, make_experiences
from test_learner import grouped_experiences, learner_config, windows_of
from test_metrics import history_rows, make_logger, read_jsonl, read_wandb_records, wandb_offline  # noqa: F401

from molt.distributed.parallelize import TrainerMesh
from molt.objectives.policy_loss import MAX_ABS_LOG_RATIO
from molt.trace.experience import Experience, compute_action_digest, split_at_version_changes
from molt.trainer.batch import build_micro_batches
from molt.trainer.diagnostics import (BINS_PER_DECADE, DIFF_BOUNDARIES, ENTROPY_BUCKETS, ENTROPY_EDGES, PREFIX, QUANTILES,
                                      DiagnosticsReport, DropWatcher, StepDiagnostics, count_digest_mismatches,
                                      count_model_input_mismatches, histogram_charts, summarize_histogram)
from molt.trainer.learner import Learner
from molt.transport.payloads import PayloadClient, PayloadRef, PayloadStore, offload_record, restore_experience
from molt.transport.wire import pack, unpack

CPU = torch.device("cpu")
RESOLUTION = 10 ** (1 / BINS_PER_DECADE)  # a reported quantile is within this factor above the true one


def random_micro_batch_tensors(seed: int, rows: int = 3, seq: int = 50) -> dict[str, torch.Tensor]:
    """[rows, seq] trainer and behaviour log-probs whose gaps span 1e-9..1e3, entropies over all
    buckets (edges included), and an action mask with about 2/3 of the positions."""
    generator = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(rows, seq, generator=generator, dtype=torch.float64) * 5
    gap = 10 ** (torch.rand(rows, seq, generator=generator, dtype=torch.float64) * 12 - 9)
    sign = torch.where(torch.rand(rows, seq, generator=generator) < 0.5, -1.0, 1.0).to(torch.float64)
    entropy = torch.rand(rows, seq, generator=generator, dtype=torch.float64) * 3
    entropy.view(-1)[:5] = torch.tensor([0.0, *ENTROPY_EDGES], dtype=torch.float64)  # the edges themselves
    mask = (torch.rand(rows, seq, generator=generator) < 0.67).float()
    return {"trainer": behaviour + sign * gap, "behaviour": behaviour, "entropy": entropy, "mask": mask}


def naive_bucket(entropy: float) -> int:
    return sum(entropy >= edge for edge in ENTROPY_EDGES)


def naive_upper_edge(diff: float) -> float:
    """The upper edge of the |diff| bin holding `diff`: the first boundary above it."""
    return next((edge for edge in DIFF_BOUNDARIES.tolist() if diff < edge), math.inf)


def naive_summary(batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """The diagnostics' histogram metrics and mismatch KL by sorting every action token's |diff|."""
    by_bucket = [[] for _ in ENTROPY_BUCKETS]
    kl = []
    for batch in batches:
        for t, b, h, m in zip(*(batch[k].reshape(-1).tolist() for k in ("trainer", "behaviour", "entropy", "mask"))):
            if m:
                by_bucket[naive_bucket(h)].append(abs(t - b))
                gap = max(-MAX_ABS_LOG_RATIO, min(MAX_ABS_LOG_RATIO, t - b))  # clamped, as every log-ratio
                kl.append(math.exp(gap) - 1 - gap)
    expected = {}

    def quantiles(values: list[float], prefix: str) -> None:
        ordered = sorted(values)
        for name, q in QUANTILES.items():
            if ordered:
                expected[prefix + name] = min(naive_upper_edge(ordered[math.ceil(q * len(ordered)) - 1]), ordered[-1])

    everything = [d for bucket in by_bucket for d in bucket]
    quantiles(everything, PREFIX + "logprob_diff_")
    for bucket, values in zip(ENTROPY_BUCKETS, by_bucket):
        quantiles(values, f"{PREFIX}logprob_diff_by_entropy/{bucket}/")
        expected[f"{PREFIX}logprob_diff_by_entropy/{bucket}/count"] = float(len(values))
    expected[PREFIX + "logprob_diff_max"] = max(everything)
    expected[PREFIX + "logprob_diff_count"] = float(len(everything))
    expected[PREFIX + "mismatch_kl"] = sum(kl) / len(kl)
    return expected


def feed(diagnostics: StepDiagnostics, batch: dict[str, torch.Tensor]) -> None:
    diagnostics.add_logprobs(batch["trainer"], batch["behaviour"], batch["entropy"], batch["mask"])


def test_histogram_quantiles_and_buckets_match_a_naive_sort():
    batches = [random_micro_batch_tensors(seed) for seed in range(3)]
    diagnostics = StepDiagnostics(CPU)
    for batch in batches:
        feed(diagnostics, batch)
    metrics = summarize_histogram(diagnostics.histogram, diagnostics.bucket_max)
    expected = naive_summary(batches)
    for name, value in expected.items():
        if name == PREFIX + "mismatch_kl":
            continue
        assert value == metrics[name], name
    # Every bucket is populated, so the check above covers each; the edges land in the upper bucket.
    assert all(metrics[f"{PREFIX}logprob_diff_by_entropy/{b}/count"] > 0 for b in ENTROPY_BUCKETS)
    # The stated resolution: true <= reported <= true x 10^(1/20), above the 1e-7 floor.
    everything = sorted(abs(t - b) for batch in batches
                        for t, b, m in zip(batch["trainer"].view(-1).tolist(), batch["behaviour"].view(-1).tolist(),
                                           batch["mask"].view(-1).tolist()) if m)
    true_p50 = everything[math.ceil(0.5 * len(everything)) - 1]
    assert true_p50 <= metrics[PREFIX + "logprob_diff_p50"] <= true_p50 * RESOLUTION


def test_an_empty_bucket_reports_a_zero_count_and_no_quantiles():
    diagnostics = StepDiagnostics(CPU)
    one = torch.tensor([[0.0, -1.0]], dtype=torch.float64)
    diagnostics.add_logprobs(one + 1e-3, one, torch.tensor([[0.05, 0.05]]), torch.tensor([[0.0, 1.0]]))
    metrics = summarize_histogram(diagnostics.histogram, diagnostics.bucket_max)
    assert metrics[f"{PREFIX}logprob_diff_by_entropy/0-0.1/count"] == 1
    assert metrics[f"{PREFIX}logprob_diff_by_entropy/0-0.1/p99"] == pytest.approx(1e-3, rel=1e-12)  # capped at max
    assert metrics[f"{PREFIX}logprob_diff_by_entropy/2-inf/count"] == 0
    assert not any(key.startswith(f"{PREFIX}logprob_diff_by_entropy/2-inf/p") for key in metrics)


def reduction_rank(rank, world_size, batches):
    """Each rank feeds its half of the batches and named counts; rank 0 also reduces the union on a
    group of its own."""
    solo = dist.new_group([0])  # every rank creates every group
    diagnostics = StepDiagnostics(CPU)
    for batch in batches[rank::world_size]:
        feed(diagnostics, batch)
    diagnostics.add_counts("route_alignment", 3.0 + rank, 4.0)
    diagnostics.add_sum("token_mismatches", rank)
    report = diagnostics.reduce(dist.group.WORLD)
    union = None
    if rank == 0:
        whole = StepDiagnostics(CPU)
        for batch in batches:
            feed(whole, batch)
        whole.add_counts("route_alignment", 7.0, 8.0)
        whole.add_sum("token_mismatches", 1)
        union = whole.reduce(solo)
    return report, union


def test_the_reduction_over_two_ranks_equals_one_rank_holding_the_union():
    batches = [random_micro_batch_tensors(seed) for seed in range(4)]
    (report0, union), (report1, _) = run_ranks(reduction_rank, 2, batches)
    assert report0.metrics.keys() == union.metrics.keys() == report1.metrics.keys()
    for name, value in union.metrics.items():
        # Sums of float64 in a different order: the KL may differ in the last bits; counts do not.
        assert report0.metrics[name] == pytest.approx(value, rel=1e-12, nan_ok=True), name
        assert report1.metrics[name] == pytest.approx(value, rel=1e-12, nan_ok=True), name
    assert union.metrics[PREFIX + "route_alignment"] == 7 / 8 and union.metrics[PREFIX + "token_mismatches"] == 1
    assert report0.histograms == union.histograms
    expected = naive_summary(batches)
    assert union.metrics[PREFIX + "mismatch_kl"] == pytest.approx(expected[PREFIX + "mismatch_kl"], rel=1e-12)
    assert union.metrics[PREFIX + "logprob_diff_p99"] == expected[PREFIX + "logprob_diff_p99"]


def unequal_names_rank(rank, world_size):
    diagnostics = StepDiagnostics(CPU)
    if rank == 1:
        diagnostics.add_counts("route_coverage", 1.0, 2.0)
    try:
        diagnostics.reduce(dist.group.WORLD)
    except RuntimeError as error:
        return str(error)
    return None


def test_ranks_that_add_different_names_fail_alike_instead_of_hanging():
    errors = run_ranks(unequal_names_rank, 2)
    assert all(error and "every rank must add the same names" in error for error in errors), errors


def learner_rank(rank, world_size, model_path):
    """The learner's diagnostics against the trainer's log-probs scored before the step, for a step
    with a proximal pass (importance on, 2 windows) and one without (importance off, 2 windows)."""
    results = {}
    for importance in ("token", "off"):
        cfg = learner_config(model_path, learning_rate=3e-2, mini_batches_per_step=2)
        cfg.algorithm.importance_level = importance
        actor = make_actor(model_path, dist.group.WORLD, torch.float64, lr=3e-2)
        learner = Learner(cfg, actor, mesh=TrainerMesh.from_group(dist.group.WORLD, "cpu"), device=CPU)
        experiences, info = grouped_experiences(seed=5, count=8)
        windows = windows_of(experiences, 2, layout="rows")
        before = [[actor.score(m) for m in window] for window in windows]
        entropies = []
        for window in windows:
            for micro_batch in window:
                with torch.no_grad():
                    entropies.append(actor_entropy(actor, micro_batch))
        diagnostics = StepDiagnostics(CPU)
        learner.train_step(windows, info, diagnostics)
        report = diagnostics.reduce(dist.group.WORLD)
        results[importance] = {"report": report.metrics, "before": before, "entropies": entropies,
                               "windows": windows}
    return results


def actor_entropy(actor, micro_batch):
    from molt.trainer.scoring import score_micro_batch

    return score_micro_batch(actor.model, micro_batch, with_entropy=True)[1]


def test_the_learner_feeds_the_forward_before_the_first_update(model_path):
    results = run_ranks(learner_rank, 1, model_path)[0]
    for importance, taken in (("token", "all windows"), ("off", "first window")):
        result = results[importance]
        windows = result["windows"] if taken == "all windows" else result["windows"][:1]
        batches = []
        flat_entropies = iter(result["entropies"])
        for window, before in zip(windows, result["before"]):
            for micro_batch, logprobs in zip(window, before):
                batches.append({"trainer": logprobs, "behaviour": micro_batch.behavior_logprobs.double(),
                                "entropy": next(flat_entropies), "mask": micro_batch.action_mask})
        expected = naive_summary(batches)
        metrics = result["report"]
        assert metrics[PREFIX + "logprob_diff_count"] == expected[PREFIX + "logprob_diff_count"], importance
        # fp64 on CPU: the learner's forward and the one here agree to rounding.
        assert metrics[PREFIX + "logprob_diff_max"] == pytest.approx(expected[PREFIX + "logprob_diff_max"], rel=1e-9)
        assert metrics[PREFIX + "mismatch_kl"] == pytest.approx(expected[PREFIX + "mismatch_kl"], rel=1e-9)
        assert metrics[PREFIX + "model_input_mismatches"] == 0
    all_tokens = sum(e.num_action_tokens for e in grouped_experiences(5, 8)[0])
    assert results["token"]["report"][PREFIX + "logprob_diff_count"] == all_tokens
    assert results["off"]["report"][PREFIX + "logprob_diff_count"] < all_tokens


# -- token alignment ---------------------------------------------------------------------------


def with_digests(experiences: list[Experience]) -> list[Experience]:
    return [dataclasses.replace(e, action_digest=compute_action_digest(e.token_ids, e.action_mask))
            for e in experiences]


@pytest.mark.parametrize("layout", ["padded", "rows", "row"])
def test_model_inputs_match_the_rows_until_the_packed_layout_is_corrupted(layout):
    experiences, _ = make_experiences(seed=6, count=6)
    (micro_batch,) = build_micro_batches(experiences, max_tokens_per_micro_batch=10_000, pad_token_id=PAD,
                                         layout=layout, temperature=TEMPERATURE)
    assert count_model_input_mismatches(micro_batch) == 0
    if layout == "padded":
        return  # the model gets the rows themselves
    # Swap two real entries of the packed index: each of those tokens now lands on the other's position.
    real = (micro_batch.packed_index >= 0).nonzero().view(-1)
    first, second = real[3].item(), real[-2].item()
    flat = micro_batch.input_ids.view(-1)
    moved = [micro_batch.packed_index[i].item() for i in (first, second)]
    micro_batch.packed_index[first], micro_batch.packed_index[second] = moved[1], moved[0]
    expected = sum(int(micro_batch.action_mask.view(-1)[p] > 0) for p in moved if flat[moved[0]] != flat[moved[1]])
    assert expected > 0  # the fixed seed swaps two different action tokens
    assert count_model_input_mismatches(micro_batch) == expected


def test_the_action_digest_catches_a_corrupted_payload_and_names_the_rollout(tmp_path):
    """Light records through msgpack and a real payload store; one payload's sampled token is
    changed after its reload (the failure injected), and only its rollout is counted."""
    experiences = with_digests(make_experiences(seed=7, count=5)[0])
    node_id = f"test{secrets.token_hex(4)}"
    with PayloadStore(node_id, spill_dir=str(tmp_path / "spill"), inline_bytes=0, serve=False) as store:
        messages = [unpack(pack({"type": "outcome", "experience": offload_record(store, e).to_dict()}))
                    for e in experiences]
        records = [Experience.from_dict(message["experience"]) for message in messages]
        assert all(r.payload is not None and r.action_digest == e.action_digest for r, e in zip(records, experiences))
        client = PayloadClient(node_id, store=store)
        try:
            tensors = [client.reload(PayloadRef.from_dict(record.payload)) for record in records]
        finally:
            client.close()
    tensors[2]["token_ids"][-1] += 1  # one sampled token changed on its way
    reloaded = [restore_experience(record, t)[0] for record, t in zip(records, tensors)]
    micro_batches = build_micro_batches(reloaded, max_tokens_per_micro_batch=10_000, pad_token_id=PAD,
                                        layout="rows", temperature=TEMPERATURE)
    assert count_digest_mismatches(micro_batches, reloaded) == (experiences[2].num_action_tokens, [2])
    intact = build_micro_batches(experiences, max_tokens_per_micro_batch=10_000, pad_token_id=PAD,
                                 temperature=TEMPERATURE)
    assert count_digest_mismatches(intact, experiences) == (0, [])
    # The same ids at other positions (an action mask shifted by one) do not match either.
    shifted = experiences[0].action_mask[1:] + [0]
    assert compute_action_digest(experiences[0].token_ids, shifted) != experiences[0].action_digest


def test_splits_recompute_the_digest_and_keep_none():
    (experience,) = with_digests(make_experiences(seed=8, count=1)[0])
    versions = [(-1 if not a else (0 if i < 10 else 1)) for i, a in enumerate(experience.action_mask)]
    two_versions = dataclasses.replace(experience, policy_versions=versions)
    pieces = split_at_version_changes(two_versions)
    assert len(pieces) == 2
    for piece in pieces:
        assert piece.action_digest == compute_action_digest(piece.token_ids, piece.action_mask)
    assert pieces[0].action_digest != experience.action_digest
    assert all(p.action_digest is None for p in split_at_version_changes(
        dataclasses.replace(two_versions, action_digest=None)))


# -- drop warnings and W&B ---------------------------------------------------------------------


def test_the_drop_watcher_warns_once_at_a_sharp_drop_and_not_on_noise(caplog):
    rng = random.Random(0)
    watcher = DropWatcher([PREFIX + "route_alignment"])
    warned = []
    with caplog.at_level(logging.WARNING, logger="molt"):
        for step in range(1, 31):  # noise of +-0.05 around 0.9 (more than a real step's binomial noise)
            warned += [step for _ in watcher.observe(step, {PREFIX + "route_alignment": 0.9 + rng.uniform(-.05, .05)})]
        assert warned == [] and not caplog.records
        for step in range(31, 36):  # falls to 0.55 and stays there
            warned += [step for _ in watcher.observe(step, {PREFIX + "route_alignment": 0.55})]
        watcher.observe(36, {PREFIX + "route_alignment": math.nan})  # skipped
    assert warned == [31]
    (record,) = caplog.records
    assert "step 31" in record.getMessage() and "route_alignment fell to 0.550" in record.getMessage()
    assert "0.9" in record.getMessage()  # the recent level


def test_the_drop_watcher_waits_for_its_warmup_and_skips_absent_metrics():
    watcher = DropWatcher([PREFIX + "route_coverage"], warmup_steps=3)
    assert watcher.observe(1, {PREFIX + "route_coverage": 1.0}) == []
    assert watcher.observe(2, {}) == []
    assert watcher.observe(3, {PREFIX + "route_coverage": 0.2}) == []  # 2 values seen: still warming up
    assert watcher.observe(4, {PREFIX + "route_coverage": 0.9}) == []
    assert watcher.observe(5, {PREFIX + "route_coverage": 0.1}) == [PREFIX + "route_coverage"]


def test_wandb_offline_gets_the_histograms_and_the_jsonl_their_quantiles(tmp_path, wandb_offline):  # noqa: F811
    diagnostics = StepDiagnostics(CPU)
    feed(diagnostics, random_micro_batch_tensors(9))
    # One rank's state, as reduce would report it (the reduction is tested above).
    report = DiagnosticsReport(metrics=summarize_histogram(diagnostics.histogram, diagnostics.bucket_max),
                               histograms=histogram_charts(diagnostics.histogram))
    output_dir = tmp_path / "run"
    metrics = make_logger(output_dir, wandb_mode="offline", wandb_project="molt-test")
    metrics.log(1, report.metrics, histograms=report.histograms)
    metrics.close()
    (row,) = read_jsonl(output_dir / "metrics.jsonl")
    assert row[PREFIX + "logprob_diff_p99"] == report.metrics[PREFIX + "logprob_diff_p99"]
    assert not any("log10" in key for key in row)  # histograms are W&B's only
    (wandb_file,) = output_dir.glob("wandb/offline-run-*/run-*.wandb")
    (history,) = history_rows(read_wandb_records(wandb_file))
    for bucket in ENTROPY_BUCKETS:
        name = f"{PREFIX}log10_logprob_diff_by_entropy/{bucket}"
        counts, edges = report.histograms[name]
        assert history[name + "/_type"] == "histogram" and history[name + "/values"] == counts and sum(counts) > 0
        assert history[name + "/bins"] == pytest.approx(edges, abs=1e-9)
