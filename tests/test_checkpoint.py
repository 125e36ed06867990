"""Checkpoint files (molt/checkpoint.py): a writer killed at any point of a checkpoint leaves the
previous complete one loadable, with the weights it was written with (RELIABILITY 16)."""

import json
import multiprocessing
import os
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist
from distributed import run_ranks

from molt.actor import Actor, build_actor_model
from molt.optimizer import OptimizerSettings
from molt.parallelize import ShardingPlan, TrainerMesh
from molt.checkpoint import complete_checkpoints, load_checkpoint, resolve_resume, save_checkpoint
from molt.refit import find_free_port

CPU = torch.device("cpu")


def _actor(model_path: str) -> Actor:
    group = dist.group.WORLD
    model = build_actor_model(model_path, mesh=TrainerMesh.from_group(group, "cpu"), device=CPU, plan=ShardingPlan())
    return Actor(model, group=group, device=CPU, optimizer=OptimizerSettings(lr=1e-3))


def _checksum(actor: Actor) -> float:
    with torch.no_grad():
        return float(sum(p.full_tensor().double().sum() for p in actor.model.parameters()))


def _writer(model_path: str, root: str, port: int) -> None:
    """Checkpoints steps 1, 2, 3, ... with new weights each time, until killed; records each step's
    checksum before writing it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    actor = _actor(model_path)
    Path(root).mkdir(parents=True, exist_ok=True)
    for step in range(1, 10_000):
        with torch.no_grad():
            for param in actor.model.parameters():
                param.to_local().add_(0.01)
        Path(root, f"expected_{step}.json").write_text(json.dumps(_checksum(actor)))
        save_checkpoint(root, step, trainables={"actor": actor}, group=dist.group.WORLD, rank=0,
                        state={"step": step}, keep_last=2)


def _load_newest(rank, world_size, model_path, root):
    path = resolve_resume("auto", root)
    actor = _actor(model_path)
    state = load_checkpoint(path, trainables={"actor": actor}, group=dist.group.WORLD, rank=rank)
    return {"path": str(path), "step": state["step"], "checksum": _checksum(actor)}


def test_a_writer_killed_at_random_points_leaves_the_previous_checkpoint_loadable(tmp_path, model_path):
    chance = random.Random(0)
    context = multiprocessing.get_context("spawn")
    for trial in range(3):
        root = tmp_path / f"trial{trial}"
        writer = context.Process(target=_writer, args=(model_path, str(root), find_free_port("127.0.0.1")), daemon=True)
        writer.start()
        deadline = time.monotonic() + 120
        while not (root / "step_00000001" / "COMPLETE").exists():
            assert writer.is_alive() and time.monotonic() < deadline, "the writer never completed step 1"
            time.sleep(0.01)
        time.sleep(chance.uniform(0.0, 0.6))  # somewhere in a later checkpoint: DCP files, rename, marker
        writer.kill()
        writer.join(10)
        complete = complete_checkpoints(root)
        # keep_last=2; a kill between the newest marker and the rotation (an fsync apart) leaves one
        # more, which the next save removes. Never none: rotation runs only after the marker.
        assert 1 <= len(complete) <= 3
        (loaded,) = run_ranks(_load_newest, 1, model_path, str(root), timeout_seconds=120)
        assert loaded["path"] == str(complete[-1])
        expected = json.loads((root / f"expected_{loaded['step']}.json").read_text())
        assert loaded["checksum"] == expected  # the weights it was written with, bit for bit
        assert loaded["path"].endswith(f"step_{loaded['step']:08d}")
