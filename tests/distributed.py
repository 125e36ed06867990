"""Run a function on N gloo ranks in fresh processes; the one helper distributed tests use."""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOADED_MODULES = ("torch", "torch.distributed.fsdp", "transformers", "molt.trainer.policy")


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_seconds: float = 120
) -> list[Any]:
    """Call `fn(rank, world_size, *args)` on each of `world_size` gloo ranks; return results by rank.

    `fn` must be importable (module level) and its result `torch.save`-able. The default process
    group is initialised before `fn` runs and destroyed after. A rank that raises fails the test
    with that rank's traceback; a job still running after `timeout_seconds` is killed and fails.
    """
    context = mp.get_context("forkserver")
    # The fork server imports these once; each rank then forks from it instead of paying the
    # several-second torch + transformers import again (ranks stay fresh, unlike plain fork).
    context.set_forkserver_preload(list(PRELOADED_MODULES))
    port = _free_port()
    with tempfile.TemporaryDirectory() as directory:
        processes = [
            context.Process(
                target=_run_rank, args=(fn, rank, world_size, port, directory, args), daemon=True
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout_seconds
        try:
            _wait(processes, Path(directory), deadline)
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                process.join(timeout=5)
        return [torch.load(Path(directory) / f"result{rank}.pt", weights_only=False)
                for rank in range(world_size)]


def _wait(processes: list, directory: Path, deadline: float) -> None:
    while any(process.is_alive() for process in processes):
        _raise_rank_errors(directory)
        if time.monotonic() > deadline:
            raise TimeoutError("distributed test still running after its timeout; ranks killed")
        time.sleep(0.05)
    _raise_rank_errors(directory)
    for rank, process in enumerate(processes):
        if process.exitcode != 0:
            raise RuntimeError(f"rank {rank} exited with code {process.exitcode} and no traceback")


def _raise_rank_errors(directory: Path) -> None:
    errors = sorted(directory.glob("error*.txt"))
    if errors:
        # A rank's error usually leaves the others blocked in a collective; report the first.
        raise RuntimeError(f"{errors[0].stem} failed:\n{errors[0].read_text()}")


def _run_rank(fn, rank: int, world_size: int, port: int, directory: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save(result, Path(directory) / f"result{rank}.pt.tmp")
        os.replace(Path(directory) / f"result{rank}.pt.tmp", Path(directory) / f"result{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        error_path = Path(directory) / f"error{rank}.txt"
        error_path.with_suffix(".tmp").write_text(traceback.format_exc())
        os.replace(error_path.with_suffix(".tmp"), error_path)
        raise


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
