#!/usr/bin/env bash
# The CPU demo: set up, generate a tiny model, data and a short supervised warm start (once, into
# $MOLT_CACHE_DIR), then train with GRPO in one torchrun job and plot the reward.
# Extra arguments go to molt.train (e.g. --set train.num_steps=50).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/prepare_demo.sh"
RECIPE="${MOLT_DEMO_RECIPE:-configs/demo.py}"
VARIANT="${RECIPE##*.py}"  # ':moe' for configs/demo.py:moe: its own run directory, runs/demo-moe
OUT="${MOLT_OUTPUT_DIR:-runs/demo${VARIANT:+-${VARIANT#:}}}"

echo "[demo] training $RECIPE; metrics -> $OUT/metrics.jsonl"
started=$(date +%s)
bash launch/run.sh "$RECIPE" --set metrics.output_dir="$OUT" "$@"
"$PYTHON" tools/plot_metrics.py "$OUT/metrics.jsonl" --out "$OUT/reward.png"
"$PYTHON" - "$OUT/metrics.jsonl" "$started" <<'PY'
import json, sys, time
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
rewards = [r["reward/mean"] for r in rows if r.get("step", 0) >= 1 and r.get("reward/mean") is not None]
if not rewards:
    sys.exit("[demo] no step had a reward (every rollout failed?): see rollout/failed_* in " + sys.argv[1])
first, last = rewards[:10], rewards[-10:]
mean = lambda xs: sum(xs) / len(xs)
print(f"[demo] {len(rewards)} steps in {time.time() - float(sys.argv[2]):.0f}s (after set-up); "
      f"reward/mean first 10 steps {mean(first):.3f} -> last 10 steps {mean(last):.3f} "
      f"(rise {mean(last) - mean(first):+.3f})")
evals = [(r["eval/step"], key, r[key]) for r in rows for key in r if key.startswith("eval/avg@") and "eval/step" in r]
if evals:  # the held-out curve (eval.every_steps): every point, so the curve reads in the terminal
    print(f"[demo] held-out {evals[0][1]} by step: " + ", ".join(f"{step:.0f}: {value:.3f}" for step, _, value in evals))
PY
echo "[demo] metrics: $OUT/metrics.jsonl  plot: $OUT/reward.png"
