"""Where each rank runs, and the start-up check that the launcher put it there.

`place_ranks` fills nodes of `layout.gpus_per_node` GPUs in rank order: the trainer ranks first,
one GPU each, then each rollout rank with its engine's `engine_tensor_parallel_size` GPUs on one
node. The processes per node follow (`tasks_per_node`): torchrun can start a layout only when every
node runs the same number; launch/slurm_srun.sbatch starts any layout, one Slurm task per rank.

At start-up every rank reports its host, the LOCAL_RANK and LOCAL_WORLD_SIZE its launcher gave and
the physical GPUs it will use (`claim_gpus`); one all-gather over the world group
(`gather_claims`) hands every rank all the reports, and `find_placement_problems` names each
overlap and mismatch, so a wrong launch stops before a model or an engine is built.

`python -m molt.distributed.placement --config PATH [--set a.b=v ...] [--nodes N]` prints the processes each
node runs, for the launch scripts.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import socket
import sys
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from molt.config import ConfigError, LayoutConfig, MoltConfig, build_arg_parser, load_config, validate_config
from molt.distributed.devices import omp_num_threads, trainer_device_type

if TYPE_CHECKING:
    import torch.distributed as dist

MAX_LINES_PER_KIND = 6  # problems of one kind shown before "... and N more"


class PlacementError(ConfigError):
    """The launched processes do not match the layout's placement; every rank raises the same one."""


@dataclass(frozen=True)
class Placement:
    """Where one rank runs."""

    rank: int
    is_trainer: bool
    node: int
    local_rank: int  # this process's index among its node's processes
    gpus: tuple[int, ...]  # GPU indices on its node: one for a trainer, the engine's for a rollout rank


@dataclass(frozen=True)
class GpuClaim:
    """One rank's start-up report: where it runs, what its launcher told it, which GPUs it will use."""

    rank: int
    host: str
    local_rank: int  # LOCAL_RANK (torchrun's, or mapped from srun's SLURM_LOCALID)
    local_world_size: int  # LOCAL_WORLD_SIZE; -1 when the launcher set none
    on_gpu: bool  # a trainer computing on CUDA, or a rollout rank pinning its engine's GPUs
    gpus: tuple[str, ...] = ()  # physical ids, entries of the node's CUDA_VISIBLE_DEVICES; () on CPU
    problem: str = ""  # what the rank found wrong by itself (fewer visible GPUs than it needs)


def place_ranks(layout: LayoutConfig) -> list[Placement]:
    """Ranks in order fill nodes of `layout.gpus_per_node` GPUs: a trainer rank takes one GPU, a
    rollout rank its engine's `engine_tensor_parallel_size` GPUs (vLLM's own workers use them), on
    one node. Trainers come first, so a trainer's GPU is its local rank (what `resolve_device` uses).
    With layout.colocate the engines start over from GPU 0: engine i shares the GPUs of trainer
    ranks i x engine_tensor_parallel_size onwards (validate_config: one node, as many engine GPUs
    as trainer ranks)."""
    gpus_per_node, tensor_parallel = layout.gpus_per_node, layout.engine_tensor_parallel_size
    placements, next_gpu, num_processes = [], 0, {}
    for rank in range(layout.num_trainer_ranks + layout.num_rollout_ranks):
        is_trainer = rank < layout.num_trainer_ranks
        if layout.colocate and rank == layout.num_trainer_ranks:
            next_gpu = 0
        width = 1 if is_trainer else tensor_parallel
        node, first = divmod(next_gpu, gpus_per_node)
        if first + width > gpus_per_node:
            raise ConfigError(
                f"rank {rank}'s engine would take GPUs {first}-{first + width - 1} of node {node}, which has "
                f"{gpus_per_node} (layout.gpus_per_node): an engine's GPUs must share one node; make "
                f"layout.num_trainer_ranks={layout.num_trainer_ranks} a multiple of "
                f"layout.engine_tensor_parallel_size={tensor_parallel}")
        local_rank = num_processes.get(node, 0)
        num_processes[node] = local_rank + 1
        placements.append(Placement(rank=rank, is_trainer=is_trainer, node=node, local_rank=local_rank,
                                    gpus=tuple(range(first, first + width))))
        next_gpu += width
    return placements


def count_node_gpus(placements: list[Placement], node: int) -> int:
    """GPUs node `node` of the placement uses: its highest GPU index + 1."""
    return max(gpu for placement in placements if placement.node == node for gpu in placement.gpus) + 1


def count_per_node(placements: list[Placement]) -> list[int]:
    """Processes on each node, in node order (ranks fill nodes in order, so no node is empty)."""
    return list(Counter(placement.node for placement in placements).values())


def tasks_per_node(cfg: MoltConfig, num_nodes: int | None = None) -> list[int]:
    """Processes each node runs. On GPUs (device auto or cuda) the placement's, whatever `num_nodes`;
    on CPU, where there are no GPUs to place, the ranks split evenly over `num_nodes` (default 1)."""
    if cfg.device != "cpu":
        return count_per_node(place_ranks(cfg.layout))
    num_nodes = num_nodes or 1
    if cfg.world_size % num_nodes:
        raise ConfigError(f"the recipe has {cfg.world_size} ranks (layout.num_trainer_ranks + "
                          f"layout.num_rollout_ranks), which {num_nodes} nodes cannot share evenly; change --nodes "
                          f"or the layout so nodes divide it")
    return [cfg.world_size // num_nodes] * num_nodes


def format_tasks_per_node(counts: list[int]) -> str:
    """Slurm's compact form, the inverse of molt.distributed.slurm.expand_tasks_per_node: [8, 8, 1] -> '8(x2),1'."""
    runs = [(count, len(list(repeats))) for count, repeats in itertools.groupby(counts)]
    return ",".join(f"{count}(x{repeat})" if repeat > 1 else str(count) for count, repeat in runs)


def describe_launcher(counts: list[int]) -> str:
    """The launch command a layout needs: torchrun when every node runs the same number of processes."""
    if len(set(counts)) == 1:
        return (f"torchrun --nnodes {len(counts)} --nproc_per_node {counts[0]} -m molt.train --config ... "
                f"(under Slurm: sbatch --nodes {len(counts)} launch/slurm.sbatch ...)")
    return (f"sbatch --nodes {len(counts)} launch/slurm_srun.sbatch ... (per-node task counts "
            f"{format_tasks_per_node(counts)}; torchrun cannot start this layout)")


def name_ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {span(ranks)}"


def span(values: list[int]) -> str:
    """`0-7` for a run of consecutive numbers, else `0,2,5`."""
    if len(values) > 1 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ",".join(str(value) for value in values)


# -- the start-up check ------------------------------------------------------------------------

def read_nvml_gpu_count() -> int | None:
    """The GPUs the NVIDIA driver shows this machine, whatever CUDA_VISIBLE_DEVICES says; None where
    there is no driver (a CPU machine). NVML creates no CUDA context, so a rollout rank may ask before
    vLLM starts (the way torch counts without initialising CUDA: torch/cuda/__init__.py,
    _raw_device_count_nvml, whose calls these are)."""
    from ctypes import CDLL, byref, c_int

    try:
        nvml = CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    count = c_int(-1)
    if nvml.nvmlInit() != 0 or nvml.nvmlDeviceGetCount_v2(byref(count)) != 0:
        return None
    return count.value


def node_gpu_ids(environ: dict, gpus_per_node: int, nvml_count: int | None = None) -> list[str]:
    """The node's GPUs as the launcher shows them: CUDA_VISIBLE_DEVICES' entries (indices or UUIDs);
    when it is unset, the GPUs NVML counts (`nvml_count`, read_nvml_gpu_count), or, with no NVML
    reading, 0..gpus_per_node-1."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return visible.split(",")
    count = gpus_per_node if nvml_count is None or nvml_count < 0 else nvml_count
    return [str(index) for index in range(count)]


def describe_gpu_shortfall(placements: list[Placement], node: int, *, host: str, node_gpus: list[str]) -> str:
    """'' when host `host` shows every GPU that layout node `node` uses; else what is missing, with both counts."""
    needed = count_node_gpus(placements, node)
    if needed <= len(node_gpus):
        return ""
    return (f"the layout needs {needed} GPUs on node {node} (layout.gpus_per_node, layout.num_trainer_ranks, "
            f"layout.num_rollout_ranks x layout.engine_tensor_parallel_size) but host {host} has {len(node_gpus)} "
            f"({','.join(node_gpus) or 'none'}): shrink the layout to {len(node_gpus)} GPU(s) (layout.colocate=True "
            f"shares them between trainer ranks and engines) or run on more GPUs")


def describe_role(placement: Placement) -> str:
    return "trainer" if placement.is_trainer else f"engine of rollout rank {placement.rank}"


def claim_gpus(placement: Placement, *, host: str, local_rank: int, local_world_size: int, node_gpus: list[str],
               on_gpu: bool, shortfall: str = "") -> GpuClaim:
    """What one rank will use: a trainer cuda:LOCAL_RANK (molt.distributed.devices.resolve_device), a rollout rank
    its placement's GPUs (molt.train.pin_engine_gpus), both as entries of the node's GPU list.
    `shortfall`: describe_gpu_shortfall's line for this rank's node, reported instead of the rank's own."""
    claim = GpuClaim(rank=placement.rank, host=host, local_rank=local_rank, local_world_size=local_world_size,
                     on_gpu=on_gpu)
    if not on_gpu:
        return claim
    indices = (local_rank,) if placement.is_trainer else placement.gpus
    if shortfall:
        return dataclasses.replace(claim, problem=shortfall)
    if max(indices) >= len(node_gpus):
        return dataclasses.replace(claim, problem=(
            f"rank {placement.rank} ({describe_role(placement)}) needs GPU index {max(indices)} of host {host}, "
            f"which shows {len(node_gpus)} GPU(s) ({','.join(node_gpus)}): every process must see all of its "
            f"node's GPUs (no --gpus-per-task or --gpu-bind), and layout.gpus_per_node must be what a node has"))
    return dataclasses.replace(claim, gpus=tuple(node_gpus[index] for index in indices))


def find_placement_problems(placements: list[Placement] | None, claims: list[GpuClaim]) -> list[str]:
    """Every way the launched processes differ from the placement, each naming ranks, hosts and GPUs:
    GPUs used twice, LOCAL_RANK / LOCAL_WORLD_SIZE other than the placement's, layout nodes split
    over hosts or sharing one. On CPU (rank 0 computes on the CPU) nothing is placed: no problems."""
    if not claims[0].on_gpu or placements is None:
        return []
    by_rank = {claim.rank: claim for claim in claims}
    return [*_capped(list(dict.fromkeys(claim.problem for claim in claims if claim.problem))),
            *_capped(_gpu_overlaps(placements, by_rank)),
            *_capped(_local_rank_mismatches(placements, by_rank)),
            *_capped(_local_world_size_mismatches(placements, by_rank)),
            *_capped(_host_mismatches(placements, by_rank))]


def _gpu_overlaps(placements: list[Placement], claims: dict[int, GpuClaim]) -> list[str]:
    users: dict[tuple[str, str], list[int]] = {}
    for claim in claims.values():
        for gpu in claim.gpus:
            users.setdefault((claim.host, gpu), []).append(claim.rank)
    shared: dict[tuple[str, tuple[int, ...]], list[str]] = {}  # (host, ranks) -> the GPUs they share
    for (host, gpu), ranks in users.items():
        if len(ranks) > 1 and not _placed_together(placements, claims, ranks, gpu):
            shared.setdefault((host, tuple(ranks)), []).append(gpu)
    lines = []
    for (host, ranks), gpus in shared.items():
        names = [f"rank {rank} ({describe_role(placements[rank])})" for rank in ranks]
        who = f"{', '.join(names[:-1])} and {names[-1]} {'both' if len(names) == 2 else 'all'}"
        lines.append(f"{who} use GPU{'s' if len(gpus) > 1 else ''} {','.join(gpus)} of host {host}")
    return lines


def _placed_together(placements: list[Placement], claims: dict[int, GpuClaim], ranks: list[int], gpu: str) -> bool:
    """Whether the placement itself puts `ranks` on `gpu` (layout.colocate: one trainer rank and the engine
    sharing its GPU): every rank on one node, and `gpu` the same GPU index of each one's placement."""
    indices = set()
    for rank in ranks:
        placement, claim = placements[rank], claims[rank]
        indices.add((placement.node, placement.gpus[claim.gpus.index(gpu)]))
    return len(indices) == 1 and sum(placements[rank].is_trainer for rank in ranks) <= 1


def _local_rank_mismatches(placements: list[Placement], claims: dict[int, GpuClaim]) -> list[str]:
    lines = []
    for placement in placements:
        claim = claims[placement.rank]
        if claim.local_rank != placement.local_rank:
            line = (f"rank {placement.rank} expected local rank {placement.local_rank} on node {placement.node} but "
                    f"the launcher gave LOCAL_RANK={claim.local_rank}")
            if placement.is_trainer:
                line += f", so it would train on cuda:{claim.local_rank} instead of GPU {placement.gpus[0]}"
            lines.append(line)
    return lines


def _local_world_size_mismatches(placements: list[Placement], claims: dict[int, GpuClaim]) -> list[str]:
    per_node = Counter(placement.node for placement in placements)
    wrong: dict[tuple[int, int], list[int]] = {}  # (node, the launcher's LOCAL_WORLD_SIZE) -> ranks
    for placement in placements:
        size = claims[placement.rank].local_world_size
        if size not in (-1, per_node[placement.node]):
            wrong.setdefault((placement.node, size), []).append(placement.rank)
    return [f"node {node} of the layout runs {per_node[node]} process(es) but the launcher gave {name_ranks(ranks)} "
            f"LOCAL_WORLD_SIZE={size}" for (node, size), ranks in wrong.items()]


def _host_mismatches(placements: list[Placement], claims: dict[int, GpuClaim]) -> list[str]:
    hosts_of_node: dict[int, dict[str, list[int]]] = {}
    nodes_of_host: dict[str, dict[int, list[int]]] = {}
    for placement in placements:
        host = claims[placement.rank].host
        hosts_of_node.setdefault(placement.node, {}).setdefault(host, []).append(placement.rank)
        nodes_of_host.setdefault(host, {}).setdefault(placement.node, []).append(placement.rank)
    lines = []
    for node, hosts in hosts_of_node.items():
        if len(hosts) > 1:
            where = ", ".join(f"{host} ({name_ranks(ranks)})" for host, ranks in hosts.items())
            lines.append(f"node {node} of the layout runs on {len(hosts)} hosts: {where}")
    for host, nodes in nodes_of_host.items():
        if len(nodes) > 1:
            which = ", ".join(f"node {node} ({name_ranks(ranks)})" for node, ranks in nodes.items())
            lines.append(f"host {host} runs the ranks of {len(nodes)} layout nodes: {which}")
    return lines


def _capped(lines: list[str]) -> list[str]:
    if len(lines) <= MAX_LINES_PER_KIND:
        return lines
    return lines[:MAX_LINES_PER_KIND] + [f"... and {len(lines) - MAX_LINES_PER_KIND} more like these"]


def placement_error(placements: list[Placement], problems: list[str]) -> PlacementError:
    counts = count_per_node(placements)
    return PlacementError(
        "the launched processes do not match the layout's placement (--dry-run prints it):\n  "
        + "\n  ".join(problems)
        + f"\nthe layout needs {len(counts)} node(s), every process seeing all of its node's GPUs; launch: "
          f"{describe_launcher(counts)}")


def gather_claims(claim: GpuClaim, group: dist.ProcessGroup) -> list[GpuClaim]:
    """Every rank's claim, in rank order, on every rank: JSON bytes in CPU tensors (so gloo carries
    them, also where the trainers use NCCL, and nothing is pickled), two all-gathers over `group`."""
    import torch
    import torch.distributed as dist

    payload = json.dumps(dataclasses.asdict(claim)).encode()
    world_size = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=group)
    longest = max(int(size) for size in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    claims = []
    for size, data in zip(sizes, gathered):
        fields = json.loads(data[:int(size)].numpy().tobytes())
        claims.append(GpuClaim(**{**fields, "gpus": tuple(fields["gpus"])}))
    return claims


def check_placement(cfg: MoltConfig, rank: int, environ: dict, *, node_gpus: list[str], on_gpu: bool,
                    group: dist.ProcessGroup) -> None:
    """Collective over `group` (the world): raises PlacementError on every rank, naming ranks, hosts and
    GPUs, when a process runs elsewhere than `place_ranks` says or two use one GPU. `node_gpus`:
    the node's GPUs before a rollout rank pinned its own (node_gpu_ids)."""
    host, local_rank = socket.gethostname(), int(environ.get("LOCAL_RANK", "0"))
    local_world_size = int(environ.get("LOCAL_WORLD_SIZE", "-1"))
    if cfg.device == "cpu":  # nothing to place; the all-gather still runs, as on GPUs
        placements, claim = None, GpuClaim(rank=rank, host=host, local_rank=local_rank,
                                           local_world_size=local_world_size, on_gpu=False)
    else:
        placements = place_ranks(cfg.layout)
        shortfall = describe_gpu_shortfall(placements, placements[rank].node, host=host, node_gpus=node_gpus)
        claim = claim_gpus(placements[rank], host=host, local_rank=local_rank, local_world_size=local_world_size,
                           node_gpus=node_gpus, on_gpu=on_gpu, shortfall=shortfall if on_gpu else "")
    problems = find_placement_problems(placements, gather_claims(claim, group))
    if problems:
        raise placement_error(placements, problems)


def main(argv: list[str] | None = None) -> int:
    parser = build_arg_parser("Print the processes each node of a recipe's layout runs (for launch/*.sbatch).")
    parser.add_argument("--nodes", type=int, default=None,
                        help="nodes of the allocation; a CPU recipe's ranks are split evenly over them")
    parser.add_argument("--omp-threads", action="store_true",
                        help="print instead the OMP_NUM_THREADS of each rank (molt.distributed.devices.omp_num_threads: 1 on "
                             "CPU, this machine's cores shared out over the fullest node's ranks on GPUs)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        validate_config(cfg, require_files=False)
        counts = tasks_per_node(cfg, args.nodes)
    except ConfigError as error:
        sys.stderr.write(f"error: {error}\n")
        return 2
    if args.omp_threads:
        threads = omp_num_threads(trainer_device_type(cfg.device), len(os.sched_getaffinity(0)), max(counts))
        sys.stdout.write(f"{threads}\n")
        return 0
    sys.stdout.write(" ".join(str(count) for count in counts) + "\n")
    return 0


if __name__ == "__main__":
    # Run the imported module's main, so recipes and this code share one MoltConfig class.
    from molt.distributed.placement import main as imported_main

    sys.exit(imported_main())
