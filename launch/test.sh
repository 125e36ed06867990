#!/usr/bin/env bash
# Set up (idempotently) and run the whole test suite (--fast: the unit tier). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup_env.sh"
cd "$ROOT"
set +e
# --fast (or --unit): the unit tier, without the tests that start vLLM engines or torchrun jobs
# (marked e2e; soak tests are e2e too). Markers and time limits: pytest.ini. Two pytest-xdist
# workers, each taking a file (or a group of files sharing a session job) at a time
# (tests/worker_groups.py); a later -n N overrides it, -n 0 runs in one process.
MARKERS="not gpu"
if [ "${1:-}" = "--fast" ] || [ "${1:-}" = "--unit" ]; then
  MARKERS="not gpu and not e2e"
  shift
fi
"$PYTHON" -m pytest tests -m "$MARKERS" -n 2 "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "error: pytest collected no tests; that is a failure, not a pass" >&2
  exit 1
fi
exit "$status"
