#!/usr/bin/env bash
# Assemble the torchrun command for a recipe: launch/run.sh configs/demo.py [--set a.b=v ...]
# The process count is the recipe's trainer + rollout ranks (single node). Multi-node: see docs/operations.md (Slurm).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup_env.sh"
cd "$ROOT"
CONFIG="${1:?usage: launch/run.sh configs/<recipe>.py[:function] [--set key=value ...]}"
shift
NPROC=$("$PYTHON" -c "
import sys
from molt.config import load_config
args = sys.argv[2:]
sets = [args[i + 1] for i, a in enumerate(args) if a == '--set']
print(load_config(sys.argv[1], sets).world_size)" "$CONFIG" "$@")
# On a small CPU box, keep the trainer's and the engine's OpenMP pools from fighting over cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
  -m molt.train --config "$CONFIG" "$@"
