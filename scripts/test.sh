#!/usr/bin/env bash
# The whole gems test suite, as the README and CI run it: scripts/test.sh [PYTEST ARGS]
#
# Tests marked `slurm` need the local test cluster (scripts/slurm_cluster.sh start, as
# root); they are skipped only where Slurm is not installed at all. An empty run (pytest
# exit status 5, "no tests collected") counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."

# one thread per rank: the tests run many ranks on few cores
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
export PYTHONUNBUFFERED=1
# Open MPI refuses root without these; MPICH ignores them
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# pip's mpich installs mpiexec beside the interpreter
PY=${PYTHON:-python}
PATH="$(dirname "$(command -v "$PY")"):$PATH"
export PATH

if command -v sinfo >/dev/null 2>&1 && ! timeout 20 sinfo -h >/dev/null 2>&1; then
    echo "test.sh: Slurm is installed but its controller does not answer; the slurm tests will fail." >&2
    echo "test.sh: start the test cluster with: sudo scripts/slurm_cluster.sh start" >&2
fi

[[ $# -eq 0 ]] && set -- tests   # arguments replace the default target, e.g. tests/test_render.py
"$PY" -m pytest -q -x --timeout=600 "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
    echo "test.sh: pytest collected no tests: that is a failure" >&2
    exit 1
fi
exit $rc
