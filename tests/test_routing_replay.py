"""Routing replay (molt.trainer.routing_replay) on a small transformers Qwen3-MoE, against naive loops."""

import pytest
import torch
import transformers

from molt.trace.routes import UNKNOWN
from molt.trainer.routing_replay import RoutingReplay, find_routers

NUM_EXPERTS, TOP_K = 6, 2


def build_model(seed: int = 0) -> transformers.Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True, router_aux_loss_coef=0.01)
    model = transformers.Qwen3MoeForCausalLM(config).float()
    for router in find_routers(model).values():  # spread the router logits so the top-k is far from ties
        torch.nn.init.normal_(router.weight, std=1.0)
    return model.eval()


def live_routes(model, input_ids: torch.Tensor) -> torch.Tensor:
    """[rows, len, layers, top_k] the experts each unpatched router picks."""
    picked = []
    hooks = [router.register_forward_hook(lambda module, args, output: picked.append(output[2]))
             for router in find_routers(model).values()]
    with torch.no_grad():
        model(input_ids=input_ids)
    for hook in hooks:
        hook.remove()
    return torch.stack(picked, dim=1).view(*input_ids.shape, len(picked), TOP_K)


def naive_moe_block(block, hidden: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """One sparse MoE block, position by position: the softmax of the router logits over all
    experts, renormalised over the chosen ones, times each chosen expert's SwiGLU output."""
    out = torch.zeros_like(hidden)
    weight = block.gate.weight
    for position in range(hidden.shape[0]):
        x = hidden[position]
        probs = torch.softmax(weight @ x, dim=-1)
        chosen = experts[position]
        gates = probs[chosen] / probs[chosen].sum()
        for gate, expert in zip(gates, chosen.tolist()):
            gate_proj, up_proj = (block.experts.gate_up_proj[expert] @ x).chunk(2)
            out[position] += gate * (block.experts.down_proj[expert] @ (torch.nn.functional.silu(gate_proj) * up_proj))
    return out


def test_replaying_the_live_routes_changes_nothing():
    model = build_model()
    input_ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
    routes = live_routes(model, input_ids)
    replay = RoutingReplay.install(model, replay=True, aux_loss_coef=0.0)
    scored = torch.ones(input_ids.shape, dtype=torch.bool)
    with torch.no_grad(), replay.use(routes.to(torch.int16), scored, None):
        got = model(input_ids=input_ids).logits
        counts = replay.take_counts()
    assert torch.allclose(got, expected, atol=1e-6)
    assert counts["route_matched"].tolist() == counts["route_compared"].tolist() == [14.0, 14.0]
    assert counts["route_covered"].item() == counts["route_scored"].item() == 14


def test_replay_routes_recorded_positions_through_the_recorded_experts():
    """A block fed other experts than its router would pick computes exactly the naive loop over
    those experts, live routing where the route is unknown; alignment counts the disagreements."""
    model = build_model()
    block = model.model.layers[0].mlp
    hidden = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    live = torch.topk(hidden @ block.gate.weight.T, TOP_K, dim=-1).indices
    recorded = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 0], [UNKNOWN, UNKNOWN]])
    routes = torch.stack([recorded, recorded], dim=1)  # [positions, layers, top_k]
    expected_experts = torch.where(recorded[:, :1] >= 0, recorded, live)
    replay = RoutingReplay.install(model, replay=True, aux_loss_coef=0.0)
    scored = torch.tensor([True, True, False, True, True])
    with torch.no_grad(), replay.use(routes.view(1, 5, 2, TOP_K), scored, None):
        got = block(hidden.view(1, 5, 32)).view(5, 32)
        counts = replay.take_counts()
    assert torch.allclose(got, naive_moe_block(block, hidden, expected_experts), atol=1e-5)
    agrees = [set(r.tolist()) == set(l.tolist()) for r, l in zip(recorded, live)]
    compared = [s and r[0] >= 0 for s, r in zip(scored.tolist(), recorded.tolist())]
    assert counts["route_compared"][0].item() == sum(compared) == 3
    assert counts["route_matched"][0].item() == sum(a and c for a, c in zip(agrees, compared))
    assert counts["route_covered"].item() == 3 and counts["route_scored"].item() == 4


def test_measuring_without_replay_keeps_live_routing():
    model = build_model()
    input_ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
    routes = torch.zeros(1, 6, 2, TOP_K, dtype=torch.int16)  # experts {0} twice: never the live set
    replay = RoutingReplay.install(model, replay=False, aux_loss_coef=0.0)
    with torch.no_grad(), replay.use(routes, torch.ones(1, 6, dtype=torch.bool), None):
        got = model(input_ids=input_ids).logits
        counts = replay.take_counts()
    assert torch.equal(got, expected)
    assert counts["route_matched"].sum().item() == 0 and counts["route_compared"].sum().item() == 12


def test_the_router_keeps_its_gradient_under_replay():
    model = build_model().train()
    input_ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(4))
    routes = live_routes(model, input_ids).flip(-1)  # same sets, other order
    replay = RoutingReplay.install(model, replay=True, aux_loss_coef=0.0)
    with replay.use(routes, torch.ones(1, 6, dtype=torch.bool), None):
        model(input_ids=input_ids).logits.square().mean().backward()
    for router in find_routers(model).values():
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_load_balancing_loss_is_the_models_own():
    model = build_model()
    input_ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(input_ids)
    with torch.no_grad():
        expected = model(input_ids=input_ids, attention_mask=mask, output_router_logits=True).aux_loss
    assert RoutingReplay.install(build_model(), replay=False, aux_loss_coef=None).aux_loss_coef == 0.01  # config's
    replay = RoutingReplay.install(model, replay=False, aux_loss_coef=0.01)
    with torch.no_grad(), replay.use(None, torch.ones(2, 5, dtype=torch.bool), mask):
        model(input_ids=input_ids, attention_mask=mask)
        got = replay.load_balancing_loss()
    assert got is not None and torch.allclose(got, expected, rtol=1e-6)


def test_routes_are_indexed_by_decoder_layer_when_some_layers_are_dense():
    """The routes' layer axis counts every decoder layer (as the engine records them); with layer 0
    dense, the MoE router of layer 1 reads index 1, and index 0 is never read."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K, mlp_only_layers=[0])
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    assert list(find_routers(model)) == [1]
    torch.nn.init.normal_(model.model.layers[1].mlp.gate.weight, std=1.0)
    input_ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
    picked = []
    hook = model.model.layers[1].mlp.gate.register_forward_hook(lambda m, a, output: picked.append(output[2]))
    with torch.no_grad():
        model(input_ids=input_ids)
    hook.remove()
    routes = torch.zeros(1, 6, 2, TOP_K, dtype=torch.int16)  # index 0: experts {0} twice, never a real route
    routes[0, :, 1] = picked[0].to(torch.int16)
    replay = RoutingReplay.install(model, replay=True)
    with torch.no_grad(), replay.use(routes, torch.ones(1, 6, dtype=torch.bool), None):
        got = model(input_ids=input_ids).logits
        counts = replay.take_counts()
    assert torch.allclose(got, expected, atol=1e-6)
    assert counts["route_matched"].tolist() == counts["route_compared"].tolist() == [6.0]


def test_replay_on_a_dense_model_is_refused():
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    dense = transformers.Qwen3ForCausalLM(config)
    assert RoutingReplay.install(dense, replay=False, aux_loss_coef=0.0) is None
    with pytest.raises(ValueError, match="routing_replay=True"):
        RoutingReplay.install(dense, replay=True, aux_loss_coef=0.0)
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.01"):
        RoutingReplay.install(dense, replay=False, aux_loss_coef=0.01)
    assert RoutingReplay.install(dense, replay=False, aux_loss_coef=None) is None


# -- the actor, on the tiny MoE, FSDP2 over gloo ----------------------------------------------------


def routed_experiences(seed: int, count: int, num_layers: int, num_experts: int, top_k: int):
    """make_experiences' traces with random recorded routes (distinct experts per position), some
    positions unknown, and one experience without routes."""
    from test_actor import make_experiences

    experiences, advantages = make_experiences(seed, count)
    generator = torch.Generator().manual_seed(seed)
    for index, experience in enumerate(experiences):
        experience.token_ids = [token * 5 for token in experience.token_ids]  # across the MoE's 320-token vocab
        if index == 3:
            continue
        ranks = torch.rand(experience.num_tokens, num_layers, num_experts, generator=generator)
        routes = ranks.argsort(dim=-1)[..., :top_k].to(torch.int16)
        routes[torch.rand(experience.num_tokens, generator=generator) < 0.2] = UNKNOWN
        experience.routed_experts = routes
    return experiences, advantages


def replayed_naive_loss(model, replay, experiences, advantages) -> torch.Tensor:
    """test_actor's naive token-mean loss, one experience at a time, each forward replaying its routes."""
    from test_actor import naive_window_loss

    total, count = 0, 0
    for experience, advantage in zip(experiences, advantages):
        num_actions = sum(experience.action_mask)
        routes = experience.routed_experts
        scored = torch.ones(1, experience.num_tokens, dtype=torch.bool)
        with replay.use(None if routes is None else routes[None], scored, None):
            total = total + naive_window_loss(model, [experience], [advantage]) * num_actions
        count += num_actions
    return total / count


def replay_gradients_rank(rank, world_size, model_path, experiences, advantages):
    import torch.distributed as dist
    from test_actor import PAD, TEMPERATURE, build_rank_micro_batches, full_gradients, window_gradients

    from molt.trainer.actor import Actor
    from molt.trainer.sharded_model import build_actor_model
    from molt.trainer.batch import build_micro_batches
    from molt.trainer.optimizer import OptimizerSettings
    from molt.distributed.parallelize import ShardingPlan, TrainerMesh

    def make_replaying_actor(group, plan):
        model = build_actor_model(model_path, mesh=TrainerMesh.from_group(group, "cpu"), device=torch.device("cpu"),
                                  plan=plan)
        model.set_experts_implementation("eager")  # grouped_mm, the CPU default, takes no float64
        routing = RoutingReplay.install(model, replay=True, aux_loss_coef=0.0)
        return Actor(model, group=group, device=torch.device("cpu"), temperature=TEMPERATURE, routing=routing,
                     optimizer=OptimizerSettings(lr=1e-3))

    single, both = dist.new_group([0]), dist.new_group([0, 1])
    fp64 = ShardingPlan(param_dtype=torch.float64)
    results = {}
    if rank == 0:
        reference = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64,
                                                                      experts_implementation="eager")
        replayed_naive_loss(reference, RoutingReplay.install(reference, replay=True), experiences,
                            advantages).backward()
        results["reference"] = {name: p.grad for name, p in reference.named_parameters()}
        for layout, plan in (("padded", fp64), ("rows", fp64),
                             ("rows", ShardingPlan(param_dtype=torch.float64, checkpoint_every=1))):
            actor = make_replaying_actor(single, plan)
            micro_batches = build_micro_batches(experiences, advantages, max_tokens_per_micro_batch=10_000,
                                                pad_token_id=PAD, layout=layout, temperature=TEMPERATURE)
            label = f"1 rank, {layout}{', checkpointed' if plan.checkpoint_every else ''}"
            results[label] = window_gradients(actor, micro_batches)
    actor = make_replaying_actor(both, fp64)
    micro_batches = build_rank_micro_batches(experiences, advantages, both, budget=120)
    results["2 ranks"] = window_gradients(actor, micro_batches)
    return results


def test_actor_replays_routes_in_every_layout(moe_model_dir):
    """The actor's window gradient under routing replay equals a naive per-sequence loop that
    replays each experience's routes, whether the micro-batch is padded or packed, checkpointed
    (the backward's recomputed forward routes the same way) or split over 2 FSDP2 ranks (fp64,
    rtol 1e-6). Without replay the gradient differs, so the routes do reach the routers."""
    from distributed import run_ranks

    config = transformers.AutoConfig.from_pretrained(moe_model_dir)
    experiences, advantages = routed_experiences(0, 8, config.num_hidden_layers, config.num_experts,
                                                 config.num_experts_per_tok)
    results = run_ranks(replay_gradients_rank, 2, str(moe_model_dir), experiences, advantages)
    reference = results[0].pop("reference")
    live = transformers.AutoModelForCausalLM.from_pretrained(moe_model_dir, dtype=torch.float64,
                                                             experts_implementation="eager")
    replayed_naive_loss(live, RoutingReplay.install(live, replay=False), experiences, advantages).backward()
    assert max((p.grad - reference[name]).abs().max().item() for name, p in live.named_parameters()) > 1e-6
    assert len(results[0]) == 4
    for rank_results in results:
        for label, grads in rank_results.items():
            assert grads.keys() == reference.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(grad, reference[name], rtol=1e-6, atol=1e-12,
                                           msg=lambda m: f"{label}: {name}\n{m}")


# -- against the real engine ------------------------------------------------------------------------


def test_replay_brings_the_trainer_closer_to_the_engine(moe_engine, moe_model_dir):
    """On tokens the real engine (fp32) sampled, a bf16 trainer forward, whose router rounds
    differently, matches the engine's log-probs better when it replays the engine's routes.
    Measured here: mismatch KL 7.1e-6 -> 1.4e-6, largest |diff| 0.066 -> 0.0071 (48 prompts x 32
    tokens; route alignment 0.994, so about 18 of 3000 position-layers flip without replay)."""
    import asyncio

    from molt.agents.base import SamplingParams

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 310, (24,), generator=generator).tolist() for _ in range(48)]

    async def generate_all():
        sampling = SamplingParams(max_tokens=32, temperature=1.0)
        return await asyncio.gather(*(moe_engine.engine.generate(prompt, sampling) for prompt in prompts))

    generations = moe_engine.run(generate_all())
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_model_dir, dtype=torch.bfloat16).eval()
    replay = RoutingReplay.install(model, replay=False)
    figures = {}
    for mode in ("live", "replay"):
        replay.replay = mode == "replay"
        diffs, matched, compared = [], 0.0, 0.0
        for prompt, generation in zip(prompts, generations):
            ids = prompt + generation.token_ids
            scored = torch.zeros(1, len(ids), dtype=torch.bool)
            scored[0, len(prompt) - 1:-1] = True  # the positions that predict sampled tokens
            with torch.no_grad(), replay.use(generation.routed_experts[None], scored, None):
                logits = model(input_ids=torch.tensor([ids])).logits[0].float()
                counts = replay.take_counts()
            matched += counts["route_matched"].sum().item()
            compared += counts["route_compared"].sum().item()
            trainer = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
            trainer = trainer.gather(-1, torch.tensor(generation.token_ids)[:, None]).squeeze(-1)
            diffs.append(trainer - torch.tensor(generation.logprobs))
        diff = torch.cat(diffs)
        # KL(behaviour || trainer) per token, k3 estimator on the behaviour's samples (as train/mismatch_kl).
        figures[mode] = {"kl": (diff.exp() - 1 - diff).mean().item(), "max": diff.abs().max().item(),
                         "alignment": matched / compared}
    live, replayed = figures["live"], figures["replay"]
    assert compared == sum(len(g.token_ids) for g in generations) * 2  # every scored position has a route
    assert live["alignment"] < 1.0, f"no route flipped, so there is nothing to replay: {figures}"
    assert replayed["kl"] < 0.5 * live["kl"] and replayed["max"] < live["max"], figures
