"""Placement: ranks on nodes and GPUs, the per-node process counts the launchers need, and the
start-up check that refuses a launch whose processes or GPUs differ from the placement (pure
functions on synthetic launches, and the all-gather on real gloo ranks)."""

from pathlib import Path

import pytest
from distributed import run_ranks

from molt.config import ConfigError, LayoutConfig, MoltConfig
from molt.distributed.placement import (
                                        GpuClaim, PlacementError, check_placement, claim_gpus, describe_launcher, find_placement_problems,
                                        format_tasks_per_node, gather_claims, place_ranks, placement_error, tasks_per_node,
                                        )
from molt.distributed.slurm import expand_tasks_per_node
import molt.dry_run
from molt.train import pin_engine_gpus

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "demo.py")
MOE_1T = LayoutConfig(num_trainer_ranks=128, num_rollout_ranks=8, engine_tensor_parallel_size=8, gpus_per_node=8)
QWEN3 = LayoutConfig(num_trainer_ranks=8, num_rollout_ranks=8, engine_tensor_parallel_size=1, gpus_per_node=8)


def gpu_config(layout: LayoutConfig) -> MoltConfig:
    cfg = MoltConfig(device="cuda")
    cfg.layout = layout
    return cfg


def test_ranks_fill_nodes_in_order():
    # One node shared by 4 trainers and two engines of 2 GPUs, then an engine per half node.
    layout = LayoutConfig(num_trainer_ranks=4, num_rollout_ranks=4, engine_tensor_parallel_size=2, gpus_per_node=8)
    placed = [(p.rank, p.is_trainer, p.node, p.local_rank, p.gpus) for p in place_ranks(layout)]
    assert placed == [
        (0, True, 0, 0, (0,)), (1, True, 0, 1, (1,)), (2, True, 0, 2, (2,)), (3, True, 0, 3, (3,)),
        (4, False, 0, 4, (4, 5)), (5, False, 0, 5, (6, 7)),
        (6, False, 1, 0, (0, 1)), (7, False, 1, 1, (2, 3)),
    ]
    with pytest.raises(ConfigError, match="layout.num_trainer_ranks=3 a multiple of"):
        place_ranks(LayoutConfig(num_trainer_ranks=3, num_rollout_ranks=3, engine_tensor_parallel_size=2,
                                 gpus_per_node=8))
    assert molt.dry_run.place_ranks is place_ranks  # the dry run re-exports it


def test_tasks_per_node_and_the_launcher_a_layout_needs():
    counts = tasks_per_node(gpu_config(MOE_1T))
    assert counts == [8] * 16 + [1] * 8
    assert format_tasks_per_node(counts) == "8(x16),1(x8)"
    assert expand_tasks_per_node(format_tasks_per_node(counts)) == counts  # Slurm's form, both ways
    assert format_tasks_per_node([2, 1, 2]) == "2,1,2"
    assert describe_launcher(counts) == ("sbatch --nodes 24 launch/slurm_srun.sbatch ... (per-node task counts "
                                         "8(x16),1(x8); torchrun cannot start this layout)")
    assert describe_launcher(tasks_per_node(gpu_config(QWEN3))).startswith(
        "torchrun --nnodes 2 --nproc_per_node 8 -m molt.train")
    # On CPU nothing is placed: the ranks split over the allocation's nodes, or one machine.
    cpu = MoltConfig(device="cpu")
    cpu.layout.num_trainer_ranks, cpu.layout.num_rollout_ranks = 1, 3
    assert tasks_per_node(cpu) == [4]
    assert tasks_per_node(cpu, 2) == [2, 2]
    with pytest.raises(ConfigError, match="the recipe has 4 ranks .* which 3 nodes cannot share evenly"):
        tasks_per_node(cpu, 3)


def test_rollout_ranks_pin_their_engines_to_their_own_gpus():
    cfg = gpu_config(QWEN3)
    pinned = {}
    for rank in (8, 9, 15):
        environ = {}
        pin_engine_gpus(cfg, rank, environ)
        pinned[rank] = environ["CUDA_VISIBLE_DEVICES"]
    assert pinned == {8: "0", 9: "1", 15: "7"}  # node 1's GPUs, one engine each
    environ = {"CUDA_VISIBLE_DEVICES": "4,5,6,7,0,1,2,3"}  # the launcher's numbering is kept
    pin_engine_gpus(cfg, 9, environ)
    assert environ["CUDA_VISIBLE_DEVICES"] == "5"
    environ = {"CUDA_VISIBLE_DEVICES": "1"}  # --gpus-per-task: too few to pick from; the check reports it
    pin_engine_gpus(cfg, 9, environ)
    assert environ["CUDA_VISIBLE_DEVICES"] == "1"
    cfg.layout = LayoutConfig(num_trainer_ranks=8, num_rollout_ranks=4, engine_tensor_parallel_size=2)
    environ = {}
    pin_engine_gpus(cfg, 9, environ)
    assert environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    cfg.device, environ = "cpu", {}
    pin_engine_gpus(cfg, 9, environ)
    assert environ == {}


def launch(layout: LayoutConfig, processes_per_host: list[int], *, visible: str = "",
           gpus_per_host: int | None = None) -> list[GpuClaim]:
    """The claims of a launcher that starts processes_per_host[i] consecutive ranks on host node<i>
    with LOCAL_RANK 0.. and LOCAL_WORLD_SIZE as torchrun or srun would, each seeing `visible`
    (CUDA_VISIBLE_DEVICES) or all of its host's GPUs."""
    placements, claims, rank = place_ranks(layout), [], 0
    all_gpus = [str(gpu) for gpu in range(gpus_per_host or layout.gpus_per_node)]
    for host, count in enumerate(processes_per_host):
        node_gpus = visible.split(",") if visible else all_gpus
        for local_rank in range(count):
            claims.append(claim_gpus(placements[rank], host=f"node{host:02d}", local_rank=local_rank,
                                     local_world_size=count, node_gpus=node_gpus, on_gpu=True))
            rank += 1
    return claims


def test_a_launch_that_matches_the_placement_passes():
    assert find_placement_problems(place_ranks(MOE_1T), launch(MOE_1T, [8] * 16 + [1] * 8)) == []
    assert find_placement_problems(place_ranks(QWEN3), launch(QWEN3, [8, 8])) == []
    claims = launch(MOE_1T, [8] * 16 + [1] * 8)
    assert claims[127].gpus == ("7",) and claims[128].gpus == tuple("01234567")


def test_one_big_host_for_two_layout_nodes_names_the_shared_gpus():
    # 16 ranks on one 16-GPU host: layout.gpus_per_node=8 puts the engines on "node 1", GPUs 0-7.
    placements = place_ranks(QWEN3)
    problems = find_placement_problems(placements, launch(QWEN3, [16], gpus_per_host=16))
    assert "rank 1 (trainer) and rank 9 (engine of rollout rank 9) both use GPU 1 of host node00" in problems
    assert "rank 8 expected local rank 0 on node 1 but the launcher gave LOCAL_RANK=8" in problems
    assert "node 0 of the layout runs 8 process(es) but the launcher gave ranks 0-7 LOCAL_WORLD_SIZE=16" in problems
    assert "host node00 runs the ranks of 2 layout nodes: node 0 (ranks 0-7), node 1 (ranks 8-15)" in problems
    message = str(placement_error(placements, problems))
    assert message.startswith("the launched processes do not match the layout's placement")
    assert "launch: torchrun --nnodes 2 --nproc_per_node 8" in message


def test_the_1t_layout_under_torchrun_is_refused_naming_ranks_and_gpus():
    # torchrun --nnodes 17 --nproc_per_node 8: the 8 engines (8 GPUs each) land on one host.
    placements = place_ranks(MOE_1T)
    problems = find_placement_problems(placements, launch(MOE_1T, [8] * 17))
    overlap = next(line for line in problems if "all use" in line)
    assert overlap.startswith("rank 128 (engine of rollout rank 128), rank 129 (engine of rollout rank 129), ")
    assert overlap.endswith("rank 135 (engine of rollout rank 135) all use GPUs 0,1,2,3,4,5,6,7 of host node16")
    assert "rank 129 expected local rank 0 on node 17 but the launcher gave LOCAL_RANK=1" in problems
    assert "... and 1 more like these" in problems  # 7 mismatched ranks, 6 shown
    message = str(placement_error(placements, problems))
    assert ("launch: sbatch --nodes 24 launch/slurm_srun.sbatch ... (per-node task counts 8(x16),1(x8); "
            "torchrun cannot start this layout)") in message


def test_a_trainer_on_the_wrong_local_rank_and_a_wrong_local_world_size():
    claims = launch(QWEN3, [8, 8])
    claims[5] = GpuClaim(rank=5, host="node00", local_rank=1, local_world_size=8, on_gpu=True, gpus=("1",))
    claims[12] = GpuClaim(rank=12, host="node01", local_rank=4, local_world_size=9, on_gpu=True, gpus=("4",))
    problems = find_placement_problems(place_ranks(QWEN3), claims)
    assert problems == [
        "rank 1 (trainer) and rank 5 (trainer) both use GPU 1 of host node00",
        "rank 5 expected local rank 5 on node 0 but the launcher gave LOCAL_RANK=1, so it would train on cuda:1 "
        "instead of GPU 5",
        "node 1 of the layout runs 8 process(es) but the launcher gave rank 12 LOCAL_WORLD_SIZE=9",
    ]


def test_a_layout_node_split_over_two_hosts():
    claims = launch(QWEN3, [8, 4, 4])  # node 1's ranks on two hosts, each with LOCAL_RANK from 0
    problems = find_placement_problems(place_ranks(QWEN3), claims)
    assert "node 1 of the layout runs on 2 hosts: node01 (ranks 8-11), node02 (ranks 12-15)" in problems


def test_tasks_that_see_one_gpu_each_are_refused():
    # srun --gpus-per-task=1: CUDA_VISIBLE_DEVICES holds only the task's own GPU.
    claims = launch(QWEN3, [8, 8], visible="3")
    problems = find_placement_problems(place_ranks(QWEN3), claims)
    assert problems[0].startswith("rank 1 (trainer) needs GPU index 1 of host node00, which shows 1 GPU(s) (3): "
                                  "every process must see all of its node's GPUs (no --gpus-per-task")


def test_uuids_in_cuda_visible_devices_are_the_ids():
    uuids = ",".join(f"GPU-{index}aa" for index in range(8))
    claims = launch(QWEN3, [8, 8], visible=uuids)
    assert claims[9].gpus == ("GPU-1aa",)
    assert find_placement_problems(place_ranks(QWEN3), claims) == []


def test_cpu_runs_place_nothing():
    claims = [GpuClaim(rank=rank, host="laptop", local_rank=0, local_world_size=1, on_gpu=False) for rank in range(4)]
    assert find_placement_problems(None, claims) == []
    assert find_placement_problems(place_ranks(QWEN3), claims) == []


def _gather(rank: int, world_size: int) -> list:
    claim = GpuClaim(rank=rank, host="h" * (rank + 1), local_rank=rank, local_world_size=world_size,
                     on_gpu=rank != 1, gpus=tuple(str(gpu) for gpu in range(rank)), problem="é" * rank)
    return [tuple(vars(claim).values()) for claim in gather_claims(claim, None)]


def test_every_rank_gathers_every_claim():
    results = run_ranks(_gather, 3)
    expected = [(rank, "h" * (rank + 1), rank, 3, rank != 1, tuple(str(g) for g in range(rank)), "é" * rank)
                for rank in range(3)]
    assert results == [expected] * 3


def _check(rank: int, world_size: int, gpus_per_node: int) -> str:
    cfg = MoltConfig(device="cuda")
    cfg.layout = LayoutConfig(num_trainer_ranks=2, num_rollout_ranks=1, gpus_per_node=gpus_per_node)
    # As torchrun --nproc_per_node 3 starts them: one host, LOCAL_RANK = rank.
    environ = {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "3"}
    try:
        check_placement(cfg, rank, environ, node_gpus=[str(gpu) for gpu in range(3)], on_gpu=True, group=None)
    except PlacementError as error:
        return str(error)
    return "ok"


def test_every_rank_refuses_the_same_overlap():
    # gpus_per_node=2: rank 2's engine is placed on "node 1", GPU 0, but runs beside trainer 0.
    messages = run_ranks(_check, 3, 2)
    assert len(set(messages)) == 1
    assert "rank 0 (trainer) and rank 2 (engine of rollout rank 2) both use GPU 0 of host " in messages[0]
    assert "rank 2 expected local rank 0 on node 1 but the launcher gave LOCAL_RANK=2" in messages[0]
    assert run_ranks(_check, 3, 3) == ["ok"] * 3


def test_a_refused_placement_ends_the_job_with_status_2(monkeypatch, caplog, tiny_model_dir, demo_data_dir):
    import molt.train

    def refuse(cfg, rank, world_size, prompt_rows=None):
        raise PlacementError("the launched processes do not match the layout's placement: rank 1 ...")

    monkeypatch.setattr(molt.train, "run", refuse)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    argv = ["--config", DEMO, "--set", f"model.path={tiny_model_dir}",
            "--set", f"data.train_path={demo_data_dir / 'train.jsonl'}", "--set", "eval.every_steps=0"]
    with caplog.at_level("ERROR", logger="molt"):
        assert molt.train.main(argv) == 2
    assert "rank 1 ..." in caplog.text
    monkeypatch.setenv("RANK", "1")  # the other ranks raise the same error and leave the details to rank 0
    caplog.clear()
    with caplog.at_level("ERROR", logger="molt"):
        assert molt.train.main(argv) == 2
    assert "rank 0 logs how" in caplog.text and "rank 1 ..." not in caplog.text
