#!/usr/bin/env bash
# Installs everything, then runs the whole test suite (CPU; real mpirun processes included).
# Usage: bash tools/run_tests.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec .venv/bin/python -m pytest -q -ra "$@"
