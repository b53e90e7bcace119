#!/usr/bin/env bash
# gems's multi-rank matrix on one GPU (H100, H200 or any CUDA GPU), in about 5 minutes:
#   bash scripts/gpu_check.sh [--out DIR] [--budget S] [--only TEXT]   # writes DIR/summary.json and summary.md
#   bash scripts/gpu_check.sh --dry                                     # the plumbing on CPU (gloo, a few runs)
# Every rank shares the one GPU (the test aid GEMS_TEST_SHARE_GPU: each rank its own NCCL host, messages over
# loopback sockets, NCCL's real rules); each run is compared with the one-rank run of the same batch, TF32 off;
# torch.distributed.pipelining's 1F1B and GPipe run on the same rig as the control (gems/gpucheck.py).
#
# A GPU machine without gems's pure-Python dependencies (Hydra, omegaconf, submitit, colossus, mlperf-logging;
# setproctitle too, whose compiled part serves the same Python version only: without it a rank keeps the fork
# server's title in ps, and nothing else changes):
# on a machine that has them run  bash scripts/gpu_check.sh --prepare  (copies them into .gpu/site, which git
# ignores), carry .gpu with the project, and run the script there; it finds them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ "${1:-}" == "--prepare" ]]; then
    mkdir -p .gpu/site
    sp=$("$PY" -c 'import hydra, os; print(os.path.dirname(os.path.dirname(hydra.__file__)))')
    for p in hydra omegaconf antlr4 submitit mlperf_logging colossus setproctitle; do
        rm -rf ".gpu/site/$p"; cp -r "$sp/$p" .gpu/site/
    done
    find .gpu/site -name __pycache__ -type d -prune -exec rm -rf {} +
    du -sh .gpu/site
    exit 0
fi
# gems from this checkout, whether or not it is installed; the carried packages where there are any
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[[ -d .gpu/site ]] && export PYTHONPATH="$PYTHONPATH:$PWD/.gpu/site"
export GEMS_CACHE_DIR=${GEMS_CACHE_DIR:-/tmp/gems-gpu-check-cache}
exec "$PY" -m gems.gpucheck "$@"
