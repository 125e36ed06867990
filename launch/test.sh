#!/usr/bin/env bash
# Set up (idempotently) and run the whole test suite (--fast: the unit tier). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup_env.sh"
cd "$ROOT"
set +e
# --fast (or --unit): the unit tier, without the tests that start vLLM engines or torchrun jobs
# (marked e2e; soak tests are e2e too), on two pytest-xdist workers. Markers and time limits: pytest.ini.
MARKERS="not gpu"
WORKERS=()
if [ "${1:-}" = "--fast" ] || [ "${1:-}" = "--unit" ]; then
  MARKERS="not gpu and not e2e"
  WORKERS=(-n 2)
  shift
fi
"$PYTHON" -m pytest tests -m "$MARKERS" ${WORKERS[@]+"${WORKERS[@]}"} "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "error: pytest collected no tests; that is a failure, not a pass" >&2
  exit 1
fi
exit "$status"
