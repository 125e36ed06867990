"""Every decision only a GPU run takes, pinned on CPU (issue 27): the options class of the trainer
mesh's groups, vLLM's process start method, OpenMP threads per process, the attention
implementation, and how the chunked head multiplies 16-bit inputs. Each test pins the `cuda`
answer and, where the installed library holds the line that requires it, checks that line is
still there, so a library upgrade that changes it fails here first. The `gpu` tests at the end
run the same paths on a CUDA device."""

import datetime
import importlib.util
import inspect
import logging
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from molt.distributed.devices import VLLM_START_METHOD, apply_vllm_worker_start_method, omp_num_threads, vllm_worker_start_method
from molt.distributed.parallelize import build_trainer_mesh, group_options, group_options_class
from molt.models.hf_checkpoint import build_empty_model
from molt.trainer.sharded_model import attention_implementation, choose_attention
from molt.trainer.logprobs import _chunk_logits, compute_chunked_logprobs, logits_matmul

MINUTE = datetime.timedelta(seconds=60)
NCCL_BUILD = dist.is_nccl_available()


# --- Finding 1: the options of the trainer mesh's NCCL groups ---

def test_cuda_mesh_groups_get_nccl_options_and_torch_still_requires_them() -> None:
    assert group_options_class("cuda") == "ProcessGroupNCCL.Options"
    assert group_options_class("cpu") == "Backend.Options"
    # The line that makes the choice necessary: NCCL groups refuse any other options class.
    source = inspect.getsource(distributed_c10d._new_process_group_helper)
    assert "isinstance(backend_options, ProcessGroupNCCL.Options)" in source


def test_cpu_mesh_groups_get_gloo_options_with_the_timeout() -> None:
    options = group_options("cpu", MINUTE)
    assert type(options) is torch._C._distributed_c10d.Backend.Options
    assert options.backend == "gloo" and options._timeout == MINUTE


@pytest.mark.skipif(NCCL_BUILD, reason="this torch has NCCL: the next test checks the options themselves")
def test_cuda_options_on_a_torch_without_nccl_name_the_build() -> None:
    # A CPU build has no ProcessGroupNCCL (distributed_c10d.py imports it in a try/except
    # ImportError), so the class cannot be checked here; the name above pins it, and the test
    # below (any CUDA build, no GPU needed) checks an instance.
    assert not hasattr(torch._C._distributed_c10d, "ProcessGroupNCCL")
    with pytest.raises(RuntimeError, match="built without it"):
        group_options("cuda", MINUTE)


@pytest.mark.skipif(not NCCL_BUILD, reason="a CPU build of torch has no ProcessGroupNCCL to check against")
def test_cuda_options_are_nccl_options_with_the_timeout() -> None:
    options = group_options("cuda", MINUTE)
    assert isinstance(options, torch._C._distributed_c10d.ProcessGroupNCCL.Options)
    assert options._timeout == MINUTE and not options.is_high_priority_stream


# --- Finding 2: how vLLM starts its engine processes ---

def test_vllm_engines_are_spawned_on_cuda_where_vllm_would_fork() -> None:
    import vllm.envs
    import vllm.platforms.cpu

    assert vllm_worker_start_method("cuda") == vllm_worker_start_method("cpu") == "spawn"
    # vllm/envs.py: unset, the start method is fork; only the CPU platform forces spawn.
    saved = os.environ.pop(VLLM_START_METHOD, None)
    try:
        assert vllm.envs.environment_variables[VLLM_START_METHOD]() == "fork"
    finally:
        if saved is not None:
            os.environ[VLLM_START_METHOD] = saved
    cpu_source = inspect.getsource(vllm.platforms.cpu.CpuPlatform.check_and_update_config)
    assert 'os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"' in cpu_source


def test_a_forked_start_method_is_overridden_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    environ = {VLLM_START_METHOD: "fork"}
    with caplog.at_level(logging.WARNING, logger="molt"):
        apply_vllm_worker_start_method(environ, "cuda")
    assert environ[VLLM_START_METHOD] == "spawn"
    assert "fork" in caplog.text and "torch.distributed" in caplog.text
    caplog.clear()
    unset: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="molt"):
        apply_vllm_worker_start_method(unset, "cuda")
        apply_vllm_worker_start_method(unset, "cuda")
    assert unset == {VLLM_START_METHOD: "spawn"} and not caplog.text


# --- Finding 12: OpenMP threads per process ---

def test_gpu_processes_share_the_cores_and_cpu_processes_get_one_thread() -> None:
    assert omp_num_threads("cuda", num_cpus=96, num_local_processes=8) == 12
    assert omp_num_threads("cuda", num_cpus=4, num_local_processes=8) == 1
    assert omp_num_threads("cpu", num_cpus=96, num_local_processes=2) == 1
    with pytest.raises(ValueError, match="num_local_processes=0"):
        omp_num_threads("cuda", num_cpus=8, num_local_processes=0)
    # Why leaving it unset on GPU is not enough: torchrun then sets 1 for every process.
    import torch.distributed.run as torchrun

    assert 'os.environ["OMP_NUM_THREADS"] = str(omp_num_threads)' in inspect.getsource(torchrun.config_from_args)


# --- Findings 6 and 12: the attention implementation ---

@pytest.mark.parametrize(("device_type", "dtype", "flash", "expected"), [
    ("cuda", torch.bfloat16, True, "flash_attention_2"),
    ("cuda", torch.float16, True, "flash_attention_2"),
    ("cuda", torch.float32, True, None),  # flash-attn refuses fp32 queries
    ("cuda", torch.bfloat16, False, None),
    ("cpu", torch.bfloat16, True, None),
])
def test_flash_attention_only_on_cuda_with_16_bit_compute(device_type: str, dtype: torch.dtype, flash: bool,
                                                         expected: str | None) -> None:
    assert attention_implementation(device_type, dtype, flash) == expected


@pytest.mark.skipif(NCCL_BUILD, reason="assumes the CPU environment, where flash-attn is not installed")
def test_cuda_without_flash_attn_warns_what_sdpa_costs(tiny_model_dir, caplog: pytest.LogCaptureFixture) -> None:
    model = build_empty_model(str(tiny_model_dir), dtype=torch.float32)
    before = model.config._attn_implementation
    with caplog.at_level(logging.WARNING, logger="molt"):
        choose_attention(model, torch.device("cpu"), torch.bfloat16)
    assert not caplog.text  # CPU runs say nothing
    with caplog.at_level(logging.WARNING, logger="molt"):
        choose_attention(model, torch.device("cuda"), torch.bfloat16)  # a device object: no CUDA touched
    assert "flash-attn is not installed" in caplog.text and "[rows, 1, L, L]" in caplog.text
    assert model.config._attn_implementation == before


# --- Finding 11: float32 logits from 16-bit inputs ---

def test_16_bit_logits_use_mm_out_dtype_on_cuda_and_an_upcast_elsewhere() -> None:
    assert logits_matmul("cuda", torch.bfloat16) == logits_matmul("cuda", torch.float16) == "out_dtype"
    assert logits_matmul("cpu", torch.bfloat16) == "upcast"
    assert logits_matmul("cuda", torch.float32) == logits_matmul("cpu", torch.float64) == "native"
    # The CUDA call, checked on meta tensors (aten::mm.dtype has a meta kernel): float32 out.
    hidden = torch.empty(5, 16, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(300, 16, dtype=torch.bfloat16, device="meta")
    logits = _chunk_logits(hidden, weight, "out_dtype")
    assert logits.dtype == torch.float32 and logits.shape == (5, 300)
    # Why CPU upcasts instead: torch.mm's out_dtype is "Supported only on CUDA" (torch/_torch_docs.py).
    with pytest.raises(NotImplementedError, match="mm.dtype"):
        torch.mm(torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.bfloat16),
                 out_dtype=torch.float32)


# --- On a GPU ---

def one_rank_world() -> None:
    """World size 1, initialised as molt.train does on CUDA."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)


@pytest.mark.gpu
def test_trainer_mesh_with_a_timeout_builds_on_nccl_and_reduces() -> None:
    """Finding 1: before the fix, NCCL asserted on the generic options at the mesh's first group."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    one_rank_world()
    try:
        mesh = build_trainer_mesh(num_trainer_ranks=1, device_type="cuda", timeout_seconds=123)
        group = mesh.dp_group
        options = group._get_backend(torch.device("cuda")).options
        assert isinstance(options, torch._C._distributed_c10d.ProcessGroupNCCL.Options)
        assert options._timeout == datetime.timedelta(seconds=123)
        values = torch.arange(4.0, device="cuda")
        dist.all_reduce(values, group=group)
        torch.cuda.synchronize()
        assert values.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_bf16_logprobs_on_cuda_are_float32_products() -> None:
    """Finding 11 on CUDA: torch.mm(..., out_dtype=float32) log-probs against float64, and the
    gradient (recomputed logits in backward) against the float64 path's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(96, 64, generator=generator, dtype=torch.float64).to(torch.bfloat16)
    weight = (torch.randn(4096, 64, generator=generator, dtype=torch.float64) * 1.5).to(torch.bfloat16)
    targets = torch.randint(0, 4096, (96,), generator=generator)
    reference = (hidden.double() @ weight.double().T).log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    cuda_hidden = hidden.cuda().requires_grad_()
    logprobs, _ = compute_chunked_logprobs(cuda_hidden, weight.cuda(), targets.cuda(), temperature=1.0,
                                           chunk_tokens=40, with_entropy=False)
    assert logprobs.dtype == torch.float32
    assert (logprobs.double().cpu() - reference).abs().max().item() < 1e-4
    logprobs.sum().backward()
    hidden64 = hidden.double().requires_grad_()
    (hidden64 @ weight.double().T).log_softmax(-1).gather(-1, targets.unsqueeze(-1)).sum().backward()
    error = ((cuda_hidden.grad.double().cpu() - hidden64.grad).norm() / hidden64.grad.norm()).item()
    assert error < 0.01, f"grad_hidden relative error {error:.2e}"


def test_a_trainer_beside_a_sleeping_engine_releases_its_cache_on_cuda_only() -> None:
    """The engine's wake_up needs its share of the GPU free (vllm/device_allocator/cumem.py,
    CuMemAllocator.wake_up); torch keeps a step's freed activations cached otherwise."""
    from molt.distributed.devices import release_cache_before_wake

    assert release_cache_before_wake("cuda", sleep_while_training=True)
    assert not release_cache_before_wake("cuda", sleep_while_training=False)  # the engine keeps its share awake
    assert not release_cache_before_wake("cpu", sleep_while_training=True)  # refused at start-up anyway
    cumem = Path(importlib.util.find_spec("vllm").origin).parent / "device_allocator" / "cumem.py"
    assert "def wake_up" in cumem.read_text()


def test_the_sbatch_scripts_ask_molt_placement_for_the_threads(capsys) -> None:
    """launch/slurm*.sbatch export what `python -m molt.distributed.placement --omp-threads` says for a recipe's
    fullest node (molt.distributed.devices.omp_num_threads)."""
    from molt.distributed.placement import main

    root = Path(__file__).resolve().parents[1]
    assert main(["--config", str(root / "configs" / "demo.py"), "--omp-threads"]) == 0
    assert capsys.readouterr().out == "1\n"  # a CPU recipe
    cores = len(os.sched_getaffinity(0))
    assert main(["--config", str(root / "configs" / "qwen3_30b_a3b_math_tool.py"), "--omp-threads"]) == 0
    assert capsys.readouterr().out == f"{max(1, cores // 8)}\n"  # device=cuda: 8 ranks a node share the cores
