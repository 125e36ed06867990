import math
import random

import torch
import torch.distributed as dist
import transformers
from distributed import run_ranks
from torch.distributed.tensor import DTensor, distribute_tensor

from molt.distributed.parallelize import ShardingPlan, TrainerMesh
from molt.trace.experience import Experience
from molt.trainer.scoring import compute_token_logprobs
from molt.trainer.sharded_model import build_actor_model
from molt.trainer.batch import assign_to_ranks, build_micro_batches, count_micro_batches
from molt.trainer.critic import (
                                 Critic,
                                 ValueModel,
                                 build_reference_model,
                                 build_value_model,
                                 compute_reference_logprobs,
                                 )
from molt.trainer.optimizer import OptimizerSettings

PAD = 0
CLIP_RANGE = 0.2
TEMPERATURE = 0.875  # exact in float32, as micro-batches hold temperatures
CPU = torch.device("cpu")


def make_experiences(seed: int, count: int) -> list[Experience]:
    rng = random.Random(seed)
    experiences = []
    for rollout_id in range(count):
        num_tokens, prompt = rng.randint(6, 40), rng.randint(1, 5)
        action_mask = [0] * prompt + [1] * (num_tokens - prompt)
        experiences.append(Experience(
            token_ids=[rng.randint(1, 63) for _ in range(num_tokens)],
            action_mask=action_mask,
            behavior_logprobs=[-4.2 + rng.gauss(0, 0.3) if a else 0.0 for a in action_mask],
            policy_versions=[0 if a else -1 for a in action_mask],
            reward=0.0, score=0.0, group_id=0, rollout_id=rollout_id,
        ))
    return experiences


def token_targets(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(old_values, returns), float32 like the trainer's: a function of each row's own tokens and
    positions only, so any packing of rows into micro-batches (or none) sees the same targets."""
    positions = torch.arange(input_ids.shape[-1])
    returns = torch.sin(0.7 * input_ids + 0.3 * positions)
    old_values = 0.5 * torch.cos(1.3 * input_ids + 0.5 * positions)
    return old_values.float(), returns.float()


def head_parameters(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A non-zero value head, so gradients reach the backbone and alignment is visible."""
    generator = torch.Generator().manual_seed(seed)
    return 0.2 * torch.randn(1, 64, generator=generator), 0.1 * torch.randn(1, generator=generator)


def set_value_head(model, weight: torch.Tensor, bias: torch.Tensor) -> None:
    with torch.no_grad():
        for parameter, full in ((model.value_head.weight, weight), (model.value_head.bias, bias)):
            full = full.to(parameter.dtype)
            if isinstance(parameter, DTensor):
                full = distribute_tensor(full, parameter.device_mesh, parameter.placements)
            parameter.copy_(full)


def build_plain_value_model(model_path: str, head_seed: int) -> ValueModel:
    model = ValueModel(transformers.AutoModel.from_pretrained(model_path, dtype=torch.float64))
    set_value_head(model, *head_parameters(head_seed))
    return model


def naive_values(model: ValueModel, token_ids: list[int]) -> torch.Tensor:
    """[tokens] value of each token's state: the head on the hidden state one position earlier."""
    hidden = model.model(input_ids=torch.tensor([token_ids])).last_hidden_state[0]
    values = [torch.zeros((), dtype=hidden.dtype)]
    values += [model.value_head(hidden[t - 1])[0] for t in range(1, len(token_ids))]
    return torch.stack(values)


def naive_window_loss(model: ValueModel, experiences: list[Experience]) -> torch.Tensor:
    """Token-mean clipped value loss over the window, one unpadded sequence and token at a time."""
    terms = []
    for experience in experiences:
        values = naive_values(model, experience.token_ids)
        old_values, returns = (t[0].double() for t in token_targets(torch.tensor([experience.token_ids])))
        for t in range(experience.num_tokens):
            if not experience.action_mask[t]:
                continue
            clipped = old_values[t] + (values[t] - old_values[t]).clamp(-CLIP_RANGE, CLIP_RANGE)
            terms.append(0.5 * torch.maximum((values[t] - returns[t]) ** 2, (clipped - returns[t]) ** 2))
    return torch.stack(terms).sum() / len(terms)


def full_gradients(model) -> dict[str, torch.Tensor]:
    grads = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return grads


def build_rank_micro_batches(experiences, group, budget) -> list:
    """What the trainer does per rank: balanced assignment, then the same micro-batch count."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    mine = [experiences[i] for i in assign_to_ranks(experiences, num_ranks)[rank]]
    count = torch.tensor(count_micro_batches(mine, max_tokens_per_micro_batch=budget))
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return build_micro_batches(
        mine, [0.0] * len(mine), max_tokens_per_micro_batch=budget, pad_token_id=PAD,
        num_micro_batches=int(count),
    )


def make_critic(model_path, group, dtype, head_seed: int | None = None, *, max_grad_norm=1.0, **optimizer) -> Critic:
    mesh = TrainerMesh.from_group(group, "cpu")
    model = build_value_model(model_path, mesh=mesh, device=CPU, plan=ShardingPlan(param_dtype=dtype))
    if head_seed is not None:
        set_value_head(model, *head_parameters(head_seed))
    return Critic(model, group=group, device=CPU, max_grad_norm=max_grad_norm, optimizer=OptimizerSettings(**optimizer))


def train_critic_window(critic, micro_batches) -> dict[str, float]:
    """A PPO critic step: old values from the critic itself, fixed returns."""
    old_values = [critic.compute_values(mb) for mb in micro_batches]
    returns = [token_targets(mb.input_ids)[1] for mb in micro_batches]
    return critic.train_window(
        micro_batches, old_values=old_values, returns=returns, clip_range=CLIP_RANGE
    )


def alignment_rank(rank, world_size, model_path, experiences):
    group = dist.group.WORLD
    critic = make_critic(model_path, group, torch.float64, lr=1e-3)
    probe = build_micro_batches(
        experiences, [0.0] * len(experiences), max_tokens_per_micro_batch=10_000, pad_token_id=PAD
    )[0]
    initial = critic.compute_values(probe)
    set_value_head(critic.model, *head_parameters(seed=1))
    values = critic.compute_values(probe)
    reference = build_plain_value_model(model_path, head_seed=1)
    with torch.no_grad():
        expected = [naive_values(reference, e.token_ids) for e in experiences]
    rows = [probe.input_ids[i, : e.num_tokens].tolist() for i, e in enumerate(experiences)]
    return {"initial": initial, "values": values, "expected": expected, "rows": rows,
            "mask": probe.attention_mask}


def test_values_start_at_zero_and_align_like_logprobs(model_path):
    experiences = make_experiences(seed=0, count=3)
    results = run_ranks(alignment_rank, 2, model_path, experiences)
    rank0 = results[0]
    assert rank0["initial"].shape == rank0["mask"].shape
    assert rank0["initial"].dtype == torch.float64
    assert torch.count_nonzero(rank0["initial"]) == 0
    values = rank0["values"]
    assert torch.count_nonzero(values[:, 0]) == 0
    # Rows are right-padded in the probe; each real prefix must match its own unpadded sequence.
    for row, (experience, expected) in enumerate(zip(experiences, rank0["expected"])):
        assert rank0["rows"][row] == experience.token_ids
        assert expected[1:].abs().min() > 0
        torch.testing.assert_close(values[row, : experience.num_tokens], expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(values, results[1]["values"], rtol=0, atol=0)


def gradient_invariance_rank(rank, world_size, model_path, experiences):
    single_group = dist.new_group([0])
    both_group = dist.new_group([0, 1])
    results = {}

    def window_gradients(critic, micro_batches):
        old_values, returns = zip(*(token_targets(mb.input_ids) for mb in micro_batches))
        sums = critic.compute_window_gradients(
            micro_batches, old_values=list(old_values), returns=list(returns), clip_range=CLIP_RANGE
        )
        dist.all_reduce(sums, group=critic.group)
        grads = full_gradients(critic.model)
        critic.optimizer.zero_grad(set_to_none=True)
        return grads, sums[1].item(), sums[2].item()  # action tokens, clipped tokens

    if rank == 0:
        reference = build_plain_value_model(model_path, head_seed=2)
        naive_window_loss(reference, experiences).backward()
        results["reference"] = full_gradients(reference)

        critic = make_critic(model_path, single_group, torch.float64, head_seed=2, lr=1e-3)
        one = build_micro_batches(
            experiences, [0.0] * len(experiences), max_tokens_per_micro_batch=10_000, pad_token_id=PAD
        )
        assert len(one) == 1
        results["1 rank, 1 micro-batch"] = window_gradients(critic, one)
        thirds = [slice(0, 2), slice(2, 7), slice(7, None)]
        three = [
            build_micro_batches(
                experiences[s], [0.0] * len(experiences[s]), max_tokens_per_micro_batch=10_000,
                pad_token_id=PAD,
            )[0]
            for s in thirds
        ]
        results["1 rank, 3 micro-batches"] = window_gradients(critic, three)

    critic = make_critic(model_path, both_group, torch.float64, head_seed=2, lr=1e-3)
    micro_batches = build_rank_micro_batches(experiences, both_group, budget=120)
    results["2 ranks"] = window_gradients(critic, micro_batches)
    return results, len(micro_batches)


def test_critic_gradient_is_invariant_to_micro_batches_and_ranks(model_path):
    experiences = make_experiences(seed=0, count=9)
    results = run_ranks(gradient_invariance_rank, 2, model_path, experiences)
    assert results[0][1] >= 2, "the 2-rank split should use several micro-batches"
    reference = results[0][0].pop("reference")
    backbone_name = "model.layers.0.self_attn.q_proj.weight"
    assert reference[backbone_name].abs().max() > 0, "a non-zero head lets gradients reach the backbone"
    num_action_tokens = sum(e.num_action_tokens for e in experiences)
    for rank_results, _ in results:
        for label, (grads, action_tokens, clipped_tokens) in rank_results.items():
            assert action_tokens == num_action_tokens, label
            assert 0 < clipped_tokens < action_tokens, f"{label}: both loss branches should occur"
            assert grads.keys() == reference.keys()
            for name, grad in grads.items():
                where = f"{label}: {name}"
                # fp64 throughout: summation order is the only difference.
                torch.testing.assert_close(
                    grad, reference[name], rtol=1e-6, atol=1e-12, msg=lambda m, where=where: f"{where}\n{m}"
                )


def training_rank(rank, world_size, model_path, experiences):
    group = dist.group.WORLD
    optimizer = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.0, "max_grad_norm": 1.0}
    critic = make_critic(model_path, group, torch.float32, **optimizer)
    micro_batches = build_rank_micro_batches(experiences, group, budget=100)
    return [train_critic_window(critic, micro_batches) for _ in range(6)]


def test_critic_training_reduces_value_loss(model_path):
    experiences = make_experiences(seed=3, count=6)
    results = run_ranks(training_rank, 2, model_path, experiences)
    metrics = results[0]
    assert metrics == results[1], "every rank logs the same global values"
    returns = torch.cat([
        token_targets(torch.tensor([e.token_ids]))[1][0][torch.tensor(e.action_mask) > 0]
        for e in experiences
    ]).double()
    first = metrics[0]
    # Values start at 0: the loss is half the mean squared return and nothing is clipped.
    assert math.isclose(first["value_loss"], 0.5 * returns.square().mean().item(), rel_tol=1e-6)
    assert first["value_mean"] == 0 and first["value_clip_fraction"] == 0
    assert math.isclose(first["return_mean"], returns.mean().item(), rel_tol=1e-6)
    expected_ev = 1 - returns.square().mean() / returns.var(unbiased=False)
    assert math.isclose(first["explained_variance"], expected_ev.item(), rel_tol=1e-5)
    assert first["value_grad_norm"] > 0
    losses = [m["value_loss"] for m in metrics]
    assert losses[-1] < 0.5 * losses[0], losses
    assert metrics[-1]["explained_variance"] > first["explained_variance"] + 0.5


def reference_rank(rank, world_size, model_path, experiences):
    group = dist.group.WORLD
    mesh = TrainerMesh.from_group(group, "cpu")
    actor = build_actor_model(model_path, mesh=mesh, device=CPU, plan=ShardingPlan(param_dtype=torch.float64))
    reference = build_reference_model(model_path, mesh=mesh, device=CPU, plan=ShardingPlan(param_dtype=torch.float64))
    probe = build_micro_batches(
        experiences, [1.0] * len(experiences), max_tokens_per_micro_batch=10_000, pad_token_id=PAD,
        temperature=TEMPERATURE,
    )[0]

    def logprobs_pair():
        with torch.no_grad():
            actor_logprobs = compute_token_logprobs(
                actor, probe.input_ids, probe.attention_mask, temperature=TEMPERATURE
            )
        actor.reshard()
        ref = compute_reference_logprobs(reference, probe)
        return actor_logprobs, ref

    before = logprobs_pair()
    # One policy update with the reference's forward inside the graph: the reference must stay
    # out of it (no grads) and keep its weights.
    optimizer = torch.optim.SGD(actor.parameters(), lr=1.0)
    logprobs = compute_token_logprobs(
        actor, probe.input_ids, probe.attention_mask, temperature=TEMPERATURE
    )
    ref_in_graph = compute_reference_logprobs(reference, probe)
    ((logprobs - ref_in_graph) * probe.action_mask).sum().backward()
    optimizer.step()
    after = logprobs_pair()
    return {
        "before": before,
        "after": after,
        "mask": probe.attention_mask,
        "ref_requires_grad": ref_in_graph.requires_grad,
        "trainable": [n for n, p in reference.named_parameters() if p.requires_grad],
        "grads": [n for n, p in reference.named_parameters() if p.grad is not None],
        "num_parameters": len(list(reference.parameters())),
        "training": reference.training,
    }


def test_reference_model_is_a_frozen_copy_of_the_initial_policy(model_path):
    experiences = make_experiences(seed=4, count=4)
    results = run_ranks(reference_rank, 2, model_path, experiences)
    for result in results:
        mask = result["mask"]
        (actor_before, ref_before), (actor_after, ref_after) = result["before"], result["after"]
        torch.testing.assert_close(ref_before * mask, actor_before * mask, rtol=1e-12, atol=1e-12)
        assert torch.equal(ref_after, ref_before), "the reference must not follow the actor"
        assert ((actor_after - actor_before) * mask).abs().max() > 1e-4, "the actor step should move it"
        assert result["num_parameters"] > 0
        assert result["trainable"] == [] and result["grads"] == []
        assert not result["ref_requires_grad"] and not result["training"]


def mixed_temperature_reference_rank(rank, world_size, model_path, experiences):
    """Reference log-probs of one padded and one packed micro-batch whose experiences carry their own
    temperatures (each experience's as [tokens])."""
    mesh = TrainerMesh.from_group(dist.group.WORLD, "cpu")
    reference = build_reference_model(model_path, mesh=mesh, device=CPU, plan=ShardingPlan(param_dtype=torch.float64))
    results = {}
    for layout in ("padded", "rows"):
        micro_batch = build_micro_batches(experiences, max_tokens_per_micro_batch=10_000, pad_token_id=PAD,
                                          layout=layout, temperature=TEMPERATURE)[0]
        logprobs = compute_reference_logprobs(reference, micro_batch)
        results[layout] = {index: logprobs[row, :experiences[index].num_tokens]
                           for row, index in enumerate(micro_batch.rows)}
    return results


def test_reference_log_probs_use_each_tokens_sampling_temperature(model_path):
    """The KL's reference side sees the same per-token temperatures as the actor: a naive fp64 loop
    at each token's temperature (TEMPERATURE where an experience has none), rtol/atol 1e-9."""
    experiences = make_experiences(seed=6, count=4)
    for experience in experiences[1:]:
        prompt = experience.action_mask.index(1)
        experience.temperatures = [1.0] * prompt + [0.5, 1.25] * experience.num_tokens
        experience.temperatures = experience.temperatures[:experience.num_tokens]
    results = run_ranks(mixed_temperature_reference_rank, 1, model_path, experiences)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    worst_single = 0.0
    with torch.no_grad():
        for index, experience in enumerate(experiences):
            logits = model(input_ids=torch.tensor([experience.token_ids])).logits[0]
            temperatures = experience.temperatures or [TEMPERATURE] * experience.num_tokens
            expected = torch.tensor([0.0] + [torch.log_softmax(logits[t - 1] / temperatures[t], -1)[token].item()
                                             for t, token in enumerate(experience.token_ids) if t > 0],
                                    dtype=torch.float64)
            single = torch.tensor([0.0] + [torch.log_softmax(logits[t - 1] / TEMPERATURE, -1)[token].item()
                                           for t, token in enumerate(experience.token_ids) if t > 0],
                                  dtype=torch.float64)
            worst_single = max(worst_single, (single - expected).abs().max().item())
            for layout in ("padded", "rows"):
                torch.testing.assert_close(results[layout][index], expected, rtol=1e-9, atol=1e-9)
    assert worst_single > 1e-2  # the test can fail: one temperature for all is far off
