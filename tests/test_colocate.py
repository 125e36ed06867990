"""The colocated layout, sleep mode and the GPU defaults, as pure decisions pinned for `cuda` on CPU:
placement over shared GPUs, the start-up check that allows exactly that sharing, the GPU count a
node really has (NVML), the refit backend on a shared GPU, the engine's memory, CUDA graphs, the
engine-start limit and when a sleeping engine wakes."""

import pytest

from molt.config import (DEFAULT_GPU_ENGINE_MEMORY_FRACTION, ConfigError, LayoutConfig, MoltConfig,
                         check_device_options, checkpoint_bytes, count_engines_per_node, engine_start_limit_seconds, engine_start_seconds,
                         resolve_enforce_eager, validate_config)
from molt.distributed.placement import (claim_gpus, describe_gpu_shortfall, find_placement_problems, node_gpu_ids,
                                        place_ranks, read_nvml_gpu_count)
from molt.refit.backends import resolve_backend
from molt.rollout.rank import wakes_engine
from molt.train import pin_engine_gpus

GIB = 2**30


def colocated(num_trainers: int, num_engines: int, tensor_parallel: int = 1, gpus_per_node: int = 8) -> LayoutConfig:
    return LayoutConfig(num_trainer_ranks=num_trainers, num_rollout_ranks=num_engines, colocate=True,
                        engine_tensor_parallel_size=tensor_parallel, gpus_per_node=gpus_per_node)


def valid_config(**layout) -> MoltConfig:
    cfg = MoltConfig(device="cuda")
    cfg.model.path, cfg.data.train_path, cfg.agent.path = "m", "d.jsonl", "a.py"
    cfg.layout = LayoutConfig(**layout)
    return cfg


def claims_of(layout: LayoutConfig, node_gpus: list[str]):
    """A correct single-host launch: local rank = rank, every process sees node_gpus."""
    placements = place_ranks(layout)
    return placements, [claim_gpus(p, host="h", local_rank=p.rank, local_world_size=len(placements),
                                   node_gpus=node_gpus, on_gpu=True) for p in placements]


# -- placement -----------------------------------------------------------------------------------

def test_colocated_engines_take_the_trainer_ranks_gpus():
    one = place_ranks(colocated(1, 1, gpus_per_node=1))
    assert [(p.rank, p.is_trainer, p.node, p.local_rank, p.gpus) for p in one] == [
        (0, True, 0, 0, (0,)), (1, False, 0, 1, (0,))]
    eight = place_ranks(colocated(8, 8))
    assert [p.gpus for p in eight[8:]] == [(gpu,) for gpu in range(8)]
    assert [p.local_rank for p in eight] == list(range(16)) and {p.node for p in eight} == {0}
    tp2 = place_ranks(colocated(8, 4, tensor_parallel=2))
    assert [p.gpus for p in tp2[8:]] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # Not colocated, the same 8 + 8 takes a second node.
    assert place_ranks(LayoutConfig(num_trainer_ranks=8, num_rollout_ranks=8))[8].node == 1


def test_the_start_up_check_allows_the_colocated_sharing_and_nothing_more():
    placements, claims = claims_of(colocated(8, 4, tensor_parallel=2), [str(gpu) for gpu in range(8)])
    assert find_placement_problems(placements, claims) == []
    # A second trainer on GPU 0 is an overlap even when colocated.
    claims[1] = claim_gpus(placements[1], host="h", local_rank=0, local_world_size=12,
                           node_gpus=[str(gpu) for gpu in range(8)], on_gpu=True)
    problems = find_placement_problems(placements, claims)
    assert any("rank 0 (trainer), rank 1 (trainer) and rank 8 (engine of rollout rank 8) all use GPU 0" in line
               for line in problems), problems
    # Disaggregated, a trainer and an engine on one GPU is still refused.
    layout = LayoutConfig(num_trainer_ranks=1, num_rollout_ranks=1, gpus_per_node=2)
    placements, claims = claims_of(layout, ["0"])
    assert any("needs 2 GPUs on node 0" in line for line in find_placement_problems(
        placements, [claim_gpus(p, host="h", local_rank=p.rank, local_world_size=2, node_gpus=["0"], on_gpu=True,
                                shortfall=describe_gpu_shortfall(placements, 0, host="h", node_gpus=["0"]))
                     for p in placements]))


def test_the_node_gpu_count_comes_from_nvml_when_the_launcher_sets_none():
    # One GPU, CUDA_VISIBLE_DEVICES unset: the old check assumed layout.gpus_per_node=8 GPUs.
    assert node_gpu_ids({}, 8, nvml_count=1) == ["0"]
    assert node_gpu_ids({"CUDA_VISIBLE_DEVICES": "3,5"}, 8, nvml_count=8) == ["3", "5"]  # the launcher's list wins
    assert node_gpu_ids({}, 8, nvml_count=None) == [str(gpu) for gpu in range(8)]  # no driver: the layout's
    assert read_nvml_gpu_count() in (None, *range(1, 65))  # None on a machine without the NVIDIA driver


def test_a_layout_needing_more_gpus_than_the_node_has_names_both_numbers():
    placements = place_ranks(LayoutConfig(num_trainer_ranks=8, num_rollout_ranks=8, gpus_per_node=8))
    line = describe_gpu_shortfall(placements, 1, host="box", node_gpus=["0"])
    assert "the layout needs 8 GPUs on node 1" in line and "host box has 1 (0)" in line
    assert describe_gpu_shortfall(place_ranks(colocated(1, 1, gpus_per_node=1)), 0, host="box", node_gpus=["0"]) == ""


def test_a_colocated_engine_is_pinned_to_its_trainers_gpu():
    cfg = MoltConfig(device="cuda")
    cfg.layout = colocated(8, 8)
    environ = {}
    pin_engine_gpus(cfg, 11, environ, node_gpus=[str(gpu) for gpu in range(8)])
    assert environ["CUDA_VISIBLE_DEVICES"] == "3"  # rollout rank 11 = engine 3, on trainer rank 3's GPU


# -- validation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    (lambda c: setattr(c.layout, "num_rollout_ranks", 2),
     "layout.num_rollout_ranks=2 x layout.engine_tensor_parallel_size=1 = 2 must equal layout.num_trainer_ranks=1"),
    (lambda c: setattr(c.refit, "backend", "nccl"), "refit.backend='nccl' with layout.colocate=True"),
    (lambda c: (setattr(c.layout, "num_trainer_ranks", 16), setattr(c.layout, "num_rollout_ranks", 16)),
     "layout.num_trainer_ranks=16 is more than layout.gpus_per_node=8"),
    (lambda c: setattr(c.rollout, "engine_memory_fraction", 0.0),
     "layout.colocate=True on GPUs sizes each engine by rollout.engine_memory_fraction (now 0)"),
    (lambda c: (setattr(c.rollout, "engine_memory_fraction", 0.0), setattr(c.rollout, "kv_cache_gigabytes", 4.0)),
     "leave rollout.kv_cache_gigabytes at 0 (now 4)"),
    (lambda c: setattr(c.algorithm, "max_staleness", 1), "set algorithm.max_staleness=0"),
    (lambda c: (setattr(c.layout, "colocate", False)), "set layout.colocate=True or sleep_while_training=False"),
])
def test_colocate_and_sleep_refuse_what_cannot_run_naming_the_field(change, message):
    cfg = valid_config(num_trainer_ranks=1, num_rollout_ranks=1, colocate=True)
    cfg.rollout.engine_memory_fraction, cfg.rollout.sleep_while_training = 0.4, True
    cfg.algorithm.importance_level = "token"
    validate_config(cfg, require_files=False)
    change(cfg)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        validate_config(cfg, require_files=False)


def test_sleep_mode_is_refused_on_cpu():
    cfg = valid_config(num_trainer_ranks=1, num_rollout_ranks=1, colocate=True)
    cfg.rollout.sleep_while_training = True
    with pytest.raises(ConfigError, match="rollout.sleep_while_training=True on a CPU run: vLLM's sleep mode is CUDA"):
        check_device_options(cfg, "cpu")  # device=auto resolved to cpu at start-up
    cfg.device = "cpu"
    with pytest.raises(ConfigError, match="sleep mode is CUDA-only"):
        validate_config(cfg, require_files=False)


# -- the GPU decisions ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend, device_type, colocate, expected", [
    ("auto", "cuda", False, "nccl"), ("auto", "cuda", True, "gloo"), ("auto", "cpu", True, "gloo"),
    ("gloo", "cuda", True, "gloo")])
def test_a_shared_gpu_refits_over_gloo(backend, device_type, colocate, expected):
    assert resolve_backend(backend, device_type, colocate=colocate) == expected


def test_nccl_on_a_shared_gpu_is_refused_naming_the_fields():
    with pytest.raises(ConfigError, match="refit.backend='nccl' with layout.colocate=True.*duplicate GPU"):
        resolve_backend("nccl", "cuda", colocate=True)


def test_engine_memory_defaults():
    rollout = MoltConfig().rollout
    assert rollout.engine_memory(on_gpu=False) == {"kv_cache_memory_bytes": GIB}  # CPU: bytes, NUMA nodes vary
    assert rollout.engine_memory(on_gpu=True) == {"gpu_memory_utilization": DEFAULT_GPU_ENGINE_MEMORY_FRACTION}
    with pytest.raises(ConfigError, match="needs rollout.engine_memory_fraction"):
        rollout.engine_memory(on_gpu=True, colocate=True)
    rollout.engine_memory_fraction = 0.4
    assert rollout.engine_memory(on_gpu=True, colocate=True) == {"gpu_memory_utilization": 0.4}
    assert rollout.engine_memory(on_gpu=False, colocate=True) == {"gpu_memory_utilization": 0.4}
    rollout.engine_memory_fraction, rollout.kv_cache_gigabytes = 0.0, 8.0
    assert rollout.engine_memory(on_gpu=True) == {"kv_cache_memory_bytes": 8 * GIB}


def test_cuda_graphs_are_on_on_gpus_unless_turned_off():
    assert resolve_enforce_eager(None, on_gpu=True) is False
    assert resolve_enforce_eager(None, on_gpu=False) is True
    assert resolve_enforce_eager(True, on_gpu=True) is True
    assert resolve_enforce_eager(False, on_gpu=False) is False


def test_the_engine_start_limit_scales_with_the_checkpoint(tmp_path):
    assert engine_start_seconds(0) == 300
    # Qwen3-30B-A3B's 57 GiB read by the 8 engines of one node: ~870 s, where 300 s was fixed before.
    assert engine_start_seconds(57 * GIB, 8) == 300 + 1.25 * 8 * 57
    assert count_engines_per_node(LayoutConfig(num_trainer_ranks=8, num_rollout_ranks=8)) == 8
    assert count_engines_per_node(LayoutConfig(num_trainer_ranks=128, num_rollout_ranks=8,
                                               engine_tensor_parallel_size=8)) == 1
    assert count_engines_per_node(colocated(8, 4, tensor_parallel=2)) == 4
    (tmp_path / "model-00001.safetensors").write_bytes(b"\0" * 3000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_bytes(str(tmp_path)) == 4000
    cfg = MoltConfig()
    cfg.model.path = str(tmp_path)
    assert engine_start_limit_seconds(cfg) == engine_start_seconds(4000)
    cfg.model.path = str(tmp_path / "absent")
    assert engine_start_limit_seconds(cfg, 8 * GIB) == 310  # --dry-run's estimate where the files are absent
    cfg.rollout.engine_start_timeout_seconds = 45.0  # set: taken as it is
    assert engine_start_limit_seconds(cfg, 8 * GIB) == 45.0


def test_a_sleeping_engine_wakes_for_what_uses_it():
    assert [kind for kind in ("refit", "rollout", "score", "join_refit", "leave_refit", "sleep")
            if wakes_engine(kind)] == ["refit", "rollout", "score"]


def test_the_cpu_engine_args_keep_eager_bytes_and_no_sleep(tiny_model_dir):
    from molt.rollout.engine import build_engine_args

    cfg = MoltConfig(device="cpu")
    cfg.model.path = str(tiny_model_dir)
    cfg.layout.colocate = True
    args = build_engine_args(cfg, seed=0, backend="gloo")
    assert args.enforce_eager is True and args.kv_cache_memory_bytes == GIB and args.enable_sleep_mode is False
