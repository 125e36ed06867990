"""Checkpoint files (molt/trainer/checkpoint.py): a writer killed at any point of a checkpoint leaves the
previous complete one loadable, with the weights it was written with (RELIABILITY 16); a fresh run
refuses a directory holding another run's checkpoints, and rotation removes only the run's own."""

import json
import logging
import multiprocessing
import random
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from test_train_e2e import DEMO

from molt.distributed.parallelize import ShardingPlan, TrainerMesh
from molt.trainer.actor import Actor
from molt.trainer.sharded_model import build_actor_model
from molt.trainer.optimizer import OptimizerSettings
from molt import train
from molt.config import ConfigError
from molt.trainer.checkpoint import (check_fresh_start, checkpoint_run_id, complete_checkpoints, load_checkpoint, resolve_resume,
                                     save_checkpoint, step_dir)

CPU = torch.device("cpu")


def _actor(model_path: str) -> Actor:
    group = dist.group.WORLD
    model = build_actor_model(model_path, mesh=TrainerMesh.from_group(group, "cpu"), device=CPU, plan=ShardingPlan())
    return Actor(model, group=group, device=CPU, optimizer=OptimizerSettings(lr=1e-3))


def _checksum(actor: Actor) -> float:
    with torch.no_grad():
        return float(sum(p.full_tensor().double().sum() for p in actor.model.parameters()))


def _writer(model_path: str, root: str) -> None:
    """Checkpoints steps 1, 2, 3, ... with new weights each time, until killed; records each step's
    checksum before writing it."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank: no rendezvous
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
        writer = context.Process(target=_writer, args=(model_path, str(root)), daemon=True)
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


def _old_run(root: Path, steps: list[int], run_id: str = "old") -> None:
    """Complete checkpoints of another run: the markers are all that start-up and rotation read."""
    for step in steps:
        step_dir(root, step).mkdir(parents=True)
        (step_dir(root, step) / "COMPLETE").write_text(json.dumps({"step": step, "run_id": run_id}))


def _steps(root: Path) -> dict[int, str]:
    return {int(p.name.removeprefix("step_")): checkpoint_run_id(p) for p in complete_checkpoints(root)}


def test_a_fresh_start_refuses_a_directory_holding_checkpoints_and_names_the_ways_out(tmp_path):
    check_fresh_start(tmp_path / "missing", overwrite=False, rank=0)  # nothing there: fine
    _old_run(tmp_path, [4, 6])
    with pytest.raises(ConfigError) as error:
        check_fresh_start(tmp_path, overwrite=False, rank=0)
    message = str(error.value)
    assert f"checkpoint.dir={str(tmp_path)!r} holds 2 complete checkpoint(s)" in message
    assert "(steps 4, 6)" in message
    assert "checkpoint.resume=auto" in message and "checkpoint.overwrite=true" in message
    assert _steps(tmp_path) == {4: "old", 6: "old"}  # refusing deletes nothing


def test_overwrite_deletes_the_earlier_run_on_rank_0_only(tmp_path):
    _old_run(tmp_path, [4, 6])
    (tmp_path / ".step_00000008.partial").mkdir()  # left by the old run's killed writer
    (tmp_path / "step_00000008").mkdir()
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    check_fresh_start(tmp_path, overwrite=True, rank=1)
    assert _steps(tmp_path) == {4: "old", 6: "old"}
    check_fresh_start(tmp_path, overwrite=True, rank=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def _save_steps(rank, world_size, root, steps, run_id):
    for step in steps:
        save_checkpoint(root, step, trainables={}, group=dist.group.WORLD, rank=rank, state={"step": step},
                        keep_last=2, run_id=run_id)


def test_rotation_removes_only_this_runs_checkpoints_and_a_resumed_run_keeps_its_id(tmp_path):
    _old_run(tmp_path, [5, 6])
    run_ranks(_save_steps, 1, str(tmp_path), [1, 2, 3], "new", timeout_seconds=120)
    # Before run ids, keep_last=2 kept the highest steps, 5 and 6, and removed the new run's own.
    assert _steps(tmp_path) == {2: "new", 3: "new", 5: "old", 6: "old"}
    resumed_id = checkpoint_run_id(step_dir(tmp_path, 3))  # what Trainer keeps when it resumes from step 3
    run_ranks(_save_steps, 1, str(tmp_path), [4], resumed_id, timeout_seconds=120)
    assert _steps(tmp_path) == {3: "new", 4: "new", 5: "old", 6: "old"}


def test_train_refuses_a_fresh_start_into_an_old_runs_directory_before_starting_anything(
        tmp_path, tiny_model_dir, demo_data_dir, monkeypatch, caplog):
    out = tmp_path / "run"
    _old_run(out / "checkpoints", [2])
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(train, "run", lambda *args: pytest.fail("the job started"))
    molt_logger = logging.getLogger("molt")  # main() adds its console handler: removed after the test
    monkeypatch.setattr(molt_logger, "handlers", list(molt_logger.handlers))
    monkeypatch.setattr(molt_logger, "level", molt_logger.level)
    sets = {"model.path": tiny_model_dir, "data.train_path": Path(demo_data_dir) / "train.jsonl",
            "metrics.output_dir": out, "checkpoint.interval_steps": 1, "eval.every_steps": 0}
    argv = ["--config", DEMO] + [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    assert train.main(argv) == 2
    assert "holds 1 complete checkpoint(s) of an earlier run (steps 2)" in caplog.text
    assert _steps(out / "checkpoints") == {2: "old"}
