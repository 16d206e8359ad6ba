#!/usr/bin/env bash
# Installs ds_pipemorph for development: torch first, then this package in editable mode with its extras.
#
#   bash scripts/setup.sh                                   # torch==2.13.0 from the default index
#   PIPEMORPH_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
#                                                           # torch's CPU build (no CUDA libraries)
#   PIPEMORPH_SKIP_TORCH=1 bash scripts/setup.sh            # keep the torch already installed (GPU machines)
#   PIPEMORPH_DRY_RUN=1 bash scripts/setup.sh               # print the commands, run nothing
#
# PYTHON names the interpreter (default: python). Bad settings stop the script with one sentence and exit 2.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
TORCH=torch==2.13.0
INDEX_URL=${PIPEMORPH_TORCH_INDEX_URL:-}
SKIP_TORCH=${PIPEMORPH_SKIP_TORCH:-0}
DRY_RUN=${PIPEMORPH_DRY_RUN:-0}

fail() { echo "setup.sh: $1" >&2; exit 2; }

for flag in PIPEMORPH_SKIP_TORCH PIPEMORPH_DRY_RUN; do
  case ${!flag:-0} in
    0|1) ;;
    *) fail "$flag must be 0 or 1, not '${!flag}'." ;;
  esac
done
case $INDEX_URL in
  ""|http://*|https://*|file://*) ;;
  *) fail "PIPEMORPH_TORCH_INDEX_URL must be an index URL (https://...), not '$INDEX_URL'." ;;
esac
if [[ $SKIP_TORCH == 1 && -n $INDEX_URL ]]; then
  fail "PIPEMORPH_SKIP_TORCH=1 installs no torch, so drop PIPEMORPH_TORCH_INDEX_URL or set PIPEMORPH_SKIP_TORCH=0."
fi

run() {  # one command: printed shell-quoted with PIPEMORPH_DRY_RUN=1, else run
  if [[ $DRY_RUN == 1 ]]; then
    printf '%q ' "$@" | sed 's/ $//'
    echo
  else
    "$@"
  fi
}

PIP=("$PYTHON" -m pip install -q --disable-pip-version-check)
if [[ $SKIP_TORCH == 0 ]]; then
  run "${PIP[@]}" ${INDEX_URL:+--index-url "$INDEX_URL"} "$TORCH"
fi
run "${PIP[@]}" -e ".[dev,milp,plot,interference]"
