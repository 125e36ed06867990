"""Metrics: one logger fans out to metrics.jsonl and W&B (DESIGN section 9); the console is molt.console."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("molt")

WANDB_MODES = ("disabled", "offline", "online")
WANDB_STEP_METRIC = "trainer/step"  # the x axis of every W&B chart


def configure_logging(rank: int) -> None:
    """Send the "molt" logger to stderr at INFO, each line tagged with the rank; safe to repeat."""
    molt_logger = logging.getLogger("molt")
    formatter = logging.Formatter(f"%(asctime)s [molt r{rank}] %(levelname)s %(message)s")
    handler = next((h for h in molt_logger.handlers if getattr(h, "molt_console", False)), None)
    if handler is None:
        handler = logging.StreamHandler()  # stderr
        handler.molt_console = True
        molt_logger.addHandler(handler)
    handler.setFormatter(formatter)
    molt_logger.setLevel(logging.INFO)


class MetricsLogger:
    """Writes each step's metrics to `output_dir/metrics.jsonl` and W&B (molt.console shows progress).

    Only rank 0 logs: elsewhere build it with `enabled=False` and every method does nothing.
    """

    def __init__(
        self,
        *,
        output_dir: str,
        run_name: str,
        config: dict,
        wandb_mode: str = "disabled",
        wandb_project: str = "molt",
        total_steps: int,
        enabled: bool = True,
        wandb_run_id: str | None = None,
    ) -> None:
        if wandb_mode not in WANDB_MODES:
            raise ValueError(f"wandb_mode={wandb_mode!r} is not one of {WANDB_MODES}; pick one of those")
        self.enabled = enabled
        self.total_steps = total_steps
        self.nonfinite_counts: dict[str, int] = {}  # metric key -> steps where it was NaN/inf
        self._file = None
        self._prompts_file = None
        self._wandb_run = None
        self._wandb_step = 0  # W&B's own step: one per log call, never the trainer step
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        # Append, so a resumed run continues the same file (repeated steps: the last one wins).
        self._file = open(out / "metrics.jsonl", "a", encoding="utf-8")
        self._prompts_file = open(out / "prompts.jsonl", "a", encoding="utf-8")
        if wandb_mode != "disabled":
            self._wandb_run = _start_wandb(out, run_name, wandb_project, wandb_mode, config, wandb_run_id)
            # W&B's own step counts log calls and must keep rising across jobs of one run: online, W&B
            # resumes it from the server; offline it restarts at 0, so count this run's earlier lines.
            self._wandb_step = max(self._wandb_run.step, _count_lines(out / "metrics.jsonl") if wandb_run_id else 0)

    @property
    def run_id(self) -> str | None:
        """The W&B run's id (None without W&B): checkpoints keep it, so a resume continues that run."""
        return self._wandb_run.id if self._wandb_run is not None else None

    def log_prompts(self, step: int, trained: list[int], dropped: list[int]) -> None:
        """Which prompts (by prompt-file index) a step trained on and which it dropped, to
        `output_dir/prompts.jsonl`: the record that a resumed run lost and repeated none."""
        if not self.enabled:
            return
        self._prompts_file.write(json.dumps({"step": step, "trained": trained, "dropped": dropped}) + "\n")
        self._prompts_file.flush()

    def log(self, step: int, metrics: dict[str, float],
            histograms: dict[str, tuple[list[float], list[float]]] | None = None) -> None:
        """Record one step; each JSONL line is flushed, so a killed run keeps every finished step.
        `histograms`: name -> (counts, bin edges, one more than counts), drawn by W&B only (the
        JSONL has their quantiles among `metrics`); empty ones are left out."""
        if not self.enabled:
            return
        values = {key: float(value) for key, value in metrics.items()}
        row: dict[str, float | None] = {"step": step}
        for key, value in values.items():
            finite = math.isfinite(value)
            if not finite:
                self._count_nonfinite(key, value, step)
            row[key] = value if finite else None  # JSON has no NaN/inf
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._wandb_run is not None:
            # The trainer step is a logged value, not W&B's own step: a resumed job re-logs the steps
            # after its checkpoint, and W&B drops any step below the last one it saw (see _start_wandb).
            charts = _wandb_histograms(histograms or {})
            self._wandb_run.log({**values, **charts, WANDB_STEP_METRIC: step}, step=self._wandb_step)
            self._wandb_step += 1

    def close(self) -> None:
        """Finish the W&B run and close the JSONL file; safe to call twice."""
        if self.nonfinite_counts:
            logger.warning("non-finite metric values (logged as null): %s", self.nonfinite_counts)
            self.nonfinite_counts = {}
        if self._wandb_run is not None:
            import wandb

            self._wandb_run.finish()
            # finish() returns before W&B's helper process has written the run files (offline runs
            # read straight back came out truncated); teardown waits for it.
            wandb.teardown()
            self._wandb_run = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._prompts_file is not None:
            self._prompts_file.close()
            self._prompts_file = None

    def _count_nonfinite(self, key: str, value: float, step: int) -> None:
        if key not in self.nonfinite_counts:
            logger.warning("metric %s is %s at step %d; logged as null (warned once per key)", key, value, step)
        self.nonfinite_counts[key] = self.nonfinite_counts.get(key, 0) + 1


def _wandb_histograms(histograms: dict[str, tuple[list[float], list[float]]]) -> dict:
    import wandb  # only reached with a W&B run, which imported it

    return {name: wandb.Histogram(np_histogram=(counts, edges)) for name, (counts, edges) in histograms.items()
            if any(counts)}


def _count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as lines:
        return sum(1 for _ in lines)


def _start_wandb(output_dir: Path, run_name: str, project: str, mode: str, config: dict, run_id: str | None):
    # Imported here: W&B is slow to import and starts a helper process, unneeded when disabled.
    import wandb

    started = time.perf_counter()
    run = wandb.init(
        project=project,
        name=run_name,
        config=config,
        mode=mode,
        dir=output_dir,  # run files go to output_dir/wandb, never the working directory
        id=run_id,  # a resumed run continues the checkpoint's W&B run
        resume="allow" if run_id else None,
        settings=wandb.Settings(silent=True),
    )
    # Every chart's x axis is the trainer step, logged as a value. W&B's own step only counts
    # log calls, so it keeps rising across a resume that repeats steps, and nothing is dropped.
    run.define_metric(WANDB_STEP_METRIC)
    run.define_metric("*", step_metric=WANDB_STEP_METRIC)
    run_dir = Path(run.dir).parent  # run.dir is its files/ subfolder
    logger.info("W&B %s run in %s (started in %.1fs)", mode, run_dir, time.perf_counter() - started)
    if mode == "offline":
        logger.info("upload it later with: wandb sync %s", run_dir)
    return run


def process_resources(role: str) -> dict[str, float]:
    """This process's resident memory and open file descriptors (Linux /proc), as
    `process/<role>_rss_bytes` and `process/<role>_open_fds`: a long run shows leaks as growth."""
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return {f"process/{role}_rss_bytes": float(resident_pages * os.sysconf("SC_PAGE_SIZE")),
            f"process/{role}_open_fds": float(len(os.listdir("/proc/self/fd")))}


class ProcessResourceSampler:
    """process_resources(role) for a hot path: read at most once per `interval_seconds`, the last
    reading returned in between (the rollout rank reports them with each of its outcomes)."""

    def __init__(self, role: str, interval_seconds: float = 1.0):
        self.role, self.interval_seconds = role, interval_seconds
        self.reading: dict[str, float] = {}
        self.read_at = -math.inf

    def read(self) -> dict[str, float]:
        now = time.monotonic()
        if now - self.read_at >= self.interval_seconds:
            self.reading, self.read_at = process_resources(self.role), now
        return self.reading


class StageTimer:
    """Accumulates wall-clock seconds per stage as `time/<stage>` until `pop`.

    GPU work is asynchronous: a stage measures its GPU time only if it ends in a host sync.
    """

    def __init__(self) -> None:
        self._seconds: defaultdict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[f"time/{name}"] += time.perf_counter() - started

    def pop(self) -> dict[str, float]:
        """Return the seconds accumulated since the last pop and start again from zero."""
        seconds = dict(self._seconds)
        self._seconds.clear()
        return seconds
