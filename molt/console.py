"""What a person watching a run sees: the training steps' progress, heartbeats while a wait drags
on, and the progress of long tool runs.

On a terminal, progress is a tqdm bar redrawn in place (the `molt` logger's lines go above it). In
a log file (a Slurm output file, a pipe) a bar's carriage returns would pile up into one huge
line, so progress is a log line per step (or per `interval_seconds` for tools) instead.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

logger = logging.getLogger("molt")

HEARTBEAT_SECONDS = 30.0  # longest a wait goes without saying what it waits for

# Metrics shown with each step: key -> (label, format). Absent keys are skipped.
PROGRESS_FIELDS = {
    "reward/mean": ("reward", "{:.3f}"),
    "throughput/tokens_per_second": ("tokens/s", "{:.0f}"),
    "staleness/mean": ("staleness", "{:.2f}"),
    "time/step_seconds": ("step", "{:.2f}s"),
}


def is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def format_seconds(seconds: float) -> str:
    """`75` -> '01:15', `3725` -> '1:02:05' (tqdm's form, so the bar and the log lines agree)."""
    return tqdm.format_interval(max(0.0, seconds))


def format_metrics(metrics: dict[str, float]) -> str:
    """The PROGRESS_FIELDS present in `metrics`, e.g. 'reward 0.500 | tokens/s 1234 | step 1.23s'."""
    return " | ".join(f"{label} {fmt.format(metrics[key])}" for key, (label, fmt) in PROGRESS_FIELDS.items()
                      if key in metrics)


class StepProgress:
    """Rank 0's view of the training steps: a bar with reward, tokens/s, staleness and tqdm's ETA
    on a terminal; elsewhere one log line per step with the same figures and an ETA from the mean
    step time of this run. Disabled (ranks other than 0) it does nothing."""

    def __init__(self, *, total_steps: int, enabled: bool = True, stream: TextIO | None = None):
        self.total_steps = total_steps
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.bar: tqdm | None = None
        self.redirect = contextlib.ExitStack()
        self.first_step = 1
        self.started = 0.0

    def start(self, first_step: int) -> None:
        """Start the clock at the first step this run trains (a resumed run starts past 1)."""
        if not self.enabled:
            return
        self.first_step, self.started = first_step, time.monotonic()
        if is_terminal(self.stream):
            self.bar = tqdm(total=self.total_steps, initial=first_step - 1, desc="train", unit="step",
                            file=self.stream, dynamic_ncols=True)
            # Log lines go above the bar instead of through it, while it lasts.
            self.redirect.enter_context(logging_redirect_tqdm([logger], tqdm_class=tqdm))

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(format_metrics({k: v for k, v in metrics.items() if k != "time/step_seconds"}),
                                     refresh=False)
            self.bar.update(step - self.bar.n)
            return
        logger.info("%s", self.describe(step, metrics))

    def describe(self, step: int, metrics: dict[str, float]) -> str:
        """The log line of one step: 'step 3/400 | reward 0.184 | ... | ETA 05:47'."""
        parts = [f"step {step}/{self.total_steps}", format_metrics(metrics)]
        done, left = step - self.first_step + 1, self.total_steps - step
        if done > 0 and left > 0:
            parts.append(f"ETA {format_seconds((time.monotonic() - self.started) / done * left)}")
        return " | ".join(part for part in parts if part)

    def close(self) -> None:
        """Take the bar down (it stays on screen at its last state); safe to call twice."""
        self.redirect.close()
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Heartbeat:
    """Says what a long wait waits for, at most once per `interval_seconds`: `due_at` is when the
    waiting code should next wake up to call `beat`."""

    def __init__(self, interval_seconds: float = HEARTBEAT_SECONDS):
        self.interval_seconds = interval_seconds
        self.started = time.monotonic()
        self.due_at = self.started + interval_seconds

    def beat(self, message: str) -> None:
        logger.info("%s (waiting %.0f s)", message, time.monotonic() - self.started)
        self.due_at = time.monotonic() + self.interval_seconds


class ToolProgress:
    """Progress of a tool's loop (a warm start, a benchmark): a tqdm bar on a terminal; elsewhere a
    line on `stream` at most every `interval_seconds`, and one at the end."""

    def __init__(self, total: int, *, desc: str, stream: TextIO | None = None, interval_seconds: float = 10.0):
        self.total, self.desc = total, desc
        self.stream = stream or sys.stderr
        self.interval_seconds = interval_seconds
        self.bar = tqdm(total=total, desc=desc, file=self.stream, dynamic_ncols=True) if is_terminal(self.stream) else None
        self.count = 0
        self.started = time.monotonic()
        self.last_line = -math.inf

    def update(self, count: int = 1, **figures: float) -> None:
        """`count` more done; `figures` (e.g. loss=0.52) are shown beside the count."""
        self.count += count
        text = " ".join(f"{name} {value:.4g}" for name, value in figures.items())
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(count)
            return
        now = time.monotonic()
        if now - self.last_line >= self.interval_seconds or self.count >= self.total:
            self.last_line = now
            elapsed = now - self.started
            eta = elapsed / self.count * (self.total - self.count)
            parts = [f"{self.desc}: {self.count}/{self.total}", text,
                     f"[{format_seconds(elapsed)} elapsed, ETA {format_seconds(eta)}]"]
            self.stream.write(" ".join(part for part in parts if part) + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
