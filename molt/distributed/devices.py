"""Per-process settings that a GPU run needs and a CPU run never shows: how vLLM starts its engine
processes, and how many OpenMP threads each local process gets. Each is a pure function whose CUDA
answer a CPU test pins (tests/test_gpu_decisions.py), next to the library line that requires it.
torch is imported only where a function needs it: launch/run.sh calls `omp_num_threads` before
anything heavy starts.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

from molt.config import ConfigError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("molt")

VLLM_START_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


def trainer_device_type(device: str) -> str:
    """'cuda' or 'cpu': where trainer ranks compute for the `device` setting (cfg.device; auto: CUDA
    when torch sees a GPU)."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def vllm_worker_start_method(device: str) -> str:
    """How vLLM starts its engine core and workers in a Molt process: "spawn", on every device
    (`device`: cfg.device, "auto", "cuda" or "cpu").

    CUDA: vllm/envs.py gives VLLM_WORKER_MULTIPROC_METHOD the default "fork", and only the CPU
    platform forces "spawn" (vllm/platforms/cpu.py, CpuPlatform.check_and_update_config:
    `os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"`). A forked engine core inherits a rollout
    rank's initialized torch.distributed world; vllm/distributed/parallel_state.py,
    init_distributed_environment, only calls init_process_group `if not
    torch.distributed.is_initialized()`, so the child would build vLLM's world group over the whole
    torchrun world and wait in a store barrier no other rank enters. CPU: what vLLM does anyway,
    so the GPU path is the path CI runs."""
    return "spawn"


def apply_vllm_worker_start_method(environ: MutableMapping[str, str], device: str) -> None:
    """Set `vllm_worker_start_method` in `environ` before vLLM is imported (its workers inherit it).
    A different value the user set is overridden with a warning: fork is never safe in a process
    that holds the torchrun world, and an error would only stop a run that works with spawn."""
    method = vllm_worker_start_method(device)
    requested = environ.get(VLLM_START_METHOD)
    if requested not in (None, method):
        logger.warning("%s=%s overridden to %r: a forked vLLM engine core would inherit this process's "
                       "torch.distributed world and hang in vLLM's start-up barrier", VLLM_START_METHOD,
                       requested, method)
    environ[VLLM_START_METHOD] = method


def omp_num_threads(device_type: str, num_cpus: int, num_local_processes: int) -> int:
    """OMP_NUM_THREADS for each of `num_local_processes` Molt processes on a node of `num_cpus` cores
    (`device_type`: where the trainer computes, "cuda" or "cpu").

    CPU: 1. The engines and the trainer ranks compute on the same cores; oversubscribed OpenMP
    pools run several times slower on a small box. CUDA: the cores shared out, at least 1: the
    host-side work there (AdamW over offloaded shards under train.cpu_offload, tokenization, image
    decoding) is CPU-bound. Leaving the variable unset is not enough, since
    torch/distributed/run.py, config_from_args, sets OMP_NUM_THREADS=1 when it is unset and
    nproc_per_node > 1."""
    if num_cpus < 1 or num_local_processes < 1:
        raise ValueError(f"need at least one core and one process, got num_cpus={num_cpus}, "
                         f"num_local_processes={num_local_processes}")
    if device_type != "cuda":
        return 1
    return max(1, num_cpus // num_local_processes)


def release_cache_before_wake(device_type: str, sleep_while_training: bool) -> bool:
    """Whether a trainer rank hands its caching allocator's free blocks back to the driver after each
    step: on CUDA, when the engine sharing its GPU slept through the step (rollout.sleep_while_training).
    The engine's wake_up maps its weights and KV cache back into memory that must be free on the GPU
    (vllm/device_allocator/cumem.py, CuMemAllocator.wake_up: cuMemCreate for every sleeping
    allocation), and PyTorch keeps the step's freed activations cached for itself otherwise
    (torch/cuda/memory.py, empty_cache: "Release all unoccupied cached memory ... so that those can be
    used in other GPU application"). CPU: no allocator cache to release, no sleep mode."""
    return device_type == "cuda" and sleep_while_training


NO_CUDA = "device='cuda' but no CUDA device is visible; set --set device=cpu"


def resolve_device(device: str, local_rank: int) -> "torch.device":
    """The trainer rank's device for the `device` setting (cfg.device); on CUDA, made current."""
    import torch

    wanted = device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(NO_CUDA)
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
