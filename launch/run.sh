#!/usr/bin/env bash
# Assemble the torchrun command for a recipe: launch/run.sh configs/demo.py [--set a.b=v ...]
# The process count is the recipe's trainer + rollout ranks (single node). Multi-node: see docs/operations.md (Slurm).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup_env.sh"
cd "$ROOT"
CONFIG="${1:?usage: launch/run.sh configs/<recipe>.py[:function] [--set key=value ...]}"
shift
# The process count, and OpenMP threads per process: 1 on CPU, where the engines and the trainer share
# the cores; on GPU the cores shared out (molt.distributed.devices.omp_num_threads). A value you export is kept.
SETTINGS=$("$PYTHON" -c "
import os, sys
from molt.config import load_config
from molt.distributed.devices import omp_num_threads, trainer_device_type
args = sys.argv[2:]
sets = [args[i + 1] for i, a in enumerate(args) if a == '--set']
cfg = load_config(sys.argv[1], sets)
print(cfg.world_size, omp_num_threads(trainer_device_type(cfg.device), len(os.sched_getaffinity(0)), cfg.world_size))" \
  "$CONFIG" "$@")
read -r NPROC THREADS <<<"$SETTINGS"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$THREADS}"
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
  -m molt.train --config "$CONFIG" "$@"
