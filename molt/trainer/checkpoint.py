"""Whole-pipeline checkpoints (DESIGN section 9): kill the job at any moment, resume it, and no
prompt is lost or trained twice.

A checkpoint is a directory `step_<N>` holding
- `model/`: the actor's (and the critic's, when there is one) FSDP2 weights and AdamW states,
  written by every trainer rank through torch.distributed.checkpoint;
- `state.json` (rank 0): step and policy version, the adaptive KL coefficient, the controller's
  prompt stream (the loader's state, rows it handed out that no step dispatched, and the prompts of
  every group in flight, re-dispatched first on resume), its id counters and accounting totals,
  the W&B run id, and rank 0's Python RNG state;
- `rng_rank<R>.json`: each trainer rank's torch RNG state;
- `COMPLETE`: the marker, written last, with the step and the id of the run that wrote it.

It is written aside (`.step_<N>.partial`), renamed into place, and only then marked complete; a
checkpoint without the marker is never loaded, and older checkpoints are removed only after the
new one is complete, so a writer killed at any point leaves the previous checkpoint loadable.
The frozen reference model is not saved: it is rebuilt from model.path, as at the start.

Each run has an id, kept by a run that resumes it. A fresh start refuses a directory that holds
checkpoints (`check_fresh_start`), and rotation removes only the run's own, so a new run never
deletes its new checkpoints in favour of an old run's higher steps, nor leaves those for
`resume=auto` to load.

A stop request (SIGUSR1, as Slurm sends it ahead of a time limit with `--signal`) makes the
trainer write a checkpoint at the next step boundary and exit 0 (`StopRequest`).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import re
import shutil
import signal
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from molt.config import ConfigError

logger = logging.getLogger("molt")

COMPLETE = "COMPLETE"
STEP_PATTERN = re.compile(r"step_(\d{8})")
PARTIAL_PATTERN = re.compile(r"\.step_(\d{8})\.partial")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_PATTERN.fullmatch(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve_resume(resume: str, root: str | Path) -> Path | None:
    """The checkpoint to resume from: None for a fresh start ('' or 'auto' with none complete)."""
    if not resume:
        return None
    if resume == "auto":
        found = complete_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"checkpoint.resume={resume!r} is not a complete checkpoint (no {COMPLETE} marker)")
    return path


def new_run_id() -> str:
    return uuid.uuid4().hex


def checkpoint_run_id(path: Path) -> str:
    """The id of the run that wrote a complete checkpoint ('' for one written before runs had ids)."""
    return json.loads((path / COMPLETE).read_text()).get("run_id", "")


def check_fresh_start(root: str | Path, *, overwrite: bool, rank: int) -> None:
    """Before a fresh start that will write checkpoints: refuse a `root` holding checkpoints (an
    earlier run's), or with `overwrite` delete them (rank 0) with everything a killed writer left."""
    found = complete_checkpoints(root)
    if not found:
        return
    steps = [int(STEP_PATTERN.fullmatch(p.name)[1]) for p in found]
    shown = ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}, {steps[1]}, ..., {steps[-1]}"
    what = f"checkpoint.dir={str(root)!r} holds {len(found)} complete checkpoint(s) of an earlier run (steps {shown})"
    if not overwrite:
        raise ConfigError(f"{what}; a fresh start would write its own among them. Continue that run with "
                          f"--set checkpoint.resume=auto, or start fresh in a new directory (--set checkpoint.dir=...) "
                          f"or with --set checkpoint.overwrite=true, which deletes them first")
    if rank == 0:
        logger.warning("%s: checkpoint.overwrite=true, deleting them", what)
        for path in Path(root).iterdir():
            if STEP_PATTERN.fullmatch(path.name) or PARTIAL_PATTERN.fullmatch(path.name):
                shutil.rmtree(path)


class StopRequest:
    """SIGUSR1 sets a flag the trainer reads at each step boundary: it then writes a checkpoint and
    stops, so a job Slurm signals ahead of its end (`--signal=USR1@<seconds>`) can be requeued and
    resume. The handler only sets the flag; nothing stops mid-step. SIGTERM keeps its meaning, stop
    now: torchrun sends it to every rank when one fails (and SIGKILL 30 s later), and also to the
    rollout ranks, whose engines the last step would need."""

    def __init__(self):
        self.signal_name = ""

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, self._handle)

    def _handle(self, number: int, frame) -> None:
        self.signal_name = signal.Signals(number).name

    @property
    def requested(self) -> bool:
        return bool(self.signal_name)


STOP_REQUEST = StopRequest()  # one per process: signal handlers are process-wide


def read_wandb_run_id(path: Path | None) -> str | None:
    """The W&B run id a checkpoint was written under, so a resumed run logs into the same run."""
    if path is None:
        return None
    return json.loads((path / "state.json").read_text()).get("wandb_run_id")


def _models(trainables: dict) -> dict:
    """{name: (model, optimizer)} of what is saved: the actor, and the critic when present."""
    return {name: (t.model, t.optimizer) for name, t in trainables.items() if t is not None}


def _model_state(trainables: dict) -> dict:
    """{name: {"model": ..., "optimizer": ...}}: the sharded state dicts dcp writes and reads."""
    state = {}
    for name, (model, optimizer) in _models(trainables).items():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state[name] = {"model": model_sd, "optimizer": optim_sd}
    return state


def save_checkpoint(root: str | Path, step: int, *, trainables: dict, group: dist.ProcessGroup, rank: int,
                    state: dict | None, keep_last: int, run_id: str = "") -> Path:
    """Collective over the trainer ranks; `state` (rank 0's pipeline state) is None elsewhere.
    `run_id` (rank 0's) goes in the marker; rotation keeps the newest `keep_last` of this run's own."""
    final = step_dir(root, step)
    partial = final.with_name(f".{final.name}.partial")
    if rank == 0:
        Path(root).mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a writer killed earlier
        shutil.rmtree(final, ignore_errors=True)  # an incomplete one of this step (no marker)
    dist.barrier(group=group)
    dcp.save(_model_state(trainables), checkpoint_id=str(partial / "model"), process_group=group)
    _write_json(partial / f"rng_rank{rank}.json", {"torch": _encode(torch.get_rng_state()),
                                                   "cuda": [_encode(s) for s in torch.cuda.get_rng_state_all()]
                                                   if torch.cuda.is_available() else []})
    if rank == 0:
        _write_json(partial / "state.json", {**state, "python_random": random.getstate()})  # JSON: tuples as lists
    dist.barrier(group=group)
    if rank == 0:
        os.rename(partial, final)
        _write_json(final / COMPLETE, {"step": step, "run_id": run_id})
        _fsync_dir(final.parent)
        own = [path for path in complete_checkpoints(root) if checkpoint_run_id(path) == run_id]
        for old in own[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for stray in Path(root).iterdir():  # a step_<N> a killed writer renamed but never marked
            if STEP_PATTERN.fullmatch(stray.name) and stray.name < final.name and not (stray / COMPLETE).exists():
                shutil.rmtree(stray, ignore_errors=True)
        logger.info("checkpoint %s written", final)
    dist.barrier(group=group)
    return final


def load_checkpoint(path: Path, *, trainables: dict, group: dist.ProcessGroup, rank: int) -> dict:
    """Load weights, optimizer states and RNG states in place (collective); returns state.json."""
    model_state = _model_state(trainables)  # filled in place by dcp.load, then set into the models
    dcp.load(model_state, checkpoint_id=str(path / "model"), process_group=group)
    for name, (model, optimizer) in _models(trainables).items():
        set_state_dict(model, optimizer, model_state_dict=model_state[name]["model"],
                       optim_state_dict=model_state[name]["optimizer"])
    rng_file = path / f"rng_rank{rank}.json"
    if rng_file.is_file():
        rng = json.loads(rng_file.read_text())
        torch.set_rng_state(_decode(rng["torch"]))
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([_decode(s) for s in rng["cuda"]])
    state = json.loads((path / "state.json").read_text())
    version, internal, gauss = state.pop("python_random")
    random.setstate((version, tuple(internal), gauss))
    return state


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(data, file)
        file.flush()
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _encode(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
