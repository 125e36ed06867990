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
if [ ! -f "$DEMO/data/tool_chats.jsonl" ]; then
  "$PYTHON" tools/make_tool_chats.py "$DEMO/data/train.jsonl" "$DEMO/data/tool_chats.jsonl" --seed 0
fi
# The warm start with the calculator tool in the prompt (configs/demo.py:sft_tool; skipped when up to date).
"$PYTHON" -m molt.sft --config configs/demo.py:sft_tool
MOLT_DEMO_RECIPE="$RECIPE" MOLT_OUTPUT_DIR="${MOLT_OUTPUT_DIR:-runs/demo-tool-$SDK}" exec bash launch/demo.sh "$@"
