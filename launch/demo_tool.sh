#!/usr/bin/env bash
# The ChatAgent demo: an agent that may call a calculator tool, through the OpenAI SDK (default)
# or the Anthropic SDK: bash launch/demo_tool.sh [openai|anthropic] [--set ...]
set -euo pipefail
SDK="${1:-openai}"
case "$SDK" in
  openai) RECIPE="configs/demo.py:tool_agent" ;;
  anthropic) RECIPE="configs/demo.py:tool_agent_anthropic" ;;
  *) echo "usage: launch/demo_tool.sh [openai|anthropic] [--set key=value ...]" >&2; exit 2 ;;
esac
[ $# -gt 0 ] && shift
source "$(dirname "${BASH_SOURCE[0]}")/prepare_demo.sh"
TOOL_WARM_STEPS=200
if ! grep -qs "\"steps\": $TOOL_WARM_STEPS," "$DEMO/model-tool-warm/warm_start.json"; then
  echo "[demo] supervised warm start with the calculator tool ($TOOL_WARM_STEPS steps)"
  "$PYTHON" tools/warm_start.py --model "$DEMO/model-warm" --data "$DEMO/data/train.jsonl" \
    --out "$DEMO/model-tool-warm" --task tool --steps "$TOOL_WARM_STEPS" --learning-rate 3e-3
fi
MOLT_DEMO_RECIPE="$RECIPE" MOLT_OUTPUT_DIR="${MOLT_OUTPUT_DIR:-runs/demo-tool-$SDK}" exec bash launch/demo.sh "$@"
