#!/usr/bin/env bash
# Sourced by the demo launchers: set up .venv and generate (once, into $MOLT_CACHE_DIR/demo) the
# tiny model, the addition data and the supervised warm start. Leaves $DEMO set.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup_env.sh"
cd "$ROOT"
DEMO="$MOLT_CACHE_DIR/demo"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # 2-core boxes: oversubscribed threads run 10x slower
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
# The MoE recipe (configs/demo.py:moe) starts from the tiny Qwen3-MoE, warm-started the same way;
# generated only when that recipe runs (about 10 s on 2 cores).
if [[ "${MOLT_DEMO_RECIPE:-}" == *:moe* ]]; then
  if [ ! -f "$DEMO/model-moe/config.json" ]; then
    "$PYTHON" tools/make_tiny_model.py "$DEMO/model-moe" --preset moe --seed 0
  fi
  if ! grep -qs "\"steps\": $WARM_STEPS," "$DEMO/model-moe-warm/warm_start.json" \
     || ! grep -qs '"load_balancing_loss": true' "$DEMO/model-moe-warm/warm_start.json"; then
    echo "[demo] supervised warm start of the MoE model ($WARM_STEPS steps)"
    "$PYTHON" tools/warm_start.py --model "$DEMO/model-moe" --data "$DEMO/data/train.jsonl" \
      --out "$DEMO/model-moe-warm" --steps "$WARM_STEPS"
  fi
fi
