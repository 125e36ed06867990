"""Expert parallelism on the trainer (molt.distributed.expert_parallel, layout.trainer_expert_parallel_size)
and the router freeze (train.freeze_router): on 2 gloo ranks, EP=2 gives plain FSDP2's loss,
gradients, gradient norm and AdamW step; the all-to-all experts module gives transformers' own
experts forward and backward, including ranks that send an expert nothing or have no tokens."""

import pytest
import torch
import torch.distributed as dist
import transformers
from distributed import run_ranks
from test_actor import PAD, TEMPERATURE, make_experiences
from test_dry_run import QWEN3_RECIPE, run_dry_run
from test_tensor_parallel import rank_micro_batches
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from molt.config import ConfigError, MoltConfig, validate_config
from molt.distributed.expert_parallel import ExpertParallelExperts, check_expert_parallel_support, freeze_routers
from molt.models.moe import count_experts
from molt.distributed.parallelize import ShardingPlan, build_trainer_mesh
from molt.trainer.actor import Actor, PolicyLoss
from molt.trainer.sharded_model import build_actor_model
from molt.trainer.checkpoint import load_checkpoint, save_checkpoint
from molt.trainer.critic import build_reference_model, build_value_model, compute_reference_logprobs
from molt.trainer.optimizer import OptimizerSettings

CPU = torch.device("cpu")
LOSS = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, entropy_coef=0.01)
NUM_EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 64, 32
# fp32 sums in a different order (tokens regrouped by rank and expert): a few float32 ulps per
# term, far below what a token sent to the wrong expert or a lost gradient changes.
RTOL, ATOL = 1e-5, 1e-6


def moe_config() -> transformers.Qwen3MoeConfig:
    """Three blocks, the middle one dense (mlp_only_layers), 8 experts top-2: several experts per
    ep rank, and some expert that a rank's tokens never reach."""
    return transformers.Qwen3MoeConfig(
        hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        intermediate_size=64, moe_intermediate_size=INTER, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
        mlp_only_layers=[1], norm_topk_prob=True, vocab_size=67, max_position_embeddings=128,
        tie_word_embeddings=False, initializer_range=0.1, pad_token_id=PAD)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(moe_config())
    with torch.no_grad():
        for parameter in model.parameters():  # no weight keeps its init value (norms start at 1)
            parameter.add_(0.05 * torch.randn_like(parameter))
    path = tmp_path_factory.mktemp("ep-moe")
    model.save_pretrained(path)  # transformers writes experts per expert, as released checkpoints do
    return str(path)


def full_gradients(model) -> dict[str, torch.Tensor | None]:
    """Each parameter's whole gradient (None for a frozen one)."""
    return {name: None if p.grad is None else p.grad.full_tensor().detach().clone()
            for name, p in model.named_parameters()}


def exp_avgs(actor) -> dict[str, torch.Tensor]:
    """AdamW's first moment of each trained parameter, whole."""
    return {name: actor.optimizer.state[p]["exp_avg"].full_tensor().clone()
            for name, p in actor.model.named_parameters() if p in actor.optimizer.state}


def layouts_rank(rank, world_size, model_path, checkpoint_root):
    """EP=1 (plain FSDP2 over both ranks), EP=2, and EP=2 with frozen routers: weights as loaded,
    the window's loss, gradients, gradient norm, and the weights after one AdamW step; then EP=2's
    checkpoint (DCP) loaded into a fresh EP=1 actor."""
    experiences, advantages = make_experiences(seed=7, count=8)
    plan = ShardingPlan(param_dtype=torch.float32, checkpoint_every=1)  # recomputation reruns the all-to-alls
    results = {}
    for name, ep, freeze in (("fsdp", 1, False), ("ep", 2, False), ("ep_frozen", 2, True)):
        mesh = build_trainer_mesh(num_trainer_ranks=world_size, device_type="cpu", expert_parallel_size=ep)
        model = build_actor_model(model_path, mesh=mesh, device=CPU, plan=plan, freeze_router=freeze)
        actor = Actor(model, group=mesh.dp_group, device=CPU, temperature=TEMPERATURE, max_grad_norm=0.1,
                      optimizer=OptimizerSettings(lr=1e-3, eps=1e-2))
        loaded = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        totals = actor.compute_window_gradients(rank_micro_batches(mesh, experiences, advantages), LOSS)
        loss = totals["loss"].clone()
        dist.all_reduce(loss, group=mesh.dp_group)
        grads = full_gradients(model)
        grad_norm, stepped = actor.step_optimizer()
        results[name] = {
            "loaded": loaded, "loss": loss.item(), "grads": grads, "grad_norm": grad_norm, "stepped": stepped,
            "stepped_weights": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
            "placements": {n: (p.device_mesh.mesh_dim_names, p.placements, tuple(p.to_local().shape))
                           for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj")},
            "ep": (mesh.ep_rank, mesh.ep_size, dist.get_process_group_ranks(mesh.ep_group) if ep > 1 else None),
            "exp_avg": exp_avgs(actor),
        }
        if name == "ep":
            saved = save_checkpoint(checkpoint_root, 1, trainables={"actor": actor}, group=dist.group.WORLD,
                                    rank=rank, state={}, keep_last=1)
    mesh = build_trainer_mesh(num_trainer_ranks=world_size, device_type="cpu")
    actor = Actor(build_actor_model(model_path, mesh=mesh, device=CPU, plan=plan), group=mesh.dp_group, device=CPU,
                  optimizer=OptimizerSettings(lr=1e-3, eps=1e-2))
    load_checkpoint(saved, trainables={"actor": actor}, group=dist.group.WORLD, rank=rank)
    results["resumed"] = {"weights": {n: p.full_tensor().clone() for n, p in actor.model.named_parameters()},
                          "exp_avg": exp_avgs(actor)}
    for ep in (1, 2):
        results[f"critic_ep{ep}"] = critic_and_reference(model_path, world_size, ep, experiences, advantages)
    return results


def critic_and_reference(model_path, world_size, ep, experiences, advantages) -> dict:
    """The value model's values and gradients under FSDP2's default (mean) reduction, and the frozen
    reference's log-probs: they go through the same layout as the actor."""
    mesh = build_trainer_mesh(num_trainer_ranks=world_size, device_type="cpu", expert_parallel_size=ep)
    micro_batches = rank_micro_batches(mesh, experiences, advantages)
    critic = build_value_model(model_path, mesh=mesh, device=CPU, plan=ShardingPlan())
    with torch.no_grad():  # a non-zero head, so gradients reach the experts
        for parameter, value in ((critic.value_head.weight, 0.1), (critic.value_head.bias, 0.2)):
            parameter.fill_(value)
    values = [micro_batch.to_rows(critic(**micro_batch.model_inputs())) for micro_batch in micro_batches]
    sum((v * mb.action_mask).square().sum() for v, mb in zip(values, micro_batches)).backward()
    reference = build_reference_model(model_path, mesh=mesh, device=CPU, plan=ShardingPlan())
    return {"values": torch.cat([v.detach().flatten() for v in values]), "grads": full_gradients(critic),
            "reference": torch.cat([compute_reference_logprobs(reference, mb).flatten() for mb in micro_batches])}


@pytest.fixture(scope="module")
def layouts(moe_path, tmp_path_factory):
    return run_ranks(layouts_rank, 2, moe_path, str(tmp_path_factory.mktemp("ep-checkpoints")), timeout_seconds=240)


def assert_close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: different parameter names"
    for name in want:
        if want[name] is None:
            assert got[name] is None, f"{what} {name}"
            continue
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {name}: {m}")


def test_expert_parallel_matches_fsdp(layouts):
    fsdp, ep = layouts[0]["fsdp"], layouts[0]["ep"]
    assert_close(ep["loaded"], fsdp["loaded"], "loaded weights")  # same names, whole tensors through full_tensor
    assert ep["loss"] == pytest.approx(fsdp["loss"], rel=RTOL)
    assert_close(ep["grads"], fsdp["grads"], "gradient")
    assert any(g.abs().max() > 0 for n, g in fsdp["grads"].items() if "experts" in n)
    assert ep["stepped"] and ep["grad_norm"] == pytest.approx(fsdp["grad_norm"], rel=RTOL)
    assert fsdp["grad_norm"] > 0.1  # clipping is active, so the mixed-mesh clip is checked too
    assert_close(ep["stepped_weights"], fsdp["stepped_weights"], "weights after a step")
    assert_close(ep["exp_avg"], fsdp["exp_avg"], "AdamW exp_avg")
    # Rank 1 holds experts 4..7 of each MoE layer (blocks 0 and 2; block 1 is dense).
    assert layouts[1]["ep"]["ep"] == (1, 2, [0, 1])
    placements = layouts[1]["ep"]["placements"]
    assert sorted(placements) == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.gate_up_proj"]
    dims, _, local_shape = placements["model.layers.0.mlp.experts.gate_up_proj"]
    assert dims == ("dp_shard_mod_ep", "ep") and local_shape == (NUM_EXPERTS // 2, 2 * INTER, HIDDEN)


def test_expert_parallel_checkpoint_resumes_without_it(layouts):
    """DCP stores whole tensors under the Hugging Face names: EP=2's weights and AdamW state load
    exactly into an EP=1 layout."""
    ep, resumed = layouts[0]["ep"], layouts[0]["resumed"]
    for what in ("weights", "exp_avg"):
        want = ep["stepped_weights"] if what == "weights" else ep["exp_avg"]
        assert resumed[what].keys() == want.keys()
        for name in want:
            assert torch.equal(resumed[what][name], want[name]), f"{what} {name}"


def test_critic_and_reference_under_expert_parallel(layouts):
    for result in layouts:
        baseline, ep = result["critic_ep1"], result["critic_ep2"]
        assert baseline["grads"]["model.layers.0.mlp.experts.down_proj"].abs().max() > 0
        torch.testing.assert_close(ep["values"], baseline["values"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(ep["reference"], baseline["reference"], rtol=RTOL, atol=ATOL)
        for name, grad in ep["grads"].items():  # a squared loss: gradients up to ~100, so atol scales
            expected = baseline["grads"][name]
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6 * expected.abs().max(), msg=name)


def test_freeze_router_keeps_router_and_trains_the_rest(layouts):
    frozen = layouts[0]["ep_frozen"]
    routers = [name for name in frozen["loaded"] if name.endswith("mlp.gate.weight")]
    assert routers == ["model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"]
    for name, weight in frozen["stepped_weights"].items():
        if name in routers:
            assert frozen["grads"][name] is None and torch.equal(weight, frozen["loaded"][name]), name
        else:
            assert not torch.equal(weight, frozen["loaded"][name]), f"{name} did not train"


def experts_rank(rank, world_size, routes, num_tokens):
    """ExpertParallelExperts on this rank's tokens against transformers' eager experts module on
    the same tokens: output and the gradients of the input, routing weights and (gathered) weights."""
    torch.manual_seed(0)  # same weights on both ranks
    config = moe_config()
    config._experts_implementation = "eager"
    reference = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    with torch.no_grad():
        reference.gate_up_proj.normal_(0, 0.1)
        reference.down_proj.normal_(0, 0.1)
    torch.manual_seed(1 + rank)  # different tokens per rank
    hidden = torch.randn(num_tokens[rank], HIDDEN, requires_grad=True)
    weights = torch.rand(num_tokens[rank], TOP_K, requires_grad=True)
    index = torch.tensor(routes[rank], dtype=torch.int64).view(num_tokens[rank], TOP_K)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("ep",))
    parallel = ExpertParallelExperts(reference, mesh)
    results = {}
    for name, module in (("reference", reference), ("parallel", parallel)):
        output = module(hidden, index, weights)
        if output.requires_grad:  # transformers' module returns a constant for no tokens; ours must still run backward
            (output * torch.linspace(-1, 1, HIDDEN)).sum().backward()
        grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.full_tensor() if isinstance(p.grad, DTensor)
                 else p.grad for n, p in module.named_parameters()}
        results[name] = {"output": output.detach(), "hidden": torch.zeros_like(hidden) if hidden.grad is None
                         else hidden.grad.clone(), "weights": torch.zeros_like(weights) if weights.grad is None
                         else weights.grad.clone(), **grads}
        hidden.grad, weights.grad = None, None
    return results


@pytest.mark.parametrize("routes, num_tokens", [
    # Rank 0 sends nothing to rank 1's experts (4..7); rank 1 sends nothing to experts 0, 1, 5.
    ([[0, 1, 2, 3, 3, 0], [2, 4, 6, 7, 3, 4, 7, 6]], (3, 4)),
    # Rank 1 has no tokens at all (it still takes part in both all-to-alls).
    ([[5, 0, 7, 1], []], (2, 0)),
], ids=["uneven", "empty-rank"])
def test_experts_module_matches_transformers(routes, num_tokens):
    results = run_ranks(experts_rank, 2, routes, num_tokens)
    for rank in range(2):
        for name in ("output", "hidden", "weights"):
            torch.testing.assert_close(results[rank]["parallel"][name], results[rank]["reference"][name],
                                       rtol=RTOL, atol=ATOL, msg=lambda m: f"rank {rank} {name}: {m}")
    # Each expert's weight gradient gathers both ranks' tokens: the sum of the two references.
    for name in ("gate_up_proj", "down_proj"):
        summed = results[0]["reference"][name] + results[1]["reference"][name]
        torch.testing.assert_close(results[0]["parallel"][name], summed, rtol=RTOL, atol=ATOL)


def expert_mesh_rank(rank, world_size, num_trainers, replicate):
    """The last world rank is a rollout rank, which takes part in making the groups."""
    mesh = build_trainer_mesh(num_trainer_ranks=num_trainers, device_type="cpu", data_parallel_replicate=replicate,
                              expert_parallel_size=2)
    if mesh is None:
        return None
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total, group=mesh.ep_group)
    return (mesh.ep_rank, dist.get_process_group_ranks(mesh.ep_group), mesh.expert_fsdp_mesh.mesh_dim_names,
            mesh.expert_fsdp_mesh.mesh.flatten().tolist(), total.item())


def test_expert_mesh_ranks_and_groups():
    results = run_ranks(expert_mesh_rank, 3, 2, 1)
    assert results[2] is None
    assert results[0] == (0, [0, 1], ("dp_shard_mod_ep",), [0], 3.0)
    assert results[1] == (1, [0, 1], ("dp_shard_mod_ep",), [1], 3.0)
    # HSDP: 2 replicas of dp_shard 2 = ep 2; a rank's experts are replicated on rank + 2 (mod 4).
    results = run_ranks(expert_mesh_rank, 5, 4, 2)
    assert results[4] is None
    assert results[3] == (1, [2, 3], ("dp_replicate", "dp_shard_mod_ep"), [1, 3], 7.0)


def test_config_refuses_ep_that_does_not_split_dp_shard():
    cfg = MoltConfig()
    cfg.layout.num_trainer_ranks = 4
    cfg.layout.trainer_data_parallel_replicate = 2
    cfg.layout.trainer_expert_parallel_size = 4
    with pytest.raises(ConfigError, match=r"trainer_expert_parallel_size=4 does not divide the dp_shard size 2"):
        validate_config(cfg, require_files=False)
    cfg.layout.trainer_data_parallel_replicate, cfg.layout.trainer_tensor_parallel_size = 1, 2
    cfg.layout.trainer_expert_parallel_size = 2
    with pytest.raises(ConfigError, match=r"trainer_expert_parallel_size=2 with trainer_tensor_parallel_size=2"):
        validate_config(cfg, require_files=False)


def test_model_refusals():
    with torch.device("meta"):
        moe = transformers.Qwen3MoeForCausalLM(moe_config()).model
        dense = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            intermediate_size=64, vocab_size=67)).model
    assert count_experts(moe.config) == NUM_EXPERTS and count_experts(dense.config) == 0
    check_expert_parallel_support(moe, 4)
    with pytest.raises(ValueError, match=r"trainer_expert_parallel_size=3 does not divide the model's num_experts=8"):
        check_expert_parallel_support(moe, 3)
    with pytest.raises(ValueError, match=r"trainer_expert_parallel_size=2: Qwen3Model is a dense model"):
        check_expert_parallel_support(dense, 2)
    with pytest.raises(ValueError, match=r"freeze_router=True but Qwen3Model has no MoE router"):
        freeze_routers(dense)
    assert freeze_routers(moe) == ["layers.0.mlp.gate.weight", "layers.2.mlp.gate.weight"]
    assert not moe.layers[0].mlp.gate.weight.requires_grad and moe.layers[0].mlp.experts.down_proj.requires_grad


def test_dry_run_shows_the_ep_axis(tmp_path):
    """--dry-run builds the EP layout on its fake process group (HSDP here: 2 replicas x dp_shard 4
    = 2 x ep 2) and prints it; a block's gathered FSDP unit holds 1/ep of its experts."""
    result = run_dry_run(QWEN3_RECIPE, "layout.trainer_data_parallel_replicate=2",
                         "layout.trainer_expert_parallel_size=2", "layout.gpu_memory_gigabytes=0",
                         checkpoints=tmp_path / "absent")
    assert result.returncode == 0, result.stderr
    assert ("dp_replicate 2 x dp_shard 4 x tp 1, 8 data-parallel rank(s); experts: dp_shard_mod_ep 2 x ep 2, "
            "each rank holds 1/2 of every MoE layer's experts") in result.stdout
    # A block (623,120,640 params, 603,979,776 of them routed experts) gathers 321,130,752 under ep 2,
    # so the root unit is the largest; without EP the block is (test_dry_run).
    assert "largest FSDP unit, root (embeddings, final norm, LM head): 622,331,904 params" in result.stdout
    # Each rank holds 1/4 of everything: dense weights over dp_shard 4, experts over ep 2 x dp_shard_mod_ep 2.
    assert "rank 0's shard, the largest: 7,633,030,656 params, total / 8 = 3,816,515,328" in result.stdout
