"""The trainer mesh dp_replicate x dp_shard x tp (molt.distributed.parallelize): tensor parallelism with
sequence-parallel norms and HSDP give plain FSDP2's loss and gradients, and every layout loads and
gathers the checkpoint's weights. Gloo worlds of 3 processes where rank 2 plays a rollout rank (in
the world, not in the mesh)."""

import pytest
import torch
import torch.distributed as dist
import transformers
from distributed import run_ranks
from safetensors.torch import load_file
from test_actor import PAD, TEMPERATURE, full_gradients, make_experiences, with_turn_temperatures
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Shard, distribute_tensor

from molt.distributed.parallelize import ShardingPlan, TrainerMesh, build_trainer_mesh, check_tensor_parallel_support
from molt.models.hf_checkpoint import build_empty_model
from molt.trainer.actor import Actor, PolicyLoss
from molt.trainer.sharded_model import build_actor_model
from molt.trainer.batch import assign_to_ranks, build_micro_batches
from molt.trainer.critic import build_reference_model, build_value_model, compute_reference_logprobs
from molt.trainer.optimizer import OptimizerSettings

CPU = torch.device("cpu")
NUM_TRAINERS = 2
LOSS = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, entropy_coef=0.01)
# (dp_replicate, tp) of a 2-rank trainer mesh; dp_shard takes the rest.
LAYOUTS = {"fsdp": (1, 1), "tp": (1, 2), "hsdp": (2, 1)}


def save_model(path, architecture: str, *, tied: bool, vocab_size: int = 67) -> str:
    """Two blocks of two 64-wide attention and KV heads (vLLM's smallest head), norms perturbed so
    no weight keeps its init value; an odd vocabulary, so its rows split unevenly over ranks; pad
    id 5 also occurs inside sequences (the embedding's padding_idx must hold when vocab-sharded)."""
    sizes = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                 intermediate_size=128, vocab_size=vocab_size, max_position_embeddings=128, tie_word_embeddings=tied,
                 initializer_range=0.1, pad_token_id=5)
    config_class, model_class = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                                 "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[architecture]
    torch.manual_seed(0)
    model = model_class(config_class(**sizes))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory) -> str:
    return save_model(tmp_path_factory.mktemp("tp-qwen3"), "qwen3", tied=True)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return save_model(tmp_path_factory.mktemp("tp-llama"), "llama", tied=False)


def rank_micro_batches(mesh, experiences, advantages) -> list:
    """This data-parallel index's share of the window (the tp ranks of one index share it): one
    padded and one packed micro-batch."""
    mine = assign_to_ranks(experiences, mesh.dp_size)[mesh.dp_rank]
    experiences, advantages = [experiences[i] for i in mine], [advantages[i] for i in mine]
    half = len(experiences) // 2
    return [build_micro_batches(experiences[part], advantages[part], max_tokens_per_micro_batch=10_000,
                                pad_token_id=PAD, layout=layout, temperature=TEMPERATURE)[0]
            for part, layout in ((slice(0, half), "padded"), (slice(half, None), "rows"))]


def layouts_rank(rank, world_size, model_path, compute_dtype):
    """For each layout: the gathered weights after loading, the window's loss and gradients, the
    gradient norm, and the weights after one AdamW step."""
    experiences, advantages = make_experiences(seed=5, count=8)  # a packed row 35 wide: uneven over 2 tp ranks
    experiences = with_turn_temperatures(experiences)  # the LM head scores each token at its own
    experiences[0].token_ids[3] = 5  # the pad id inside a sequence
    plan = ShardingPlan(param_dtype=torch.float32, compute_dtype=compute_dtype, checkpoint_every=1)
    results = {}
    for name, (replicate, tp) in LAYOUTS.items():
        mesh = build_trainer_mesh(num_trainer_ranks=NUM_TRAINERS, device_type="cpu",
                                  data_parallel_replicate=replicate, tensor_parallel_size=tp)
        if mesh is None:
            results[name] = None
            continue
        model = build_actor_model(model_path, mesh=mesh, device=CPU, plan=plan)
        # A large AdamW eps makes the first step a smooth function of the gradient, not its sign,
        # so rounding noise in near-zero gradients stays noise in the weights.
        actor = Actor(model, group=mesh.dp_group, device=CPU, temperature=TEMPERATURE, max_grad_norm=0.1,
                      optimizer=OptimizerSettings(lr=1e-3, eps=1e-2))
        loaded = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        window = actor.train_window(rank_micro_batches(mesh, experiences, advantages), LOSS)
        results[name] = {
            "loaded": loaded, "loss": window.totals["loss"], "grad_norm": window.grad_norm,
            "stepped": window.stepped, "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "meshes": {p.device_mesh.mesh_dim_names for p in model.parameters()},
            "stepped_weights": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
        }
    return results


def gradients_rank(rank, world_size, model_path, layouts):
    """Per layout, the weights as loaded and the window's gradients (no step), fp32; and what the
    first tensor-parallel forward showed of its layout."""
    experiences, advantages = make_experiences(seed=5, count=8)
    experiences = with_turn_temperatures(experiences)
    results = {"loaded": {}, "grads": {}, "layouts": {}}
    for name, (replicate, tp) in layouts.items():
        mesh = build_trainer_mesh(num_trainer_ranks=world_size, device_type="cpu",
                                  data_parallel_replicate=replicate, tensor_parallel_size=tp)
        model = build_actor_model(model_path, mesh=mesh, device=CPU, plan=ShardingPlan())
        results["loaded"][name] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        actor = Actor(model, group=mesh.dp_group, device=CPU, temperature=TEMPERATURE,
                      optimizer=OptimizerSettings(lr=1e-3))
        if tp > 1 and not results["layouts"]:
            results["layouts"] = record_layouts(model)
        actor.compute_window_gradients(rank_micro_batches(mesh, experiences, advantages), LOSS)
        results["grads"][name] = full_gradients(model)
    return results


def record_layouts(model) -> dict:
    """What the first forward shows of the layout: the residual stream between blocks, the heads
    attention computes on, the hidden states the LM head reads; and every forward's row width."""
    seen = {"widths": []}
    model.register_forward_pre_hook(lambda module, args, kwargs: seen["widths"].append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)

    def record(key, describe):
        def hook(module, args, output) -> None:
            seen.setdefault(key, describe(output))
        return hook

    model.model.layers[0].register_forward_hook(record("block output", lambda out: (
        type(out).__name__, getattr(out, "placements", None), tuple(out.shape), tuple(out.to_local().shape))))
    model.model.layers[0].self_attn.q_proj.register_forward_hook(record("queries", lambda out: tuple(out.shape)))
    model.model.norm.register_forward_hook(record("final norm", lambda out: (type(out).__name__, tuple(out.shape))))
    return seen


def mesh_rank(rank, world_size):
    """(dp_rank, dp_size, tp_rank, tp_size, dp group's ranks, FSDP2 mesh dims) per layout."""
    results = {}
    for name, (replicate, tp) in LAYOUTS.items():
        mesh = build_trainer_mesh(num_trainer_ranks=NUM_TRAINERS, device_type="cpu",
                                  data_parallel_replicate=replicate, tensor_parallel_size=tp)
        results[name] = None if mesh is None else (
            mesh.dp_rank, mesh.dp_size, mesh.tp_rank, mesh.tp_size, dist.get_process_group_ranks(mesh.dp_group),
            mesh.fsdp_mesh.mesh_dim_names)
    return results


def test_trainer_mesh_ranks_and_groups():
    results = run_ranks(mesh_rank, 3)
    assert results[2] == {name: None for name in LAYOUTS}, "rank 2 is not a trainer"
    # tp=2: both ranks are data-parallel index 0, each its own dp group; hsdp: indices 0 and 1.
    assert results[0]["tp"] == (0, 1, 0, 2, [0], ("dp_shard",)) and results[1]["tp"] == (0, 1, 1, 2, [1], ("dp_shard",))
    assert results[1]["hsdp"] == (1, 2, 0, 1, [0, 1], ("dp_replicate", "dp_shard"))
    assert results[1]["fsdp"] == (1, 2, 0, 1, [0, 1], ("dp_shard",))


def plain_mesh_rank(rank, world_size, model_path):
    """FSDP2 units, placements and window gradients on build_trainer_mesh's 1 x 2 x 1 mesh and on a
    1-D mesh straight over the trainer group (what the trainer built before the 3-D mesh)."""
    trainer_group = dist.new_group(list(range(NUM_TRAINERS)))
    built = build_trainer_mesh(num_trainer_ranks=NUM_TRAINERS, device_type="cpu")
    if built is None:
        return None
    experiences, advantages = make_experiences(seed=6, count=6)
    results = {}
    for name, mesh in (("built", built), ("from group", TrainerMesh.from_group(trainer_group, "cpu"))):
        model = build_actor_model(model_path, mesh=mesh, device=CPU, plan=ShardingPlan(checkpoint_every=1))
        actor = Actor(model, group=mesh.dp_group, device=CPU, temperature=TEMPERATURE,
                      optimizer=OptimizerSettings(lr=1e-3))
        sums = actor.compute_window_gradients(rank_micro_batches(mesh, experiences, advantages), LOSS)
        results[name] = {
            "units": [n for n, m in model.named_modules() if isinstance(m, FSDPModule)],
            "placements": {n: (p.placements, p.device_mesh.size()) for n, p in model.named_parameters()},
            "loss": sums["loss"], "grads": full_gradients(model)}
    return results


def test_plain_trainer_mesh_is_plain_fsdp(qwen3_path):
    """tp 1 and one replica: the same FSDP2 units and placements as a 1-D mesh over the trainer
    group, and bit-identical gradients (rank 2 plays a rollout rank)."""
    results = run_ranks(plain_mesh_rank, 3, qwen3_path)
    assert results[2] is None
    for result in results[:2]:
        built, plain = result["built"], result["from group"]
        assert built["units"] == plain["units"] and len(built["units"]) == 3  # two blocks and the root
        assert built["placements"] == plain["placements"]
        assert built["loss"] == plain["loss"]
        for key, grad in built["grads"].items():
            assert torch.equal(grad, plain["grads"][key]), key


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-compute"])
def test_tensor_parallel_and_hsdp_train_like_fsdp(qwen3_path, compute_dtype):
    """One clipped AdamW step on the same window (a padded and a packed micro-batch, entropy bonus,
    activation checkpointing): TP=2 with sequence-parallel norms and HSDP 2x1 match plain FSDP2
    over the same two ranks (rank 2 plays a rollout rank)."""
    results = run_ranks(layouts_rank, 3, qwen3_path, compute_dtype)
    assert results[2] == {name: None for name in LAYOUTS}
    checkpoint = load_file(f"{qwen3_path}/model.safetensors")
    bf16 = compute_dtype is not None
    for rank in (0, 1):
        baseline = results[rank]["fsdp"]
        for name, result in results[rank].items():
            assert result["tied"], name
            assert len(result["meshes"]) == 1, f"{name}: parameters on several meshes {result['meshes']}"
            for key, tensor in checkpoint.items():
                torch.testing.assert_close(result["loaded"][key], tensor, rtol=0, atol=0, msg=f"{name}: {key}")
            assert result["stepped"]
            assert result["loss"] == pytest.approx(baseline["loss"], rel=1e-2 if bf16 else 1e-5), name
            assert result["grad_norm"] == pytest.approx(baseline["grad_norm"], rel=1e-2 if bf16 else 1e-5), name
            assert result["grad_norm"] > 0.1, "clipping must be active"
            for key, weight in result["stepped_weights"].items():
                torch.testing.assert_close(weight, baseline["stepped_weights"][key], rtol=0,
                                           atol=3e-5 if bf16 else 2e-7, msg=f"{name}: {key}")
    assert results[0]["tp"]["loss"] == results[1]["tp"]["loss"], "both tp ranks compute the same loss"


@pytest.mark.parametrize("architecture", ["qwen3", "llama"])
def test_tensor_parallel_gradients_match_fsdp(request, architecture):
    """The window's gradients as full tensors, fp32, on 2 ranks, for a tied Qwen3 (q/k norms) and
    an untied Llama (its own vocab-sharded LM head)."""
    model_path = request.getfixturevalue(f"{architecture}_path")
    results = run_ranks(gradients_rank, 2, model_path, LAYOUTS)
    # The residual stream is sharded on the sequence, attention on the heads.
    layouts = results[0]["layouts"]
    kind, placements, global_shape, local_shape = layouts["block output"]
    assert kind == "DTensor" and placements == (Shard(1),), layouts
    assert global_shape[1] == local_shape[1] + results[1]["layouts"]["block output"][3][1]
    assert layouts["queries"][1:] == (global_shape[1], 64), "one of two heads per rank, the whole sequence"
    assert layouts["final norm"] == ("Tensor", global_shape)
    assert any(width % 2 for width in layouts["widths"]), "a row that splits unevenly over the tp ranks"
    assert_layouts_agree(results, model_path)


def test_fsdp_and_hsdp_with_tensor_parallel_match_fsdp(qwen3_path):
    """4 ranks: FSDP2 over 2 shards x TP 2 (each weight sharded on both, DTensor's _StridedShard
    on the dp dim), HSDP 2 x 1 x TP 2 and HSDP 2 x 2 against FSDP2 over 4 shards."""
    layouts = {"fsdp": (1, 1), "fsdp x tp": (1, 2), "hsdp x tp": (2, 2), "hsdp": (2, 1)}
    assert_layouts_agree(run_ranks(gradients_rank, 4, qwen3_path, layouts), qwen3_path)


def assert_layouts_agree(results, model_path) -> None:
    """Every layout loads the checkpoint exactly and gives FSDP2's gradients."""
    checkpoint = load_file(f"{model_path}/model.safetensors")
    for result in results:
        baseline = result["grads"]["fsdp"]
        assert all(g.abs().max() > 0 for g in baseline.values()), "every parameter must get a gradient"
        for name, grads in result["grads"].items():
            for key, tensor in checkpoint.items():
                torch.testing.assert_close(result["loaded"][name][key], tensor, rtol=0, atol=0, msg=f"{name}: {key}")
            assert grads.keys() == baseline.keys()
            for key, grad in grads.items():
                torch.testing.assert_close(grad, baseline[key], rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")


def critic_rank(rank, world_size, model_path):
    """Values, value-loss gradients and reference log-probs under FSDP2 and TP=2, every rank on the
    whole batch (FSDP2 averages the identical gradients)."""
    experiences, _ = make_experiences(seed=5, count=4)
    experiences = with_turn_temperatures(experiences)
    half = len(experiences) // 2
    micro_batches = [build_micro_batches(experiences[part], max_tokens_per_micro_batch=10_000, pad_token_id=PAD,
                                         layout=layout, temperature=TEMPERATURE)[0]
                     for part, layout in ((slice(0, half), "padded"), (slice(half, None), "rows"))]
    generator = torch.Generator().manual_seed(0)
    head = (0.2 * torch.randn(1, 128, generator=generator), 0.1 * torch.randn(1, generator=generator))
    results = {}
    for name, (replicate, tp) in {"fsdp": (1, 1), "tp": (1, 2)}.items():
        mesh = build_trainer_mesh(num_trainer_ranks=world_size, device_type="cpu", tensor_parallel_size=tp)
        critic = build_value_model(model_path, mesh=mesh, device=CPU, plan=ShardingPlan(checkpoint_every=1))
        with torch.no_grad():  # a non-zero head, so gradients reach the backbone
            for parameter, full in zip((critic.value_head.weight, critic.value_head.bias), head):
                parameter.copy_(distribute_tensor(full, parameter.device_mesh, parameter.placements))
        values = [micro_batch.to_rows(critic(**micro_batch.model_inputs())) for micro_batch in micro_batches]
        sum((v * mb.action_mask).square().sum() for v, mb in zip(values, micro_batches)).backward()
        reference = build_reference_model(model_path, mesh=mesh, device=CPU, plan=ShardingPlan())
        results[name] = {
            "values": [v.detach() for v in values], "grads": full_gradients(critic),
            "meshes": {p.device_mesh.mesh_dim_names for p in critic.parameters()},
            "reference": [compute_reference_logprobs(reference, mb) for mb in micro_batches],
        }
    return results


def test_critic_and_reference_under_tensor_parallel(qwen3_path):
    """The critic's value head (replicated over the tp ranks) and the frozen reference give FSDP2's
    values, gradients and log-probs under TP=2."""
    for result in run_ranks(critic_rank, 2, qwen3_path):
        baseline, tp = result["fsdp"], result["tp"]
        assert tp["meshes"] == {("dp_shard", "tp")}
        assert baseline["grads"]["value_head.weight"].abs().max() > 0
        assert baseline["grads"]["model.layers.0.mlp.up_proj.weight"].abs().max() > 0
        for got, expected in zip(tp["values"] + tp["reference"], baseline["values"] + baseline["reference"]):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        for key, grad in tp["grads"].items():
            expected = baseline["grads"][key]  # a squared loss: gradients up to ~100, so atol scales
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6 * expected.abs().max(), msg=key)


def test_tensor_parallel_refuses_what_it_cannot_split(tmp_path, qwen3_path):
    """Mixture-of-experts models, head counts tp does not divide, rank counts the mesh cannot tile:
    errors that name the field."""
    moe = transformers.Qwen3MoeConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                      head_dim=32, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                      num_experts_per_tok=2, vocab_size=64)
    moe.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"layout.trainer_tensor_parallel_size=2: .* mixture-of-experts"):
        check_tensor_parallel_support(build_empty_model(str(tmp_path), dtype=torch.float32).model, 2)
    with pytest.raises(ValueError, match=r"trainer_tensor_parallel_size=4 does not divide .*'num_key_value_heads': 2"):
        check_tensor_parallel_support(build_empty_model(qwen3_path, dtype=torch.float32).model, 4)
    with pytest.raises(ValueError, match="3 trainer ranks do not split into trainer_data_parallel_replicate=1 x "
                                         "trainer_tensor_parallel_size=2"):
        build_trainer_mesh(num_trainer_ranks=3, device_type="cpu", tensor_parallel_size=2)


def checkpoint_rank(rank, world_size, model_path, root, save_layout, load_layout):
    """Train one window in `save_layout`, checkpoint (weights and AdamW state), then load into a
    fresh model of `load_layout` and train the same next window in both: weights must agree."""
    from molt.trainer.checkpoint import load_checkpoint, save_checkpoint, step_dir

    trainer_group = dist.new_group(list(range(NUM_TRAINERS)))
    experiences, advantages = make_experiences(seed=7, count=8)
    actors = {}
    for role, name in (("saved", save_layout), ("loaded", load_layout)):
        replicate, tp = LAYOUTS[name]
        mesh = build_trainer_mesh(num_trainer_ranks=NUM_TRAINERS, device_type="cpu",
                                  data_parallel_replicate=replicate, tensor_parallel_size=tp)
        if mesh is None:
            return None
        model = build_actor_model(model_path, mesh=mesh, device=CPU, plan=ShardingPlan())
        # A large AdamW eps keeps the step after loading a smooth function of the gradient (as in
        # layouts_rank), so the layouts' rounding differences stay small in the weights.
        actors[role] = (mesh, Actor(model, group=mesh.dp_group, device=CPU, temperature=TEMPERATURE,
                                    optimizer=OptimizerSettings(lr=1e-2, eps=1e-2)))
    mesh, saved = actors["saved"]
    saved.train_window(rank_micro_batches(mesh, experiences, advantages), LOSS)
    save_checkpoint(root, 1, trainables={"actor": saved}, group=trainer_group, rank=rank, state={"step": 1},
                    keep_last=1)
    _, loaded = actors["loaded"]
    before = {n: p.full_tensor().detach().clone() for n, p in loaded.model.named_parameters()}
    load_checkpoint(step_dir(root, 1), trainables={"actor": loaded}, group=trainer_group, rank=rank)
    results = {"fresh": before,
               "loaded_weights": {n: p.full_tensor().detach().clone() for n, p in loaded.model.named_parameters()},
               "saved_weights": {n: p.full_tensor().detach().clone() for n, p in saved.model.named_parameters()}}
    for role, (mesh, actor) in actors.items():
        actor.train_window(rank_micro_batches(mesh, experiences[::-1], advantages[::-1]), LOSS)
        results[role] = {n: p.full_tensor().detach().clone() for n, p in actor.model.named_parameters()}
    return results


@pytest.mark.parametrize("save_layout, load_layout", [("tp", "tp"), ("hsdp", "hsdp"), ("tp", "fsdp")])
def test_a_checkpoint_resumes_weights_and_optimizer_state_across_layouts(tmp_path, qwen3_path, save_layout,
                                                                         load_layout):
    """A checkpoint written under tensor parallelism or HSDP resumes in the same layout, and in plain
    FSDP2 (torch.distributed.checkpoint reshards): the next AdamW step after loading lands on the same
    weights as the next step of the model that wrote it."""
    results = run_ranks(checkpoint_rank, 3, qwen3_path, str(tmp_path / "ckpt"), save_layout, load_layout)
    assert results[2] is None
    result = results[0]
    for name, tensor in result["saved_weights"].items():  # loading restores the bytes, whatever the layout
        assert torch.equal(result["loaded_weights"][name], tensor), name
    continued, resumed, fresh = result["saved"], result["loaded"], result["fresh"]
    for name, tensor in continued.items():  # and the AdamW moments: the next step agrees
        assert torch.allclose(resumed[name], tensor, rtol=1e-4, atol=1e-6), name
    # The loaded model really changed: a fresh model's next step lands elsewhere.
    assert any(not torch.allclose(fresh[name], tensor) for name, tensor in continued.items())
