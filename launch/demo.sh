#!/usr/bin/env bash
# The CPU demo: set up, generate a tiny model, data and a short supervised warm start (once, into
# $MOLT_CACHE_DIR), then train with GRPO in one torchrun job and plot the reward.
# Extra arguments go to molt.train (e.g. --set train.num_steps=50).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup_env.sh"
cd "$ROOT"
DEMO="$MOLT_CACHE_DIR/demo"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # 2-core boxes: oversubscribed threads run 10x slower
OUT="${MOLT_OUTPUT_DIR:-runs/demo}"
mkdir -p "$DEMO"

if [ ! -f "$DEMO/model/config.json" ]; then
  "$PYTHON" tools/make_tiny_model.py "$DEMO/model" --preset tiny --seed 0
fi
if [ ! -f "$DEMO/data/train.jsonl" ]; then
  "$PYTHON" tools/make_demo_data.py "$DEMO/data" --seed 0
fi
# Redone when its settings change (they are recorded in warm_start.json).
WARM_STEPS=160
if ! grep -qs "\"steps\": $WARM_STEPS," "$DEMO/model-warm/warm_start.json"; then
  echo "[demo] supervised warm start ($WARM_STEPS steps)"
  "$PYTHON" tools/warm_start.py --model "$DEMO/model" --data "$DEMO/data/train.jsonl" --out "$DEMO/model-warm" \
    --steps "$WARM_STEPS"
fi

echo "[demo] training; metrics -> $OUT/metrics.jsonl"
started=$(date +%s)
bash launch/run.sh configs/demo.py --set metrics.output_dir="$OUT" "$@"
"$PYTHON" tools/plot_metrics.py "$OUT/metrics.jsonl" --out "$OUT/reward.png"
"$PYTHON" - "$OUT/metrics.jsonl" "$started" <<'PY'
import json, sys, time
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
rewards = [r["reward/mean"] for r in rows if r.get("step", 0) >= 1 and r.get("reward/mean") is not None]
first, last = rewards[:10], rewards[-10:]
mean = lambda xs: sum(xs) / len(xs)
print(f"[demo] {len(rewards)} steps in {time.time() - float(sys.argv[2]):.0f}s (after set-up); "
      f"reward/mean first 10 steps {mean(first):.3f} -> last 10 steps {mean(last):.3f} "
      f"(rise {mean(last) - mean(first):+.3f})")
PY
echo "[demo] metrics: $OUT/metrics.jsonl  plot: $OUT/reward.png"
