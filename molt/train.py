"""The one way in: `torchrun --nproc_per_node=N -m molt.train --config configs/<recipe>.py [--set a.b=v]`.

Ranks 0..T-1 train (rank 0 also runs the rollout controller); ranks T.. each host one engine.
Under `srun`, Slurm's per-task variables are mapped to torchrun's.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from molt.config import ConfigError, MoltConfig, build_arg_parser, load_config, validate_config
from molt.metrics import configure_logging

# torch is imported inside the functions that use it: agent worker processes, started with
# multiprocessing's spawn, re-import this module (as __mp_main__) and have no use for it.
if TYPE_CHECKING:
    import torch

logger = logging.getLogger("molt")

CONTROLLER_KEY = "molt/controller_address"


def map_slurm_environment(environ: dict) -> None:
    """Under srun (no torchrun), derive RANK/WORLD_SIZE/LOCAL_RANK from Slurm's variables."""
    if "RANK" in environ or "SLURM_PROCID" not in environ:
        return
    environ.setdefault("RANK", environ["SLURM_PROCID"])
    environ.setdefault("WORLD_SIZE", environ["SLURM_NTASKS"])
    environ.setdefault("LOCAL_RANK", environ.get("SLURM_LOCALID", "0"))
    environ.setdefault("LOCAL_WORLD_SIZE", environ.get("SLURM_NTASKS_PER_NODE", environ["SLURM_NTASKS"]).split("(")[0])


def resolve_device(cfg: MoltConfig, local_rank: int) -> torch.device:
    import torch

    wanted = cfg.device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device='cuda' but no CUDA device is visible; set --set device=cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def job_host(environ: dict) -> str:
    """Address other ranks reach this one on: loopback when the whole job is on one node."""
    if environ.get("LOCAL_WORLD_SIZE") == environ.get("WORLD_SIZE"):
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def describe_layout(cfg: MoltConfig) -> str:
    lines = [f"world size {cfg.world_size}: {cfg.layout.num_trainer_ranks} trainer + "
             f"{cfg.layout.num_rollout_ranks} rollout ranks"]
    for rank in range(cfg.world_size):
        if rank < cfg.layout.num_trainer_ranks:
            role = "trainer (FSDP2 dp shard)" + (" + rollout controller + refit sender" if rank == 0 else "")
        else:
            role = (f"rollout: vLLM engine (tensor parallel {cfg.layout.engine_tensor_parallel_size}) + "
                    f"{cfg.rollout.num_agent_workers} agent worker process(es)")
        lines.append(f"  rank {rank}: {role}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser("Train an agent with RL (run under torchrun).").parse_args(argv)
    map_slurm_environment(os.environ)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    configure_logging(rank)
    launched = "MASTER_ADDR" in os.environ
    try:
        cfg = load_config(args.config, args.set)
        validate_config(cfg, world_size=world_size if launched and not args.dry_run else None)
    except ConfigError as error:
        logger.error("%s", error)
        return 2
    if args.dry_run:
        sys.stdout.write(describe_layout(cfg) + "\n")
        return 0
    if not launched:
        logger.error("molt.train must run under torchrun (or srun); e.g. "
                     "torchrun --nproc_per_node=%d -m molt.train --config %s", cfg.world_size, args.config)
        return 2
    return run(cfg, rank, world_size)


def run(cfg: MoltConfig, rank: int, world_size: int) -> int:
    import torch
    import torch.distributed as dist

    from molt.rollout import run_rollout_rank
    from molt.trainer import Trainer, remove_stale_metrics
    from molt.wire import Router

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    num_trainers = cfg.layout.num_trainer_ranks
    is_trainer = rank < num_trainers
    device = resolve_device(cfg, local_rank) if is_trainer else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.manual_seed(cfg.seed)
    # The world group is used for rendezvous only; training collectives use the trainer group.
    dist.init_process_group("cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo",
                            timeout=datetime.timedelta(seconds=cfg.rollout.engine_start_timeout_seconds + 600))
    trainer_group = dist.new_group(list(range(num_trainers)))
    store = dist.distributed_c10d._get_default_store()
    host = job_host(os.environ)
    rollout_ranks = list(range(num_trainers, world_size))
    try:
        if rank == 0:
            logger.info("%s", describe_layout(cfg))
            remove_stale_metrics(cfg.output_dir)
            router = Router(host)
            store.set(CONTROLLER_KEY, router.address)
            Trainer(cfg, rank=rank, group=trainer_group, device=device, host=host, controller_address=router.address,
                    router=router, rollout_ranks=rollout_ranks).train()
            logger.info("done; metrics in %s", os.path.join(cfg.output_dir, "metrics.jsonl"))
        else:
            address = store.get(CONTROLLER_KEY).decode()
            if is_trainer:
                Trainer(cfg, rank=rank, group=trainer_group, device=device, host=host, controller_address=address,
                        router=None, rollout_ranks=rollout_ranks).train()
            else:
                run_rollout_rank(cfg, rank, address, host)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
