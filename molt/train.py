"""The one way in: `torchrun --nproc_per_node=N -m molt.train --config configs/<recipe>.py [--set a.b=v]`.

Ranks 0..T-1 train (rank 0 also runs the rollout controller); ranks T.. each host one engine.
Under `srun`, Slurm's per-task variables are mapped to torchrun's.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from molt.config import (ConfigError, MoltConfig, build_arg_parser, check_device_options, config_warnings,
                         engine_start_limit_seconds, load_config, validate_config)
from molt.distributed.devices import NO_CUDA, resolve_device, trainer_device_type
from molt.distributed.lifetime import die_with_owner, mark_owner
from molt.distributed.slurm import job_host, map_slurm_environment
from molt.distributed.timeouts import trainer_group_timeout
from molt.metrics import configure_logging

if __name__ == "__mp_main__":  # a process a rank spawned (its engine core, an agent worker): it dies with the rank
    die_with_owner()

# torch is imported inside the functions that use it: agent worker processes, started with
# multiprocessing's spawn, re-import this module (as __mp_main__) and have no use for it.
if TYPE_CHECKING:
    from molt.controller.prompts import PromptRow

logger = logging.getLogger("molt")

CONTROLLER_KEY = "molt/controller_address"


def describe_layout(cfg: MoltConfig) -> str:
    """Each rank's role (and on GPUs its node and GPUs), as --dry-run prints it."""
    from molt.dry_run import describe_placements
    from molt.distributed.placement import place_ranks

    return "\n".join(describe_placements(cfg, place_ranks(cfg.layout)))


def dry_run(cfg: MoltConfig) -> int:
    """Print the dry run's report (molt.dry_run) as it goes; 2 after the first problem."""
    from molt.dry_run import dry_run_report

    try:
        for line in dry_run_report(cfg):
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
    except ConfigError as error:
        logger.error("%s", error)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser("Train an agent with RL (run under torchrun).").parse_args(argv)
    map_slurm_environment(os.environ)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    configure_logging(rank)
    mark_owner()  # what this rank spawns (engine core, agent workers) dies with it, even on SIGKILL
    launched = "MASTER_ADDR" in os.environ
    try:
        cfg = load_config(args.config, args.set)
        if not args.dry_run:  # the dry run validates without the files and the job's world size
            validate_config(cfg, world_size=world_size if launched else None)
            check_device_options(cfg, trainer_device_type(cfg.device))
            if launched and cfg.checkpoint.interval_steps and not cfg.checkpoint.resume:
                from molt.trainer.checkpoint import check_fresh_start

                check_fresh_start(cfg.checkpoint_dir, overwrite=cfg.checkpoint.overwrite, rank=rank)
    except ConfigError as error:
        logger.error("%s", error)
        return 2
    if rank == 0:
        for warning in config_warnings(cfg):
            logger.warning("%s", warning)
    if args.dry_run:
        return dry_run(cfg)
    if cfg.layout.trainer_context_parallel_size > 1:
        logger.error("layout.trainer_context_parallel_size=%d: context parallelism is validated by --dry-run but the "
                     "training loop does not shard sequences yet (docs/gpu.md); set 1",
                     cfg.layout.trainer_context_parallel_size)
        return 2
    if not launched:
        logger.error("molt.train must run under torchrun (or srun); e.g. "
                     "torchrun --nproc_per_node=%d -m molt.train --config %s", cfg.world_size, args.config)
        return 2
    prompt_rows = None
    if rank == 0:  # the controller's rank reads the prompts; other ranks wait in the rendezvous meanwhile
        try:
            prompt_rows = read_prompt_rows(cfg)
        except ConfigError as error:
            logger.error("%s", error)
            return 2
    from molt.distributed.placement import PlacementError
    from molt.trainer.feed import RolloutsFailedError

    try:
        return run(cfg, rank, world_size, prompt_rows=prompt_rows)
    except PlacementError as error:  # every rank raises the same one
        if rank == 0:
            logger.error("%s", error)
        else:
            logger.error("the processes do not match the layout's placement; rank 0 logs how")
        return 2
    except RolloutsFailedError:  # rank 0 logged why; every rank stopped in order, the engines first
        return 1


def read_prompt_rows(cfg: MoltConfig) -> list[PromptRow]:
    """Every row of data.train_path, validated before the process group, the models or the engines
    start (molt.controller.prompts); the controller's loader takes them, so the file is read once. A bad row, or
    fewer rows than one step takes, is a ConfigError naming the file, line or field."""
    from molt.controller.prompts import load_field_rows

    rows = load_field_rows("data.train_path", cfg.data.train_path)
    if len(rows) < cfg.rollout.prompts_per_step:
        raise ConfigError(f"data.train_path={cfg.data.train_path!r} has {len(rows)} rows, fewer than "
                          f"rollout.prompts_per_step={cfg.rollout.prompts_per_step}: lower it or add rows")
    if cfg.eval.every_steps:  # the eval set, checked here too so a bad one stops the job before anything starts
        from molt.controller.evaluation import split_eval_rows

        split_eval_rows(cfg, rows)
    return rows


def pin_engine_gpus(cfg: MoltConfig, rank: int, environ: dict, node_gpus: list[str] | None = None) -> None:
    """Make a rollout rank's engine start on its own GPUs (molt.distributed.placement.place_ranks: trainers take
    the first GPUs of a node, each engine the next engine_tensor_parallel_size), not on the node's
    first ones, where vLLM starts by default. Indices go through a CUDA_VISIBLE_DEVICES the launcher
    set for the whole node; where it shows too few GPUs nothing is pinned and the start-up placement
    check names the rank. `node_gpus`: the node's GPUs (molt.distributed.placement.node_gpu_ids), read from
    `environ` when None. With layout.colocate the GPUs are the trainer ranks' (shared). Not checked on
    a GPU yet (the CUDA build of vLLM is not on the machines Molt is tested on)."""
    if cfg.device == "cpu":
        return
    from molt.distributed.placement import node_gpu_ids, place_ranks

    gpus, ids = place_ranks(cfg.layout)[rank].gpus, node_gpus or node_gpu_ids(environ, cfg.layout.gpus_per_node)
    if gpus[-1] < len(ids):
        environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[gpu] for gpu in gpus)


def run(cfg: MoltConfig, rank: int, world_size: int, *, prompt_rows: list[PromptRow] | None = None) -> int:
    import torch
    import torch.distributed as dist

    from molt.controller.pool import RolloutController
    from molt.trainer.checkpoint import STOP_REQUEST
    from molt.distributed.parallelize import build_trainer_mesh
    from molt.distributed.placement import check_placement, node_gpu_ids, read_nvml_gpu_count
    from molt.rollout.rank import run_rollout_rank
    from molt.trainer.loop import Trainer
    from molt.transport.mailbox import Mailbox
    from molt.transport.wire import ControllerAddress, Router

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    num_trainers = cfg.layout.num_trainer_ranks
    is_trainer = rank < num_trainers
    if is_trainer:
        STOP_REQUEST.install()  # SIGUSR1: a checkpoint at the next step boundary, then exit 0
    else:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # inherited by its engine and agent workers
    # Before a rollout rank pins its own; what the node really has (NVML) where the launcher set no list.
    nvml_count = read_nvml_gpu_count() if cfg.device != "cpu" else None
    node_gpus = node_gpu_ids(os.environ, cfg.layout.gpus_per_node, nvml_count)
    if not is_trainer:
        pin_engine_gpus(cfg, rank, os.environ, node_gpus)  # before anything in this process touches CUDA
    device_type = trainer_device_type(cfg.device) if is_trainer else "cpu"
    if device_type == "cuda" and not torch.cuda.is_available():  # before NCCL fails to start, less clearly
        raise ConfigError(NO_CUDA)
    torch.manual_seed(cfg.seed)
    # The world group is used for rendezvous and the placement check only; training collectives use
    # the trainer group.
    dist.init_process_group("cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=engine_start_limit_seconds(cfg) + 600))
    # Every rank's host, LOCAL_RANK and GPUs against the placement, before a trainer takes cuda:LOCAL_RANK.
    check_placement(cfg, rank, os.environ, node_gpus=node_gpus, group=dist.group.WORLD,
                    on_gpu=device_type == "cuda" if is_trainer else cfg.device != "cpu")
    device = resolve_device(cfg.device, local_rank) if is_trainer else torch.device("cpu")
    timeout_seconds = trainer_group_timeout(cfg).total_seconds
    trainer_group = dist.new_group(list(range(num_trainers)), timeout=datetime.timedelta(seconds=timeout_seconds))
    # Collective over the world like new_group: rollout ranks take part and get None.
    mesh = build_trainer_mesh(num_trainer_ranks=num_trainers, device_type=device.type,
                              data_parallel_replicate=cfg.layout.trainer_data_parallel_replicate,
                              tensor_parallel_size=cfg.layout.trainer_tensor_parallel_size,
                              expert_parallel_size=cfg.layout.trainer_expert_parallel_size,
                              timeout_seconds=timeout_seconds)
    store = dist.distributed_c10d._get_default_store()
    host = job_host(os.environ)
    rollout_ranks = list(range(num_trainers, world_size))
    try:
        if rank == 0:
            logger.info("%s", describe_layout(cfg))
            router = Router(host)
            # The controller's address and the job's keys: every rank trusts this store for rendezvous.
            store.set(CONTROLLER_KEY, router.address.to_bytes())
            # Rank 0's roles: the rollout controller, which its batch feed and refit coordinator drive.
            controller = RolloutController(cfg, Mailbox(router, rollout_ranks), prompt_rows=prompt_rows)
            Trainer(cfg, rank=rank, group=trainer_group, mesh=mesh, device=device, host=host,
                    controller=controller).train()
            logger.info("done; metrics in %s", os.path.join(cfg.output_dir, "metrics.jsonl"))
        else:
            address = ControllerAddress.from_bytes(store.get(CONTROLLER_KEY))
            if is_trainer:
                Trainer(cfg, rank=rank, group=trainer_group, mesh=mesh, device=device, host=host,
                        controller_address=address).train()
            else:
                run_rollout_rank(cfg, rank, address, host)
    finally:
        dist.destroy_process_group()
    return 0


class FastExit:
    """Ends a rank that succeeded once its exit handlers have run, without Python's teardown after
    them: that frees, one by one, every object torch, vLLM and transformers made (~2 s a rank on a
    small CPU, at the end of every job) for memory the OS takes back anyway. Registered before any
    other exit handler, so that all of them (multiprocessing's, weakref finalizers, W&B's...) run
    first. A rank that failed, or raised, ends the usual way: its last messages to other ranks are
    sent without waiting, and the teardown gives them time to leave."""

    def __init__(self):
        self.code: int | None = None

    def __call__(self) -> None:
        if self.code != 0:
            return
        logging.shutdown()  # registered before this handler, so it would run after it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.code)


if __name__ == "__main__":
    import atexit

    fast_exit = FastExit()
    atexit.register(fast_exit)
    fast_exit.code = main()
    sys.exit(fast_exit.code)
