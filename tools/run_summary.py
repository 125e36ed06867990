"""Print what a run's metrics.jsonl says in a few lines: the steps, the wall time since `started`,
reward/mean over the first and last 10 steps (and, when group filtering dropped groups, the reward
of every rollout scored, reward/scored_mean), and the held-out curve (eval/avg@k by step) when the
run evaluated. The demo launchers call it after training.

    python tools/run_summary.py LABEL METRICS_JSONL STARTED_EPOCH_SECONDS
"""

from __future__ import annotations

import json
import sys
import time
from statistics import fmean


def step_values(rows: list[dict], key: str) -> list[float]:
    """`key` of every training step (step >= 1) that logged it, in order."""
    return [r[key] for r in rows if r.get("step", 0) >= 1 and r.get(key) is not None]


def rise(values: list[float]) -> str:
    """The mean of the first 10 values against the last 10's."""
    first, last = fmean(values[:10]), fmean(values[-10:])
    return f"first 10 steps {first:.3f} -> last 10 steps {last:.3f} (rise {last - first:+.3f})"


def summarize(label: str, rows: list[dict], seconds: float) -> list[str]:
    rewards = step_values(rows, "reward/mean")
    if not rewards:
        raise SystemExit(f"[{label}] no step had a reward (every rollout failed?): see rollout/failed_* in metrics.jsonl")
    lines = [f"[{label}] {len(rewards)} steps in {seconds:.0f}s (after set-up); reward/mean {rise(rewards)}"]
    scored = step_values(rows, "reward/scored_mean")
    if scored and any(key.startswith("rollout/filtered_") for r in rows for key in r):
        # Group filtering trains on the groups with signal only; this is what the policy earned.
        lines.append(f"[{label}] reward of every rollout (filtered groups too) {rise(scored)}")
    evals = [(r["eval/step"], key, r[key]) for r in rows if "eval/step" in r for key in r if key.startswith("eval/avg@")]
    if evals:  # every point, so the curve reads in the terminal
        lines.append(f"[{label}] held-out {evals[0][1]} by step: "
                     + ", ".join(f"{step:.0f}: {value:.3f}" for step, _, value in evals))
    return lines


def main() -> None:
    label, path, started = sys.argv[1], sys.argv[2], float(sys.argv[3])
    rows = [json.loads(line) for line in open(path) if line.strip()]
    print("\n".join(summarize(label, rows, time.time() - started)))


if __name__ == "__main__":
    main()
