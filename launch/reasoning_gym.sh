#!/usr/bin/env bash
# reasoning-gym's basic_arithmetic on the tiny model: set up, generate (once, into
# $MOLT_CACHE_DIR/reasoning_gym) the model, the task's train/eval rows and a short supervised warm
# start, then train configs/reasoning_gym.py with GRPO in one torchrun job and plot the reward.
# Extra arguments go to molt.train (e.g. --set train.num_steps=50).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup_env.sh"
cd "$ROOT"
CACHE="$MOLT_CACHE_DIR/reasoning_gym"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # 2-core boxes: oversubscribed threads run 10x slower
mkdir -p "$CACHE"

if [ ! -f "$CACHE/model/config.json" ]; then
  "$PYTHON" tools/make_tiny_model.py "$CACHE/model" --preset tiny --seed 0
fi
# basic_arithmetic with two one-digit terms, + and - (negatives and parentheses as the package draws them).
if [ ! -f "$CACHE/data/train.jsonl" ]; then
  "$PYTHON" tools/make_reasoning_gym_data.py "$CACHE/data" --dataset basic_arithmetic --seed 0 \
    --num-train 4096 --num-eval 256 \
    --param min_terms=2 --param max_terms=2 --param min_digits=1 --param max_digits=1 --param "operators=('+', '-')"
fi
# The supervised warm start (configs/reasoning_gym.py:sft); molt.sft does nothing when the model
# there was trained with the same settings (recorded in its sft.json) and redoes it when they change.
"$PYTHON" -m molt.sft --config configs/reasoning_gym.py:sft

RECIPE="${MOLT_RECIPE:-configs/reasoning_gym.py}"
OUT="${MOLT_OUTPUT_DIR:-runs/reasoning-gym}"
echo "[reasoning-gym] training $RECIPE; metrics -> $OUT/metrics.jsonl"
started=$(date +%s)
bash launch/run.sh "$RECIPE" --set metrics.output_dir="$OUT" "$@"
"$PYTHON" tools/plot_metrics.py "$OUT/metrics.jsonl" --out "$OUT/reward.png"
"$PYTHON" tools/run_summary.py reasoning-gym "$OUT/metrics.jsonl" "$started"
echo "[reasoning-gym] metrics: $OUT/metrics.jsonl  plot: $OUT/reward.png"
