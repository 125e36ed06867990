"""Plot one metric of a run: its per-step value and a rolling mean, from metrics.jsonl; and, when
the run evaluated (eval.every_steps), the eval curve (eval/avg@k) beside it on the same axes.

    python tools/plot_metrics.py runs/x/metrics.jsonl [--out reward.png] [--key reward/mean] [--eval-key KEY]

Without --out the PNG goes beside the JSONL, named after the key (runs/x/reward_mean.png).
--eval-key: the eval metric to draw (default: the run's eval/avg@k, if any; 'none' draws none).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on cluster nodes
import matplotlib.pyplot as plt  # noqa: E402

ROLLING_WINDOW_STEPS = 10
EVAL_KEY_PREFIX = "eval/avg@"  # molt.controller.evaluation's mean reward over eval.n_samples samples a prompt


def read_metric(jsonl_path: str | Path, key: str) -> tuple[list[int], list[float]]:
    """Return (steps, values) for `key`, sorted by step; null and non-finite values (a step with no
    rollout to score logs reward/mean as null) are skipped. ValueError when none is left.

    A resumed run appends steps it already logged; the latest line for a step wins.
    """
    values_by_step: dict[int, float] = {}
    keys_seen: set[str] = set()
    for line in Path(jsonl_path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a run killed mid-write can leave a partial last line
        keys_seen.update(row)
        if key not in row:
            continue
        if isinstance(row[key], (int, float)) and math.isfinite(row[key]):
            values_by_step[row["step"]] = row[key]
        else:
            values_by_step.pop(row["step"], None)
    if not values_by_step:
        hint = (" (every step logged it as null or NaN; a step whose every rollout failed has no reward: see its "
                "rollout/failed_* counts)" if key in keys_seen else "")
        raise ValueError(f"no finite values of {key!r} in {jsonl_path}{hint}; keys present: "
                         f"{sorted(keys_seen - {'step'})}")
    steps = sorted(values_by_step)
    return steps, [values_by_step[step] for step in steps]


def compute_rolling_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and up to `window - 1` before it (shorter windows at the start)."""
    means = []
    for i in range(len(values)):
        recent = values[max(0, i - window + 1) : i + 1]
        means.append(sum(recent) / len(recent))
    return means


def find_eval_key(jsonl_path: str | Path) -> str | None:
    """The run's eval/avg@k key (the first one logged), or None when the run did not evaluate."""
    for line in Path(jsonl_path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        keys = sorted(k for k in row if k.startswith(EVAL_KEY_PREFIX))
        if keys:
            return keys[0]
    return None


def plot_metrics(jsonl_path: str | Path, out_path: str | Path, key: str = "reward/mean",
                 eval_key: str | None = "auto") -> str:
    """Write a PNG of `key` per step with its rolling mean, and the eval curve `eval_key` ('auto':
    the run's eval/avg@k, if it has one; None: none) at the steps it measured; return the PNG's path."""
    steps, values = read_metric(jsonl_path, key)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, values, alpha=0.35, label=key)
    ax.plot(steps, compute_rolling_mean(values, ROLLING_WINDOW_STEPS),
            label=f"rolling mean ({ROLLING_WINDOW_STEPS} steps)")
    if eval_key == "auto":
        eval_key = find_eval_key(jsonl_path)
    if eval_key:
        eval_steps, eval_values = read_metric(jsonl_path, eval_key)
        ax.plot(eval_steps, eval_values, marker="o", label=f"{eval_key} (eval set)")
    ax.set_title(Path(jsonl_path).resolve().parent.name)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return str(out_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jsonl_path", help="a run's metrics.jsonl")
    parser.add_argument("--key", default="reward/mean", help="metric to plot (default: reward/mean)")
    parser.add_argument("--out", help="PNG to write (default: beside the JSONL, named after the key)")
    parser.add_argument("--eval-key", default="auto",
                        help="eval metric drawn beside it (default: the run's eval/avg@k, if any; 'none': none)")
    args = parser.parse_args()
    out = args.out or Path(args.jsonl_path).with_name(args.key.replace("/", "_") + ".png")
    eval_key = None if args.eval_key == "none" else args.eval_key
    try:
        print(plot_metrics(args.jsonl_path, out, key=args.key, eval_key=eval_key))
    except (ValueError, OSError) as error:
        sys.exit(f"plot_metrics: {error}; no plot written")


if __name__ == "__main__":
    main()
