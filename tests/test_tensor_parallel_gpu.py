"""On one GPU: bf16 compute over float32 master weights, every block checkpointed, and the
tensor-parallel plan (over a tensor-parallel mesh of one GPU, where its collectives are no-ops but
every projection, norm and the head still run as DTensors) give plain FSDP2's loss, gradient norm
and gradients. A single GPU cannot run TP=2 (NCCL needs a GPU per rank); tests/test_tensor_parallel.py
checks TP=2 and HSDP on CPU. Not yet run: no GPU was available when it was written."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
from test_actor import TEMPERATURE, full_gradients, make_experiences
from test_tensor_parallel import LOSS, save_model
from torch.distributed.device_mesh import DeviceMesh

from molt.distributed.parallelize import ShardingPlan, TrainerMesh, apply_tensor_parallel
from molt.models.hf_checkpoint import build_empty_model
from molt.trainer.actor import Actor
from molt.trainer.scoring import install_scoring_head
from molt.trainer.sharded_model import build_actor_model, shard_and_load
from molt.trainer.batch import build_micro_batches
from molt.trainer.optimizer import OptimizerSettings

PAD = 5


def one_rank_world(device_type: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=0, world_size=1)


def window_on(model_path: str, device: torch.device, *, tensor_parallel_plan: bool) -> dict:
    """One optimizer window's loss, gradient norm and gradients under bf16 compute and full
    activation checkpointing; the tensor-parallel plan applied over a one-rank tp mesh or not."""
    plan = ShardingPlan(param_dtype=torch.float32, compute_dtype=torch.bfloat16, checkpoint_every=1)
    if tensor_parallel_plan:
        mesh2d = DeviceMesh(device.type, torch.zeros(1, 1, dtype=torch.int), mesh_dim_names=("dp_shard", "tp"))
        mesh = TrainerMesh(mesh=mesh2d, fsdp_mesh=mesh2d["dp_shard"], tp_mesh=mesh2d["tp"], dp_group=dist.group.WORLD,
                           dp_rank=0, dp_size=1, tp_rank=0, tp_size=1)
        model = build_empty_model(model_path, dtype=plan.param_dtype)
        install_scoring_head(model, chunk_tokens=64)
        apply_tensor_parallel(model, model.model, mesh.tp_mesh)  # shard_model skips it when tp_size == 1
        shard_and_load(model, model.model, model_path, mesh=mesh, device=device, plan=plan)
    else:
        mesh = TrainerMesh.from_group(dist.group.WORLD, device.type)
        model = build_actor_model(model_path, mesh=mesh, device=device, plan=plan, logprob_chunk_tokens=64)
    actor = Actor(model, group=mesh.dp_group, device=device, temperature=TEMPERATURE, max_grad_norm=0.0,
                  optimizer=OptimizerSettings(lr=1e-3))
    experiences, advantages = make_experiences(seed=5, count=8)
    micro_batches = build_micro_batches(experiences, advantages, max_tokens_per_micro_batch=10_000, pad_token_id=PAD)
    sums = actor.compute_window_gradients(micro_batches, LOSS)
    grads = full_gradients(model)
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())).item()
    return {"loss": sums["loss"].item(), "grad_norm": norm, "grads": {k: v.cpu() for k, v in grads.items()}}


def compare_plain_and_tensor_parallel_plan(model_path: str, device: torch.device) -> None:
    plain = window_on(model_path, device, tensor_parallel_plan=False)
    planned = window_on(model_path, device, tensor_parallel_plan=True)
    assert planned["loss"] == pytest.approx(plain["loss"], rel=2e-2)
    assert planned["grad_norm"] == pytest.approx(plain["grad_norm"], rel=2e-2)
    assert planned["grads"].keys() == plain["grads"].keys()
    for name, grad in plain["grads"].items():
        scale = grad.abs().max().item() + 1e-6
        assert (planned["grads"][name] - grad).abs().max().item() <= 5e-2 * scale, name


@pytest.mark.gpu
def test_bf16_checkpointed_tensor_parallel_plan_matches_fsdp2_on_one_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.cuda.set_device(0)
    one_rank_world("cuda")
    try:
        compare_plain_and_tensor_parallel_plan(save_model(tmp_path / "qwen3", "qwen3", tied=True), torch.device("cuda", 0))
    finally:
        dist.destroy_process_group()
