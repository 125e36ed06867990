import dataclasses
import math
import random

import pytest
import torch
import torch.distributed as dist
import transformers
from distributed import run_ranks

from molt.distributed.parallelize import ShardingPlan, TrainerMesh
from molt.trace.experience import Experience
from molt.trainer.actor import Actor, PolicyLoss, summarize_windows
from molt.trainer.scoring import compute_token_logprobs
from molt.trainer.sharded_model import build_actor_model
from molt.trainer.batch import assign_to_ranks, build_micro_batches, count_micro_batches
from molt.trainer.optimizer import OptimizerSettings

PAD = 0
# Micro-batches hold temperatures in float32 (as the engine samples with them): 0.875 is exact there,
# so fp64 comparisons against naive loops at the Python float stay exact.
CLIP_LOW, CLIP_HIGH, TEMPERATURE = 0.2, 0.28, 0.875
CPU = torch.device("cpu")
PPO = PolicyLoss(clip_eps_low=CLIP_LOW, clip_eps_high=CLIP_HIGH)
# Every term at once, with a tight band so the importance correction rejects tokens, and a trust
# region that rejects about half of make_experiences(seed=0)'s rows (their KLs: 0.17 to 0.79).
FULL_LOSS = PolicyLoss(clip_eps_low=CLIP_LOW, clip_eps_high=CLIP_HIGH, dual_clip=3.0,
                       importance=("token", "mask", 0.9, 1.1), entropy_coef=0.01, kl_coef=0.1, kl_estimator="k3",
                       trust_region=(0.4, 1.05))
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "constant")
CONSTANT_TOKENS = 24  # the constant aggregation's tokens per sequence in these tests


def make_experiences(seed: int, count: int) -> tuple[list[Experience], list[float]]:
    rng = random.Random(seed)
    experiences = []
    for rollout_id in range(count):
        num_tokens, prompt = rng.randint(6, 40), rng.randint(1, 5)
        action_mask = [0] * prompt + [1] * (num_tokens - prompt)
        experiences.append(Experience(
            token_ids=[rng.randint(1, 63) for _ in range(num_tokens)],
            action_mask=action_mask,
            # Near the tiny model's ~-log(64) so ratios straddle the clip range.
            behavior_logprobs=[as_float32(-4.2 + rng.gauss(0, 0.3)) if a else 0.0 for a in action_mask],
            policy_versions=[0 if a else -1 for a in action_mask],
            reward=0.0, score=0.0, group_id=0, rollout_id=rollout_id,
        ))
    return experiences, [as_float32(rng.gauss(0, 1)) for _ in range(count)]


def as_float32(value: float) -> float:
    """Micro-batches hold float32; the naive reference must see the same rounded inputs."""
    return torch.tensor(value, dtype=torch.float32).item()


def naive_window_loss(model, experiences, advantages, aggregation="token_mean") -> torch.Tensor:
    """PPO-clip over the window, one unpadded sequence and one token at a time, each token at its
    own sampling temperature (TEMPERATURE for an experience without them); the token mean, the mean
    of the sequences' token means, or the token sum over sequences x CONSTANT_TOKENS."""
    sequences = []
    for experience, advantage in zip(experiences, advantages):
        ids = torch.tensor([experience.token_ids])
        logits = model(input_ids=ids).logits[0].double()
        temperatures = experience.temperatures or [TEMPERATURE] * experience.num_tokens
        terms = []
        for t in range(1, experience.num_tokens):
            if not experience.action_mask[t]:
                continue
            logprob = torch.log_softmax(logits[t - 1] / temperatures[t], dim=-1)[experience.token_ids[t]]
            ratio = torch.exp(logprob - experience.behavior_logprobs[t])
            clipped = ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)
            terms.append(-torch.minimum(ratio * advantage, clipped * advantage))
        sequences.append(torch.stack(terms))
    if aggregation == "seq_mean_token_mean":
        return torch.stack([terms.mean() for terms in sequences]).mean()
    total = torch.cat(sequences).sum()
    if aggregation == "constant":
        return total / (len(sequences) * CONSTANT_TOKENS)
    return total / sum(len(terms) for terms in sequences)


def full_gradients(model) -> dict[str, torch.Tensor]:
    grads = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return grads


def build_rank_micro_batches(experiences, advantages, group, budget) -> list:
    """What the trainer does per rank: balanced assignment, then the same micro-batch count."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    mine = assign_to_ranks(experiences, num_ranks)[rank]
    my_experiences = [experiences[i] for i in mine]
    count = torch.tensor(count_micro_batches(my_experiences, max_tokens_per_micro_batch=budget))
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return build_micro_batches(
        my_experiences, [advantages[i] for i in mine], max_tokens_per_micro_batch=budget,
        pad_token_id=PAD, num_micro_batches=int(count), temperature=TEMPERATURE,
    )


def make_actor(model_path, group, dtype, *, max_grad_norm=1.0, plan=None, **optimizer) -> Actor:
    mesh = TrainerMesh.from_group(group, "cpu")
    model = build_actor_model(model_path, mesh=mesh, device=CPU, plan=plan or ShardingPlan(param_dtype=dtype))
    return Actor(model, group=group, device=CPU, temperature=TEMPERATURE, max_grad_norm=max_grad_norm,
                 optimizer=OptimizerSettings(**optimizer))


def window_gradients(actor, micro_batches, loss=PPO, kl_reference=None) -> dict[str, torch.Tensor]:
    if kl_reference is not None:  # what the learner does before the window when the KL is on
        for micro_batch in micro_batches:
            with torch.no_grad():
                micro_batch.ref_logprobs = compute_token_logprobs(
                    kl_reference, micro_batch.input_ids, micro_batch.attention_mask, temperature=TEMPERATURE)
    sums = actor.compute_window_gradients(micro_batches, loss)
    grads = full_gradients(actor.model)
    if loss.importance is not None:
        grads["rejected tokens"] = sums["rejected_tokens"]  # summed over this rank's micro-batches
    if loss.trust_region is not None:
        grads["rejected sequences"] = sums["trust_region_rejected_sequences"]
    actor.optimizer.zero_grad(set_to_none=True)
    return grads


def perturbed_model(model_path):
    """A fixed reference policy that differs from the actor, for the KL term."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return model


def gradient_invariance_rank(rank, world_size, model_path, experiences, advantages, full_loss=False):
    """Per loss aggregation: the window's gradients on one rank in one and in three micro-batches
    (and, on rank 0 without the full loss, the naive loop's), and split over two ranks."""
    single_group = dist.new_group([0])
    both_group = dist.new_group([0, 1])
    base_loss, kl_reference = (FULL_LOSS, perturbed_model(model_path)) if full_loss else (PPO, None)
    if rank == 0:
        single = make_actor(model_path, single_group, torch.float64, lr=1e-3)
        one = build_micro_batches(
            experiences, advantages, max_tokens_per_micro_batch=10_000, pad_token_id=PAD, temperature=TEMPERATURE
        )
        assert len(one) == 1
        thirds = [slice(0, 2), slice(2, 7), slice(7, None)]
        three = [
            build_micro_batches(
                experiences[s], advantages[s], max_tokens_per_micro_batch=10_000, pad_token_id=PAD,
                temperature=TEMPERATURE,
            )[0]
            for s in thirds
        ]
    both = make_actor(model_path, both_group, torch.float64, lr=1e-3)
    micro_batches = build_rank_micro_batches(experiences, advantages, both_group, budget=120)

    results = {}
    for aggregation in AGGREGATIONS:
        loss = dataclasses.replace(base_loss, aggregation=aggregation, constant_tokens=CONSTANT_TOKENS)
        mode = results[aggregation] = {}
        if rank == 0:
            if not full_loss:
                reference = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
                naive_window_loss(reference, experiences, advantages, aggregation).backward()
                mode["reference"] = full_gradients(reference)
            mode["1 rank, 1 micro-batch"] = window_gradients(single, one, loss, kl_reference)
            mode["1 rank, 3 micro-batches"] = window_gradients(single, three, loss, kl_reference)
        mode["2 ranks"] = window_gradients(both, micro_batches, loss, kl_reference)
        mode["2 ranks, micro-batches"] = len(micro_batches)
    return results


def test_window_gradient_is_invariant_to_micro_batches_and_ranks(model_path):
    """Under each loss aggregation, the window's gradient is the naive loop's, on one rank in one or
    three micro-batches and split over two FSDP2 ranks (fp64); the aggregations differ."""
    experiences, advantages = make_experiences(seed=0, count=9)
    results = run_ranks(gradient_invariance_rank, 2, model_path, experiences, advantages)
    for aggregation in AGGREGATIONS:
        assert_same_gradients([rank_results[aggregation] for rank_results in results],
                              results[0][aggregation].pop("reference"), aggregation)
    name = "model.layers.0.self_attn.q_proj.weight"
    gradients = [results[0][aggregation]["1 rank, 1 micro-batch"][name] for aggregation in AGGREGATIONS]
    assert not torch.allclose(gradients[0], gradients[1]) and not torch.allclose(gradients[0], gradients[2])


def test_full_loss_gradient_is_invariant_with_importance_rejection(model_path):
    """DESIGN section 8: policy (dual clip, IcePop-style token masking, sequence trust region),
    KL-in-loss and entropy terms are aggregated over the window's counts under every
    algorithm.loss_aggregation, so repartitioning the window changes nothing (fp64, rtol 1e-6 /
    atol 1e-12), while some tokens and some sequences are rejected."""
    experiences, advantages = make_experiences(seed=0, count=9)
    results = run_ranks(gradient_invariance_rank, 2, model_path, experiences, advantages, True)
    total_actions = sum(sum(e.action_mask) for e in experiences)
    for aggregation in AGGREGATIONS:
        by_rank = [rank_results[aggregation] for rank_results in results]
        for key, total in (("rejected tokens", total_actions), ("rejected sequences", len(experiences))):
            rejected = {(rank, label): grads.pop(key).item() for rank, rank_results in enumerate(by_rank)
                        for label, grads in rank_results.items() if isinstance(grads, dict)}
            whole = rejected[0, "1 rank, 1 micro-batch"]
            assert 0 < whole < total, (aggregation, key)
            assert rejected[0, "1 rank, 3 micro-batches"] == whole
            assert rejected[0, "2 ranks"] + rejected[1, "2 ranks"] == whole
        assert_same_gradients(by_rank, by_rank[0]["1 rank, 1 micro-batch"], aggregation)


def assert_same_gradients(results, reference, aggregation=""):
    assert results[0]["2 ranks, micro-batches"] >= 2
    assert any(g.abs().max() > 0 for g in reference.values())
    for rank_results in results:
        for label, grads in rank_results.items():
            if label.endswith("micro-batches") and isinstance(grads, int):
                continue
            assert grads.keys() == reference.keys()
            for name, grad in grads.items():
                # fp64 throughout: summation order is the only difference.
                torch.testing.assert_close(
                    grad, reference[name], rtol=1e-6, atol=1e-12,
                    msg=lambda m: f"{aggregation} {label}: {name}\n{m}"
                )


def with_turn_temperatures(experiences: list[Experience]) -> list[Experience]:
    """Every other experience sampled in two turns, at 0.7 then 1.3 (float32 values, as micro-batches
    hold them); the rest at the run's TEMPERATURE (None)."""
    for experience in experiences[::2]:
        half = experience.num_tokens // 2
        experience.temperatures = [as_float32(0.7)] * half + [as_float32(1.3)] * (experience.num_tokens - half)
    return experiences


def per_token_temperature_rank(rank, world_size, model_path, experiences, advantages):
    """Window gradients and scored log-probs of the actor, padded and packed, with per-token
    temperatures; the naive loop's gradients at those temperatures and at TEMPERATURE alone."""
    actor = make_actor(model_path, dist.group.WORLD, torch.float64, lr=1e-3)
    results = {}
    for layout in ("padded", "rows"):
        micro_batches = build_micro_batches(experiences, advantages, max_tokens_per_micro_batch=10_000,
                                            pad_token_id=PAD, layout=layout, temperature=TEMPERATURE)
        results[layout] = window_gradients(actor, micro_batches)
        micro_batch = micro_batches[0]
        scored = actor.score(micro_batch)
        results[f"{layout} logprobs"] = {index: scored[row, :experiences[index].num_tokens]
                                         for row, index in enumerate(micro_batch.rows)}
    for name, batch in (("naive", experiences),
                        ("one temperature", [dataclasses.replace(e, temperatures=None) for e in experiences])):
        reference = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
        naive_window_loss(reference, batch, advantages).backward()
        results[name] = full_gradients(reference)
    return results


def test_each_token_is_scored_and_trained_at_its_own_sampling_temperature(model_path):
    """MicroBatch.temperatures reach the chunked LM head: the actor's window gradient, padded and
    packed, is the naive loop's at each token's temperature (fp64, rtol 1e-6 / atol 1e-12), and
    its scored log-probs are the naive per-token ones; one scalar temperature would be far off."""
    experiences, advantages = make_experiences(seed=11, count=6)
    experiences = with_turn_temperatures(experiences)
    results = run_ranks(per_token_temperature_rank, 1, model_path, experiences, advantages)[0]
    naive, single = results["naive"], results["one temperature"]
    assert max((naive[name] - single[name]).abs().max().item() for name in naive) > 1e-4
    for layout in ("padded", "rows"):
        for name, grad in results[layout].items():
            torch.testing.assert_close(grad, naive[name], rtol=1e-6, atol=1e-12, msg=lambda m: f"{layout} {name}\n{m}")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    with torch.no_grad():
        for index, experience in enumerate(experiences):
            logits = model(input_ids=torch.tensor([experience.token_ids])).logits[0]
            temperatures = experience.temperatures or [TEMPERATURE] * experience.num_tokens
            expected = torch.tensor([0.0] + [torch.log_softmax(logits[t - 1] / temperatures[t], -1)[token].item()
                                             for t, token in enumerate(experience.token_ids) if t > 0],
                                    dtype=torch.float64)
            for layout in ("padded", "rows"):
                torch.testing.assert_close(results[f"{layout} logprobs"][index], expected, rtol=1e-9, atol=1e-9)


def training_rank(rank, world_size, model_path, windows):
    trainer_group = dist.new_group([0, 1])  # rank 2 plays a rollout rank: in the world, not the mesh
    if rank == 2:
        return None
    optimizer = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8, max_grad_norm=0.05)
    actor = make_actor(model_path, trainer_group, torch.float64, **optimizer)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    reference_optimizer = torch.optim.AdamW(
        reference.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8
    )
    metrics, reference_metrics = [], []
    for experiences, advantages in windows:
        micro_batches = build_rank_micro_batches(experiences, advantages, trainer_group, budget=100)
        metrics.append(summarize_windows([actor.train_window(micro_batches, PPO)], PPO, num_windows=1))

        loss = naive_window_loss(reference, experiences, advantages)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        reference_metrics.append({"loss": loss.item(), "grad_norm": grad_norm.item()})

    state = {name: tensor.full_tensor() for name, tensor in actor.model.state_dict().items()}
    probe = build_micro_batches(*windows[0], max_tokens_per_micro_batch=10_000, pad_token_id=PAD)[0]
    probe_logprobs = actor.compute_logprobs(probe.input_ids, probe.attention_mask)
    with torch.no_grad():
        reference_logprobs = compute_token_logprobs(
            reference, probe.input_ids, probe.attention_mask, temperature=TEMPERATURE
        )
    return {
        "metrics": metrics,
        "reference_metrics": reference_metrics,
        "state": state,
        "reference_state": {name: t.detach() for name, t in reference.state_dict().items()},
        "parameter_names": [name for name, _ in actor.model.named_parameters()],
        "tied": actor.model.lm_head.weight is actor.model.model.embed_tokens.weight,
        "probe": (probe_logprobs * probe.attention_mask, reference_logprobs * probe.attention_mask),
    }


def test_fsdp_training_matches_plain_reference(model_path):
    windows = [make_experiences(seed=seed, count=6) for seed in (1, 2, 3)]
    results = run_ranks(training_rank, 3, model_path, windows)
    assert results[2] is None
    rank0 = results[0]
    assert rank0["tied"]
    assert "model.layers.0.self_attn.q_proj.weight" in rank0["parameter_names"]
    assert "lm_head.weight" in rank0["state"]  # tied: vLLM's load_weights skips it
    for step, (got, expected) in enumerate(zip(rank0["metrics"], rank0["reference_metrics"])):
        assert math.isclose(got["loss"], expected["loss"], rel_tol=1e-9), step
        assert math.isclose(got["grad_norm"], expected["grad_norm"], rel_tol=1e-9), step
        assert got["grad_norm"] > 0.05, "clipping should be active"
        assert got["num_action_tokens"] == sum(e.num_action_tokens for e in windows[step][0])
        assert 0 < got["clip_fraction"] < 1
    assert rank0["metrics"] == results[1]["metrics"], "every rank logs the same global values"
    for name, expected in rank0["reference_state"].items():
        # fp64, so summation order is the only difference. (In fp32, AdamW turns rounding noise in
        # near-zero gradients into differences of up to ~1% of a step on a few elements.)
        torch.testing.assert_close(
            rank0["state"][name], expected, rtol=1e-7, atol=1e-9, msg=lambda m: f"{name}\n{m}"
        )
    torch.testing.assert_close(*rank0["probe"], rtol=1e-9, atol=1e-9)


def test_token_logprobs_match_naive_log_softmax(model_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    lengths = [7, 12, 3]
    rows = [torch.randint(1, 64, (n,)) for n in lengths]
    input_ids = torch.full((3, 12), PAD, dtype=torch.long)
    attention_mask = torch.zeros((3, 12), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = row
        attention_mask[i, : len(row)] = 1
    with torch.no_grad():
        logprobs = compute_token_logprobs(model, input_ids, attention_mask, temperature=0.7)
        for i, row in enumerate(rows):
            logits = model(input_ids=row[None]).logits[0] / 0.7
            expected = [0.0] + [
                torch.log_softmax(logits[t - 1], -1)[row[t]].item() for t in range(1, len(row))
            ]
            expected = torch.tensor(expected, dtype=torch.float64)
            torch.testing.assert_close(logprobs[i, : len(row)], expected, rtol=1e-9, atol=1e-9)


def sequence_loss_rank(rank, world_size, model_path, experiences, advantages, kind):
    """The actor's window gradient under algorithm.policy_loss=`kind` and each loss aggregation: one
    rank and one micro-batch (rank 0), then the window split over 2 FSDP2 ranks and several
    micro-batches."""
    results = {aggregation: {} for aggregation in AGGREGATIONS}
    if rank == 0:
        single = make_actor(model_path, dist.new_group([0]), torch.float64, lr=1e-3)
        one = build_micro_batches(experiences, advantages, max_tokens_per_micro_batch=10_000, pad_token_id=PAD,
                                  temperature=TEMPERATURE)
    else:
        dist.new_group([0])
    both = dist.new_group([0, 1])
    actor = make_actor(model_path, both, torch.float64, lr=1e-3)
    micro_batches = build_rank_micro_batches(experiences, advantages, both, budget=120)
    assert len(micro_batches) >= 2
    for aggregation in AGGREGATIONS:
        loss = PolicyLoss(clip_eps_low=CLIP_LOW, clip_eps_high=CLIP_HIGH, kind=kind, aggregation=aggregation,
                          constant_tokens=CONSTANT_TOKENS)
        if rank == 0:
            results[aggregation]["1 rank"] = window_gradients(single, one, loss)
        results[aggregation]["2 ranks"] = window_gradients(actor, micro_batches, loss)
    return results


@pytest.mark.parametrize("kind", ["gspo", "cispo"])
def test_sequence_policy_losses_train_the_actor_whatever_the_partition(model_path, kind):
    """GSPO and CISPO through the FSDP2 actor, under each loss aggregation (GSPO's own: the mean of
    the sequences' token means): each row is a whole experience, so the window's gradient is the
    same on one rank as split over two ranks and several micro-batches (fp64)."""
    experiences, advantages = make_experiences(seed=0, count=9)
    results = run_ranks(sequence_loss_rank, 2, model_path, experiences, advantages, kind)
    for aggregation in AGGREGATIONS:
        reference = results[0][aggregation]["1 rank"]
        assert any(g.abs().max() > 0 for g in reference.values())
        for label, grads in [("rank 0", results[0][aggregation]["2 ranks"]),
                             ("rank 1", results[1][aggregation]["2 ranks"])]:
            for name, grad in grads.items():
                torch.testing.assert_close(grad, reference[name], rtol=1e-6, atol=1e-12,
                                           msg=lambda m: f"{aggregation} {label}: {name}\n{m}")


def naive_trust_region_loss(model, experiences, advantages, *, max_kl, weight_cap, aggregation):
    """The decoupled PPO loss of one window whose proximal policy is the model itself, with the
    sequence trust region, one sequence and one token at a time: a sequence whose mean
    exp(d) - 1 - d (d = trainer - behaviour log-prob) over its action tokens exceeds max_kl is left
    out, but still counts in the token or sequence count; each kept token is weighted by
    min(exp(d), weight_cap). Returns the loss and each sequence's KL."""
    kept_sums, lengths, row_kls = [], [], []
    for experience, advantage in zip(experiences, advantages):
        logits = model(input_ids=torch.tensor([experience.token_ids])).logits[0].double()
        terms, kls = [], []
        for t in range(1, experience.num_tokens):
            if not experience.action_mask[t]:
                continue
            logprob = torch.log_softmax(logits[t - 1] / TEMPERATURE, dim=-1)[experience.token_ids[t]]
            gap = logprob.item() - experience.behavior_logprobs[t]
            kls.append(math.exp(gap) - 1 - gap)
            ratio = torch.exp(logprob - logprob.detach())
            clipped = ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)
            terms.append(-torch.minimum(ratio * advantage, clipped * advantage) * min(math.exp(gap), weight_cap))
        row_kls.append(sum(kls) / len(kls))
        lengths.append(len(terms))
        if row_kls[-1] <= max_kl:
            kept_sums.append(torch.stack(terms).sum() / (len(terms) if aggregation == "seq_mean_token_mean" else 1))
    divisor = len(experiences) if aggregation == "seq_mean_token_mean" else sum(lengths)
    return torch.stack(kept_sums).sum() / divisor, row_kls


def trust_region_rank(rank, world_size, model_path, experiences, advantages):
    """For each aggregation: the naive loop's row KLs, a threshold between the third and fourth
    smallest, then the actor's window gradient and metrics with that trust region and the naive
    loop's gradient. lr=0: train_window (for the metrics) leaves the weights as they are."""
    actor = make_actor(model_path, dist.group.WORLD, torch.float64, lr=0.0)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    with torch.no_grad():
        _, row_kls = naive_trust_region_loss(reference, experiences, advantages, max_kl=1.0, weight_cap=1.5,
                                             aggregation="token_mean")
    ordered = sorted(row_kls)
    max_kl = (ordered[2] + ordered[3]) / 2
    results = {"row_kls": row_kls, "max_kl": max_kl}
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        loss = PolicyLoss(clip_eps_low=CLIP_LOW, clip_eps_high=CLIP_HIGH, trust_region=(max_kl, 1.5),
                          aggregation=aggregation)
        micro_batches = build_micro_batches(experiences, advantages, max_tokens_per_micro_batch=60, pad_token_id=PAD,
                                            temperature=TEMPERATURE)
        assert len(micro_batches) >= 2
        results[aggregation] = window_gradients(actor, micro_batches, loss)
        results[aggregation, "metrics"] = summarize_windows([actor.train_window(micro_batches, loss)], loss,
                                                            num_windows=1)
        naive, _ = naive_trust_region_loss(reference, experiences, advantages, max_kl=max_kl, weight_cap=1.5,
                                           aggregation=aggregation)
        naive.backward()
        results[aggregation, "naive"] = full_gradients(reference)
        reference.zero_grad(set_to_none=True)
    return results


def test_trust_region_zeroes_exactly_the_sequences_above_the_threshold(model_path):
    """algorithm.trust_region_kl through the actor: the window's gradient (in several micro-batches)
    is the naive loop's that leaves out exactly the 3 of 6 sequences whose KL exceeds the threshold,
    still counting their tokens (token mean) or them (sequence mean) in the denominator, and weights
    kept tokens min(exp(d), 1.5) (fp64); the metrics report the share and the KLs."""
    experiences, advantages = make_experiences(seed=11, count=6)
    results = run_ranks(trust_region_rank, 1, model_path, experiences, advantages)[0]
    row_kls, max_kl = results["row_kls"], results["max_kl"]
    assert sum(kl > max_kl for kl in row_kls) == 3
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        naive = results[aggregation, "naive"]
        assert any(g.abs().max() > 0 for g in naive.values())
        grads = results[aggregation]
        assert grads.pop("rejected sequences").item() == 3
        for name, grad in grads.items():
            torch.testing.assert_close(grad, naive[name], rtol=1e-6, atol=1e-12,
                                       msg=lambda m: f"{aggregation}: {name}\n{m}")
        metrics = results[aggregation, "metrics"]
        assert metrics["trust_region_rejected_share"] == 0.5
        assert math.isclose(metrics["trust_region_kl_max"], max(row_kls), rel_tol=1e-9)
        assert math.isclose(metrics["trust_region_kl_mean"], sum(row_kls) / len(row_kls), rel_tol=1e-9)
