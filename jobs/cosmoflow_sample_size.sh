#!/usr/bin/env bash
# The sample-size study (conf/experiment/cosmoflow_sample_size.yaml): write the universes, then train CosmoFlow on
# crops of 32^3, 64^3 and 128^3 of them and tabulate the validation error against the crop's edge, beside a
# power-spectrum ridge regression's (gems data baseline) on crops of every edge.
#   jobs/cosmoflow_sample_size.sh                        # here (about 51 minutes on 2 cores, the writing included)
#   jobs/cosmoflow_sample_size.sh cluster=local_slurm cluster.time_min=90
#       # the universes and each point a job on the Slurm test cluster (its 2-core nodes share this
#       # machine's 2 cores and the points run at once: the preset's 10-minute limit is for tests)
#   DATA=/scratch/me/cosmo jobs/cosmoflow_sample_size.sh # where the universes go (default data/cosmology)
#   UNIVERSES=8 VAL_UNIVERSES=4 BOX_CELLS=64 ...          # fewer and smaller universes (default 256, 32 and 128^3
#                                                         # cells of 8 Mpc/h each): a taste of the study
# Extra arguments go to the sweep (a cluster, --detach, ...). The universes are written once: running the script
# again skips them, and skips the points already done.
set -euo pipefail
DATA=$(realpath -m "${DATA:-data/cosmology}")
UNIVERSES=${UNIVERSES:-256}
VAL_UNIVERSES=${VAL_UNIVERSES:-32}
BOX_CELLS=${BOX_CELLS:-128}  # cells a side, each 8 Mpc/h (1024 Mpc/h at 128: docs/science.md says why)
# the sweep's cluster (cluster=..., cluster.*=...) writes the universes too, as one Slurm job over its tasks
WHERE=(results.sweep=cosmoflow_sample_size) ON=()
for a in "$@"; do b=${a#+}; b=${b#+}; case $b in
    results.dir=*) WHERE+=("$b");; results.sweep=*) WHERE[0]=$b;; cluster=*|cluster.*) ON+=("$a");; esac; done
gems data synth data.kind=cosmology data.path="$DATA/train" data.val_path="$DATA/val" \
    data.universes="$UNIVERSES" data.val_universes="$VAL_UNIVERSES" data.box_cells="$BOX_CELLS" \
    data.box_mpc=$((8 * BOX_CELLS)) ${ON[@]+"${ON[@]}"}
# the power-spectrum reference (gems/data/spectrum.py), into the study's folder: gems results puts it beside the runs
gems data baseline data.path="$DATA/train" data.val_path="$DATA/val" "${WHERE[@]}"
gems sweep +experiment=cosmoflow_sample_size data.path="$DATA/train" data.val_path="$DATA/val" \
    data.box_cells="$BOX_CELLS" "$@"
