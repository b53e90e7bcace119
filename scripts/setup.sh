#!/usr/bin/env bash
# Install gems and what it needs into the current Python environment.
#   bash scripts/setup.sh            # gems + test tools + the mpich wheel (MPI for mpi4py)
# torch: a GPU node brings its own build; where none is installed this takes 2.13.0
# first, so that no requirement pulls the newest CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
extras="test"
if ! command -v mpiexec >/dev/null 2>&1 || [ -x "$("$PY" -c 'import sys,os;print(os.path.join(os.path.dirname(sys.executable),"mpiexec"))')" ]; then
  extras="test,mpich"   # no system MPI: use the mpich wheel
fi
"$PY" -m pip install -q -e ".[${extras}]"
"$PY" -c "import gems, torch, mpi4py, h5py, hydra, submitit; print('gems installed; torch', torch.__version__)"
# pyenv puts new console scripts on PATH only after a rehash
if command -v pyenv >/dev/null 2>&1; then pyenv rehash 2>/dev/null || true; fi
command -v gems >/dev/null 2>&1 || echo "note: add $("$PY" -c 'import sysconfig;print(sysconfig.get_path("scripts"))') to PATH for the gems command"
