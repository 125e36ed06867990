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
"$PYTHON" tools/run_summary.py demo "$OUT/metrics.jsonl" "$started"
echo "[demo] metrics: $OUT/metrics.jsonl  plot: $OUT/reward.png"
