"""The one way in: `torchrun --nproc_per_node=N -m molt.train --config configs/<recipe>.py [--set a.b=v]`.

Ranks 0..T-1 train (rank 0 also runs the rollout controller); ranks T.. each host one engine.
Under `srun`, Slurm's per-task variables are mapped to torchrun's.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import signal
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from molt import devices
from molt.config import (ConfigError, MoltConfig, build_arg_parser, check_device_options, config_warnings,
                         engine_start_limit_seconds, load_config, validate_config)
from molt.lifetime import die_with_owner, mark_owner
from molt.metrics import configure_logging

if __name__ == "__mp_main__":  # a process a rank spawned (its engine core, an agent worker): it dies with the rank
    die_with_owner()

# torch is imported inside the functions that use it: agent worker processes, started with
# multiprocessing's spawn, re-import this module (as __mp_main__) and have no use for it.
if TYPE_CHECKING:
    import torch

    from molt.dataset import PromptRow

logger = logging.getLogger("molt")

CONTROLLER_KEY = "molt/controller_address"
NO_CUDA = "device='cuda' but no CUDA device is visible; set --set device=cpu"
TRAINER_HELLO_SECONDS = 120  # how long the controller waits for the other trainer ranks' hellos
TIMEOUT_MARGIN_SECONDS = 600


@dataclass(frozen=True)
class TrainerGroupTimeout:
    """The trainer group's collective timeout (NCCL's watchdog, gloo's per-operation limit) and its
    parts, in seconds: the longest trainer ranks 1.. may sit in one trainer-group collective while
    rank 0 waits on engines or rollouts (molt.trainer, molt.controller). Torch's 30-minute default
    is shorter than one refit timeout of the large recipes."""

    engine_start_seconds: float
    """At start ranks 1.. go straight into the first refit check's forward pass (or, resuming, the
    refit's gathers) while rank 0 waits for their hellos (120 s) and every engine
    (rollout.engine_start_timeout_seconds), then builds the refit group (in refit_seconds)."""
    refit_seconds: float
    """Ranks 1.. wait in the refit's gathers and in agree_with_controller while rank 0 sends to and
    waits for the engines: refit.max_attempts attempts of refit.timeout_seconds, a refit-group build
    before each (its rendezvous and the engines' join confirmations, refit.timeout_seconds each), and
    the refit check's scoring on the engines (refit.timeout_seconds, when refit.check_every_steps)."""
    batch_seconds: float
    """Rank 0's wait for the next rollout outcome (agent.rollout_timeout_seconds x 2 + 60, the
    controller's limit for a silent rank) and one payload fetch for its own share
    (payloads.fetch_timeout_seconds). Today ranks 1.. wait for their share on their controller
    socket, outside any collective, and only the fetch overlaps their first all-reduce of the step;
    the rollout term keeps the limit right if the batch moves into a collective."""
    margin_seconds: float = TIMEOUT_MARGIN_SECONDS

    @property
    def total_seconds(self) -> float:
        return self.engine_start_seconds + self.refit_seconds + self.batch_seconds + self.margin_seconds

    def describe(self, cfg: MoltConfig) -> str:
        """The dry run's line: the total and each part with the fields it comes from."""
        refit, total = cfg.refit, self.total_seconds
        check = " + the refit check's scoring" if refit.check_every_steps else ""
        start = cfg.rollout.engine_start_timeout_seconds
        auto = ", auto: 300 s + 1.25 s per GiB of checkpoint per engine of a node" if start <= 0 else ""
        parts = [
            f"engine start {self.engine_start_seconds:,.0f} s ({TRAINER_HELLO_SECONDS} s hellos + "
            f"{self.engine_start_seconds - TRAINER_HELLO_SECONDS:,.0f} s: rollout.engine_start_timeout_seconds="
            f"{start:g}{auto})",
            f"refit {self.refit_seconds:,.0f} s (refit.max_attempts={refit.max_attempts} x (attempt + group build: "
            f"3 x refit.timeout_seconds={refit.timeout_seconds:g}){check})",
            f"batch {self.batch_seconds:,.0f} s (agent.rollout_timeout_seconds={cfg.agent.rollout_timeout_seconds:g} "
            f"x 2 + 60 + payloads.fetch_timeout_seconds={cfg.payloads.fetch_timeout_seconds:g})",
            f"margin {self.margin_seconds:,.0f} s"]
        return f"trainer group timeout: {total:,.0f} s ({total / 3600:.1f} h) = " + " + ".join(parts)


def trainer_group_timeout(cfg: MoltConfig, checkpoint_bytes: int | None = None) -> TrainerGroupTimeout:
    """The trainer group's collective timeout, from the waits rank 0 may make while ranks 1.. sit in
    a collective (TrainerGroupTimeout's fields say which). `checkpoint_bytes`: the model's size when
    model.path is not on this machine (--dry-run), for the automatic engine-start limit."""
    refit = cfg.refit
    return TrainerGroupTimeout(
        engine_start_seconds=TRAINER_HELLO_SECONDS + engine_start_limit_seconds(cfg, checkpoint_bytes),
        refit_seconds=(refit.max_attempts * 3 * refit.timeout_seconds
                       + (refit.timeout_seconds if refit.check_every_steps else 0.0)),
        batch_seconds=cfg.agent.rollout_timeout_seconds * 2 + 60 + cfg.payloads.fetch_timeout_seconds)


def map_slurm_environment(environ: dict) -> None:
    """Under a plain `srun` (one task per rank, no torchrun), set torchrun's variables from Slurm's.

    RANK <- SLURM_PROCID, WORLD_SIZE <- SLURM_NTASKS, LOCAL_RANK <- SLURM_LOCALID, LOCAL_WORLD_SIZE
    <- this node's entry of SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE), MASTER_ADDR <- the
    first host of the step's node list (where srun puts task 0), MASTER_PORT <- 20000 + SLURM_JOB_ID
    % 10000. A variable already set (by torchrun, or exported by the launch script) is kept; under
    torchrun (RANK set) nothing changes.
    """
    if "RANK" in environ or "SLURM_PROCID" not in environ:
        return
    environ.setdefault("RANK", environ["SLURM_PROCID"])
    environ.setdefault("WORLD_SIZE", environ["SLURM_NTASKS"])
    environ.setdefault("LOCAL_RANK", environ.get("SLURM_LOCALID", "0"))
    tasks_per_node = (environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
                      or environ.get("SLURM_NTASKS_PER_NODE") or environ["SLURM_NTASKS"])
    counts = expand_tasks_per_node(tasks_per_node)  # one entry (SLURM_NTASKS_PER_NODE) counts for every node
    environ.setdefault("LOCAL_WORLD_SIZE", str(counts[min(int(environ.get("SLURM_NODEID", "0")), len(counts) - 1)]))
    nodelist = next((environ[name] for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                     if environ.get(name)), None)
    if nodelist is not None:
        environ.setdefault("MASTER_ADDR", expand_hostlist(nodelist)[0])
    if "SLURM_JOB_ID" in environ:
        # Below Linux's ephemeral range (32768+), so the port is not a client socket's by chance.
        environ.setdefault("MASTER_PORT", str(20000 + int(environ["SLURM_JOB_ID"]) % 10000))


def expand_tasks_per_node(spec: str) -> list[int]:
    """Slurm's tasks-per-node form, one count per node: `8(x2),4` -> [8, 8, 4]."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"cannot read Slurm tasks per node {spec!r} (expected e.g. '8(x2),4')")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compact host list, in order, as `scontrol show hostnames` gives it.

    `node[01-03,07],gpu5` -> node01 node02 node03 node07 gpu5; zero padding follows the range's
    lower bound; several bracket groups in one name multiply (`r[1-2]n[1-2]` -> r1n1 r1n2 r2n1 r2n2).
    """
    names, depth, start = [], 0, 0
    for index, char in enumerate(hostlist + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"cannot read Slurm host list {hostlist!r}: unbalanced brackets")
        if char == "," and depth == 0:
            if hostlist[start:index].strip():
                names += _expand_host(hostlist[start:index].strip(), hostlist)
            start = index + 1
    if depth != 0 or not names:
        raise ValueError(f"cannot read Slurm host list {hostlist!r}: expected e.g. 'node[01-02],gpu5'")
    return names


def _expand_host(pattern: str, hostlist: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        return [pattern]
    items = []
    for part in match[1].split(","):
        bounds = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if bounds is None:
            raise ValueError(f"cannot read Slurm host list {hostlist!r}: bad range {part!r}")
        low, high = bounds[1], bounds[2] or bounds[1]
        items += [str(number).zfill(len(low)) for number in range(int(low), int(high) + 1)]
    head, tail = pattern[:match.start()], pattern[match.end():]
    return [head + item + rest for item in items for rest in _expand_host(tail, hostlist)]


def trainer_device_type(cfg: MoltConfig) -> str:
    """'cuda' or 'cpu': where trainer ranks will compute (device=auto: CUDA when visible)."""
    return devices.trainer_device_type(cfg.device)


def resolve_device(cfg: MoltConfig, local_rank: int) -> torch.device:
    import torch

    wanted = cfg.device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(NO_CUDA)
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def job_host(environ: dict) -> str:
    """Address other ranks reach this one on: loopback when the whole job is on one node.

    Otherwise the host name's address; where that is a loopback one (a common /etc/hosts entry,
    useless to other nodes), the address of the interface that routes to MASTER_ADDR.
    """
    if environ.get("LOCAL_WORLD_SIZE") == environ.get("WORLD_SIZE"):
        return "127.0.0.1"
    address = socket.gethostbyname(socket.gethostname())
    if not address.startswith("127.") or not environ.get("MASTER_ADDR"):
        return address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        # Connecting a UDP socket only picks the route and source address; nothing is sent.
        probe.connect((socket.gethostbyname(environ["MASTER_ADDR"]), int(environ.get("MASTER_PORT", "29500"))))
        return probe.getsockname()[0]


def describe_layout(cfg: MoltConfig) -> str:
    """Each rank's role (and on GPUs its node and GPUs), as --dry-run prints it."""
    from molt.dry_run import describe_placements
    from molt.placement import place_ranks

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
            check_device_options(cfg, trainer_device_type(cfg))
            if launched and cfg.checkpoint.interval_steps and not cfg.checkpoint.resume:
                from molt.checkpoint import check_fresh_start

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
    from molt.placement import PlacementError
    from molt.trainer import RolloutsFailedError

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
    start (molt.dataset); the controller's loader takes them, so the file is read once. A bad row, or
    fewer rows than one step takes, is a ConfigError naming the file, line or field."""
    from molt.dataset import load_prompt_rows

    try:
        rows = load_prompt_rows(cfg.data.train_path)
    except ValueError as error:
        raise ConfigError(f"data.train_path: {error}") from None
    if len(rows) < cfg.rollout.prompts_per_step:
        raise ConfigError(f"data.train_path={cfg.data.train_path!r} has {len(rows)} rows, fewer than "
                          f"rollout.prompts_per_step={cfg.rollout.prompts_per_step}: lower it or add rows")
    if cfg.eval.every_steps:  # the eval set, checked here too so a bad one stops the job before anything starts
        from molt.evaluation import split_eval_rows

        split_eval_rows(cfg, rows)
    return rows


def pin_engine_gpus(cfg: MoltConfig, rank: int, environ: dict, node_gpus: list[str] | None = None) -> None:
    """Make a rollout rank's engine start on its own GPUs (molt.placement.place_ranks: trainers take
    the first GPUs of a node, each engine the next engine_tensor_parallel_size), not on the node's
    first ones, where vLLM starts by default. Indices go through a CUDA_VISIBLE_DEVICES the launcher
    set for the whole node; where it shows too few GPUs nothing is pinned and the start-up placement
    check names the rank. `node_gpus`: the node's GPUs (molt.placement.node_gpu_ids), read from
    `environ` when None. With layout.colocate the GPUs are the trainer ranks' (shared). Not checked on
    a GPU yet (the CUDA build of vLLM is not on the machines Molt is tested on)."""
    if cfg.device == "cpu":
        return
    from molt.placement import node_gpu_ids, place_ranks

    gpus, ids = place_ranks(cfg.layout)[rank].gpus, node_gpus or node_gpu_ids(environ, cfg.layout.gpus_per_node)
    if gpus[-1] < len(ids):
        environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[gpu] for gpu in gpus)


def run(cfg: MoltConfig, rank: int, world_size: int, *, prompt_rows: list[PromptRow] | None = None) -> int:
    import torch
    import torch.distributed as dist

    from molt.checkpoint import STOP_REQUEST
    from molt.parallelize import build_trainer_mesh
    from molt.placement import check_placement, node_gpu_ids, read_nvml_gpu_count
    from molt.rollout import run_rollout_rank
    from molt.trainer import Trainer
    from molt.wire import ControllerAddress, Router

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
    device_type = trainer_device_type(cfg) if is_trainer else "cpu"
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
    device = resolve_device(cfg, local_rank) if is_trainer else torch.device("cpu")
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
            Trainer(cfg, rank=rank, group=trainer_group, mesh=mesh, device=device, host=host,
                    controller_address=router.address, router=router, rollout_ranks=rollout_ranks,
                    prompt_rows=prompt_rows).train()
            logger.info("done; metrics in %s", os.path.join(cfg.output_dir, "metrics.jsonl"))
        else:
            address = ControllerAddress.from_bytes(store.get(CONTROLLER_KEY))
            if is_trainer:
                Trainer(cfg, rank=rank, group=trainer_group, mesh=mesh, device=device, host=host,
                        controller_address=address, router=None, rollout_ranks=rollout_ranks).train()
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
