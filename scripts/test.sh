#!/usr/bin/env bash
# The whole gems test suite, as the README and CI run it:  bash scripts/test.sh [PYTEST ARGS]
#
# From a fresh clone it sets up first: installs gems and its dependencies
# (scripts/setup.sh: torch 2.13.0 where none is installed, the mpich wheel) and starts
# the 4-node Slurm test cluster on this machine (scripts/slurm_cluster.sh start: apt
# packages, munge, slurmctld, 4 slurmd; needs root; idempotent). GEMS_TEST_SETUP=0 skips
# both, for quick reruns of a subset. Without arguments it first runs ruff and mypy
# (configured in pyproject.toml) over the code. An empty run (pytest exit status 5, "no tests
# collected") counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${GEMS_TEST_SETUP:-1}" != 0 ]]; then
    bash scripts/setup.sh || exit 1
    if [[ $(id -u) -eq 0 ]]; then
        scripts/slurm_cluster.sh start || exit 1
    else
        sudo scripts/slurm_cluster.sh start || exit 1
    fi
fi

# one thread per rank: the tests run many ranks on few cores
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
export PYTHONUNBUFFERED=1
# Open MPI refuses root without these; MPICH ignores them
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# pip's mpich installs mpiexec beside the interpreter
PY=${PYTHON:-python3}
PATH="$(dirname "$(command -v "$PY")"):$PATH"
export PATH

if command -v sinfo >/dev/null 2>&1 && ! timeout 20 sinfo -h >/dev/null 2>&1; then
    echo "test.sh: Slurm is installed but its controller does not answer; the slurm tests will fail." >&2
    echo "test.sh: start the test cluster with: sudo scripts/slurm_cluster.sh start" >&2
fi

began=$SECONDS  # the suite's own time, printed at its end (set-up not included)
typed=""  # the whole suite: ruff first, and mypy beside the tests (pyproject.toml configures both)
if [[ $# -eq 0 ]]; then
    echo "test.sh: ruff check gems tests; mypy (gems) beside the tests, its verdict after them"
    "$PY" -m ruff check gems tests || exit 1
    # mypy from nothing takes about 25 s on one core, with the other idle: beside the tests' first minute it
    # costs the suite about half that; its errors fail the run (printed after the tests)
    typed=$(mktemp -d)
    ( "$PY" -m mypy >"$typed/out" 2>&1; echo $? >"$typed/rc" ) &
    set -- tests   # arguments replace the default target, e.g. tests/test_render.py
fi
# two workers (GEMS_TEST_WORKERS; 0: one process): the suite waits on processes, sockets and Slurm for about
# 40% of its time on one, so a second overlaps those waits (about 1.3x here); every test that submits to the Slurm
# test cluster runs on one worker (tests/conftest.py)
WORKERS=${GEMS_TEST_WORKERS:-2}
if [[ "$WORKERS" != 0 ]] && "$PY" -c 'import xdist' 2>/dev/null; then
    set -- -n "$WORKERS" --dist loadgroup "$@"
fi
# the 25 slowest tests are listed at the end of every run: where the suite's time goes (CI's aim is under 30 minutes).
# No -x: under xdist the first failure stopped both workers, so a run showed one failure and hid the rest
"$PY" -m pytest -q --timeout=600 --durations=25 "$@"
rc=$?
if [[ -n "$typed" ]]; then
    wait
    if [[ "$(cat "$typed/rc" 2>/dev/null)" != 0 ]]; then
        cat "$typed/out" >&2
        echo "test.sh: mypy found errors (above)" >&2
        [[ $rc -eq 0 ]] && rc=1
    fi
    rm -rf "$typed"
fi
took=$((SECONDS - began))
printf 'test.sh: the suite took %d:%02d (exit status %d; the aim is under 30 minutes on 2 cores)\n' \
    $((took / 60)) $((took % 60)) "$rc"
if [[ $rc -eq 5 ]]; then
    echo "test.sh: pytest collected no tests: that is a failure" >&2
    exit 1
fi
exit $rc
