"""How models are laid out on trainer ranks: fp32 master weights under bf16 compute, activation
checkpointing, the plan the critic and the reference follow, CPU offload refused on CPU runs."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from test_actor import PAD, PPO, TEMPERATURE, make_experiences

from molt.config import ConfigError, MoltConfig, validate_config
from molt.distributed.parallelize import ShardingPlan, TrainerMesh, build_trainer_mesh
from molt.trainer.actor import Actor
from molt.trainer.sharded_model import build_actor_model
from molt.trainer.batch import build_micro_batches
from molt.trainer.critic import build_reference_model, build_value_model
from molt.trainer.optimizer import OptimizerSettings

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def make_actor(model_path, plan: ShardingPlan, lr: float) -> Actor:
    """An actor over all ranks of the world (plain FSDP2)."""
    mesh = TrainerMesh.from_group(dist.group.WORLD, "cpu")
    model = build_actor_model(model_path, mesh=mesh, device=CPU, plan=plan)
    return Actor(model, group=mesh.dp_group, device=CPU, temperature=TEMPERATURE, optimizer=OptimizerSettings(lr=lr))


def full_state(model) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def record_output_dtype(module, key: str) -> dict:
    """{key: dtype of the module's first output}, filled by its first forward."""
    seen = {}

    def hook(module, args, output):
        seen.setdefault(key, (output[0] if isinstance(output, tuple) else output).dtype)

    module.register_forward_hook(hook)
    return seen


def small_update_rank(rank, world_size, model_path, param_dtype, compute_dtype):
    """One AdamW step at lr 1e-6: the share of weights that changed, and what the forward ran in."""
    plan = ShardingPlan(param_dtype=param_dtype, compute_dtype=compute_dtype)
    actor = make_actor(model_path, plan, lr=1e-6)
    seen = record_output_dtype(actor.model.model.layers[0], "block_output")
    experiences, advantages = make_experiences(seed=0, count=6)
    micro_batches = build_micro_batches(experiences, advantages, max_tokens_per_micro_batch=10_000, pad_token_id=PAD)
    before = full_state(actor.model)
    result = actor.train_window(micro_batches, PPO)
    after = full_state(actor.model)
    changed = sum(int((after[n] != before[n]).sum()) for n in before)
    total = sum(t.numel() for t in before.values())
    states = [s["exp_avg"] for s in actor.optimizer.state.values()]
    return {"changed_share": changed / total, "stepped": result.stepped, "block_dtype": seen["block_output"],
            "param_dtype": next(actor.model.parameters()).dtype, "adam_dtype": states[0].dtype}


def test_fp32_master_weights_keep_an_update_that_bf16_master_weights_round_away(model_path):
    """RELIABILITY 31: bf16 compute over fp32 master weights changes nearly every weight at lr 1e-6;
    with bf16 master weights (and bf16 AdamW state) the same update rounds to nothing."""
    mixed = run_ranks(small_update_rank, 1, model_path, torch.float32, torch.bfloat16)[0]
    assert mixed["stepped"]
    assert mixed["block_dtype"] == torch.bfloat16, "the forward must compute in the compute dtype"
    assert mixed["param_dtype"] == torch.float32 and mixed["adam_dtype"] == torch.float32
    assert mixed["changed_share"] > 0.9, mixed
    pure_bf16 = run_ranks(small_update_rank, 1, model_path, torch.bfloat16, None)[0]
    assert pure_bf16["param_dtype"] == torch.bfloat16 and pure_bf16["adam_dtype"] == torch.bfloat16
    assert pure_bf16["changed_share"] < 0.1, pure_bf16


def checkpointing_rank(rank, world_size, model_path, modes):
    """Window gradients and bytes saved for backward under each activation checkpointing mode (fp64)."""
    experiences, advantages = make_experiences(seed=5, count=6)
    results = {}
    for mode, every in modes:
        plan = ShardingPlan(param_dtype=torch.float64, checkpoint_every=every)
        actor = make_actor(model_path, plan, lr=1e-3)
        micro_batches = build_micro_batches(experiences, advantages, max_tokens_per_micro_batch=10_000,
                                            pad_token_id=PAD)
        saved = [0]

        def pack(tensor):
            saved[0] += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            actor.compute_window_gradients(micro_batches, PPO)
        grads = {n: p.grad.full_tensor().clone() for n, p in actor.model.named_parameters()}
        results[mode] = {"grads": grads, "saved_bytes": saved[0],
                         "names": [n for n, _ in actor.model.named_parameters()]}
    return results


def test_activation_checkpointing_keeps_gradients_and_saves_less(model_path):
    results = run_ranks(checkpointing_rank, 1, model_path, [("none", 0), ("full", 1), ("every_n:2", 2)])[0]
    reference = results["none"]
    for mode in ("full", "every_n:2"):
        assert results[mode]["names"] == reference["names"], "checkpointing must not rename parameters"
        for name, grad in results[mode]["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][name], rtol=1e-10, atol=1e-13,
                                       msg=lambda m: f"{mode}: {name}\n{m}")
    # Checkpointed blocks keep only their input for backward: fewer bytes saved, fewest with all of them.
    assert results["full"]["saved_bytes"] < results["every_n:2"]["saved_bytes"] < reference["saved_bytes"]


def follower_rank(rank, world_size, model_path):
    mesh = TrainerMesh.from_group(dist.group.WORLD, "cpu")
    plan = ShardingPlan(param_dtype=torch.float32, compute_dtype=torch.bfloat16, checkpoint_every=1)
    critic = build_value_model(model_path, mesh=mesh, device=CPU, plan=plan)
    reference = build_reference_model(model_path, mesh=mesh, device=CPU, plan=plan)
    seen = record_output_dtype(critic.model.layers[0], "critic")
    experiences, _ = make_experiences(seed=1, count=2)
    micro_batch = build_micro_batches(experiences, max_tokens_per_micro_batch=10_000, pad_token_id=PAD)[0]
    critic(**micro_batch.model_inputs()).sum().backward()
    return {"critic_param": next(critic.parameters()).dtype, "critic_compute": seen["critic"],
            "critic_grad": next(critic.parameters()).grad.dtype,
            "reference_param": next(reference.parameters()).dtype}


def test_critic_and_reference_follow_the_precision_plan(model_path):
    result = run_ranks(follower_rank, 2, model_path)[0]
    assert result["critic_param"] == torch.float32 and result["critic_grad"] == torch.float32
    assert result["critic_compute"] == torch.bfloat16
    # The frozen reference is stored in the compute dtype: the same forward, half the memory.
    assert result["reference_param"] == torch.bfloat16


def test_cpu_offload_is_refused_on_cpu_runs(tmp_path, model_path):
    cfg = MoltConfig(device="cpu")
    cfg.model.path, cfg.data.train_path, cfg.agent.path = "m", "d.jsonl", "a.py"
    cfg.train.cpu_offload = True
    with pytest.raises(ConfigError, match="train.cpu_offload=True on a CPU run: .*GPU memory"):
        validate_config(cfg, require_files=False)
    # device=auto on a machine without CUDA: refused when the job starts, naming the field.
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    command = [sys.executable, "-m", "molt.train", "--config", str(ROOT / "configs" / "demo.py"),
               "--set", "device=auto", "--set", "train.cpu_offload=true", "--set", f"model.path={model_path}",
               "--set", f"data.train_path={tmp_path / 'train.jsonl'}", "--set", "eval.every_steps=0"]
    env = {"PATH": "/usr/bin:/bin", "MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "2",
           "MOLT_CACHE_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    if torch.cuda.is_available():
        pytest.skip("CUDA is visible: device=auto is a GPU run here")
    assert done.returncode == 2 and "train.cpu_offload=True on a CPU run" in done.stderr, done.stderr[-2000:]


@pytest.mark.gpu
def test_cpu_offload_trains_on_a_gpu(model_path):
    """GPU only: FSDP2's CPUOffloadPolicy keeps shards and AdamW state in host memory."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    result = run_ranks(offload_rank, 1, model_path)[0]
    assert result["param_device"] == "cpu" and result["stepped"]


def offload_rank(rank, world_size, model_path):
    dist.destroy_process_group()
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    mesh = TrainerMesh.from_group(dist.group.WORLD, "cuda")
    plan = ShardingPlan(param_dtype=torch.float32, compute_dtype=torch.bfloat16, cpu_offload=True)
    model = build_actor_model(model_path, mesh=mesh, device=device, plan=plan)
    actor = Actor(model, group=dist.group.WORLD, device=device, optimizer=OptimizerSettings(lr=1e-4))
    experiences, advantages = make_experiences(seed=0, count=4)
    micro_batches = build_micro_batches(experiences, advantages, max_tokens_per_micro_batch=10_000, pad_token_id=PAD)
    result = actor.train_window(micro_batches, PPO)
    return {"param_device": next(model.parameters()).to_local().device.type, "stepped": result.stepped}


def mesh_timeouts_rank(rank, world_size, num_trainers):
    """The collective timeout of every group the trainer mesh gives this rank (None: a rollout rank)."""
    mesh = build_trainer_mesh(num_trainer_ranks=num_trainers, device_type="cpu", expert_parallel_size=2,
                              timeout_seconds=77)
    if mesh is None:
        return None
    groups = {"dp_shard": mesh.fsdp_mesh.get_group(), "ep": mesh.ep_group,
              "dp_shard_mod_ep": mesh.expert_fsdp_mesh.get_group()}
    timeouts = {name: group._get_backend(CPU).options._timeout.total_seconds() for name, group in groups.items()}
    # The groups work: a sum over the ep ranks.
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=mesh.ep_group)
    return {"timeouts": timeouts, "ep_sum": value.item()}


def test_trainer_mesh_groups_carry_the_timeout_and_rollout_ranks_take_part():
    """Issue 27, finding 1, the gloo half: every group of the mesh and of the experts' unflattened
    mesh gets the timeout through its options (tests/test_gpu_decisions.py pins the NCCL class, and
    its gpu test builds the mesh on NCCL)."""
    results = run_ranks(mesh_timeouts_rank, 3, 2)
    assert results[2] is None
    for result in results[:2]:
        assert result["timeouts"] == {"dp_shard": 77.0, "ep": 77.0, "dp_shard_mod_ep": 77.0}, result
        assert result["ep_sum"] == 1.0
