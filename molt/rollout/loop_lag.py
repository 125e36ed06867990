"""Event-loop health (RELIABILITY 12): how late a loop wakes a task that does nothing but sleep.

A rollout rank's loop runs the session endpoint and the engine's front end; an agent worker's
loop runs user agent code. Code that blocks without awaiting (time.sleep, a synchronous HTTP
client, a long CPU loop) stalls everything else on its loop. A LoopLagMonitor notices it: its
task sleeps `interval_seconds` again and again, and each wake-up later than planned is time the
loop spent elsewhere without yielding.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

logger = logging.getLogger("molt")

LAG_INTERVAL_SECONDS = 0.05
LAG_WARNING_SECONDS = 1.0


class LoopLagMonitor:
    """Keeps the largest lag since the last `take_max()`; warns when one wake-up is `warning_seconds`
    late (at most once every `warn_every_seconds`, so a loop that keeps blocking does not flood the log)."""

    def __init__(self, name: str, advice: str, *, interval_seconds: float = LAG_INTERVAL_SECONDS,
                 warning_seconds: float = LAG_WARNING_SECONDS, warn_every_seconds: float = 10.0):
        self.name = name  # whose loop, for the warning
        self.advice = advice  # what the warning tells the reader to do
        self.interval_seconds = interval_seconds
        self.warning_seconds = warning_seconds
        self.warn_every_seconds = warn_every_seconds
        self._max_lag = 0.0
        self._due: float | None = None  # when the sleeping task should wake next (time.monotonic)
        self._last_warning = -math.inf
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        while True:
            self._due = time.monotonic() + self.interval_seconds
            await asyncio.sleep(self.interval_seconds)
            self._record(time.monotonic() - self._due)

    def _record(self, lag: float) -> None:
        self._max_lag = max(self._max_lag, lag)
        now = time.monotonic()
        if lag >= self.warning_seconds and now - self._last_warning >= self.warn_every_seconds:
            self._last_warning = now
            logger.warning("%s: event loop blocked for %.2f s; %s", self.name, lag, self.advice)

    def take_max(self) -> float:
        """The largest lag since the previous call, in seconds. A wake-up overdue right now counts
        too: code that just stopped blocking may report before the sleeping task has run."""
        overdue = 0.0 if self._due is None else max(0.0, time.monotonic() - self._due)
        lag, self._max_lag = max(self._max_lag, overdue), 0.0
        return lag
