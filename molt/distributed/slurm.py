"""Slurm's environment mapped to torchrun's, and the host name other nodes reach this one by."""

from __future__ import annotations

import re
import socket


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
