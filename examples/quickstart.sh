#!/usr/bin/env bash
# Set up AstraFlow in .venv and run the main example (math, embedded default: local Dask
# workers, CPU model built locally, no Slurm, no downloads). Extra arguments go to
# `astraflow run`, e.g. --set run.max_steps=20 or --run-dir runs/mine.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3.11 -m venv .venv
fi
# installed once, and again when pyproject.toml changes (a stamp beside the venv)
if [ ! -f .venv/.astraflow-installed ] || [ pyproject.toml -nt .venv/.astraflow-installed ]; then
  .venv/bin/pip install -q -e .
  touch .venv/.astraflow-installed
fi
exec .venv/bin/astraflow run examples/math/config.yaml "$@"
