#!/usr/bin/env bash
# gems sweep +experiment=gems_resnet1001 on a GPU cluster preset: ACCOUNT=proj jobs/gems_resnet1001.sh cluster=NAME [OVERRIDES]
# see conf/experiment/gems_resnet1001.yaml; render one job first with: gems render +experiment=gems_resnet1001 cluster=NAME ...
set -euo pipefail
: "${ACCOUNT:?set ACCOUNT to your project/budget account}"
exec gems sweep +experiment=gems_resnet1001 cluster.account="$ACCOUNT" "$@"
