#!/usr/bin/env bash
# The trainer side on one GPU, with PyTorch and without vLLM (issue 27), in under 8 minutes: the
# trainer mesh over NCCL, FSDP2 bf16 + fp32 master + checkpointing + chunked log-probs on a ~1B
# random Qwen3 at 16K tokens (peak memory, tokens/s, MFU), fp32 log-probs under bf16 compute against
# float64, and `pytest -m gpu` with vLLM hidden. Each part reports PASS or FAIL and its figures as
# JSON lines, on stdout and in $OUT/results.jsonl (default ./gpu_check_out); one failing part does
# not stop the others. What each part does: the docstring of tools/gpu_check.py.
#
#   OUT=/some/dir bash tools/gpu_check.sh [--parts mesh,fsdp2_1b,logprobs_fp32,pytest_gpu]
#   bash tools/gpu_check.sh --cpu-smoke     # every part tiny, on CPU: checks the script (CI does)
#
# Needs no network and no vLLM; PYTHON (default python3) is an interpreter with PyTorch,
# transformers and Molt's other requirements.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" "$ROOT/tools/gpu_check.py" --out "${OUT:-gpu_check_out}" "$@"
