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
# Redone for data written before the eval set held each of the 100 sums once (no settings.json).
if [ ! -f "$DEMO/data/train.jsonl" ] || ! grep -qs "each of the 100 problems once" "$DEMO/data/settings.json"; then
  "$PYTHON" tools/make_demo_data.py "$DEMO/data" --seed 0
fi
# Warm starts written by the former tools/warm_start.py (a warm_start.json, no sft.json) are redone.
for old in model-warm model-moe-warm model-tool-warm; do
  if [ -f "$DEMO/$old/warm_start.json" ] && [ ! -f "$DEMO/$old/sft.json" ]; then rm -rf "${DEMO:?}/$old"; fi
done
# The supervised warm start (configs/demo.py:sft); molt.sft does nothing when the model there was
# trained with the same settings (recorded in its sft.json) and redoes it when they change.
"$PYTHON" -m molt.sft --config configs/demo.py:sft
# The MoE recipe (configs/demo.py:moe) starts from the tiny Qwen3-MoE, warm-started the same way;
# generated only when that recipe runs (about 10 s on 2 cores).
if [[ "${MOLT_DEMO_RECIPE:-}" == *:moe* ]]; then
  if [ ! -f "$DEMO/model-moe/config.json" ]; then
    "$PYTHON" tools/make_tiny_model.py "$DEMO/model-moe" --preset moe --seed 0
  fi
  "$PYTHON" -m molt.sft --config configs/demo.py:sft_moe
fi
# The vision recipe (configs/demo.py:vision): the tiny Idefics3, the sums drawn as images, and its
# two-part warm start (reading the digits, then unsure sums). A model from an older generator (no
# marker: its vision LayerNorms started random) and data from before the equation labels are redone;
# molt.sft then redoes the warm starts built on them (it records its base model's and data's files).
if [[ "${MOLT_DEMO_RECIPE:-}" == *:vision* ]]; then
  VLM_VERSION="vlm-2: vision LayerNorms at one"
  if [ ! -f "$DEMO/model-vlm/config.json" ] || ! grep -qsxF "$VLM_VERSION" "$DEMO/model-vlm/generator.txt"; then
    rm -rf "${DEMO:?}/model-vlm"
    "$PYTHON" tools/make_tiny_model.py "$DEMO/model-vlm" --preset vlm --seed 0
    echo "$VLM_VERSION" > "$DEMO/model-vlm/generator.txt"
  fi
  if ! grep -qs '"label": "equation"' "$DEMO/data-vision/settings.json"; then
    "$PYTHON" tools/make_vision_data.py "$DEMO/data-vision" --seed 0
  fi
  "$PYTHON" -m molt.sft --config configs/demo.py:sft_vision
  "$PYTHON" -m molt.sft --config configs/demo.py:sft_vision_unsure
fi
