#!/usr/bin/env bash
# Installs ds_pipemorph for development on a CPU machine: the pinned CPU torch wheel first (a bare
# `torch` requirement would pull a multi-GB CUDA build), then this package with its extras.
# GPU users: skip the first line and keep your own torch.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check -e ".[dev,milp,plot,interference]"
