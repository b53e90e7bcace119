#!/usr/bin/env bash
# gems sweep +experiment=cosmoflow512_weak on a GPU cluster preset: ACCOUNT=proj jobs/cosmoflow512_weak.sh cluster=NAME [OVERRIDES]
# see conf/experiment/cosmoflow512_weak.yaml; render one job first with: gems render +experiment=cosmoflow512_weak cluster=NAME ...
set -euo pipefail
: "${ACCOUNT:?set ACCOUNT to your project/budget account}"
exec gems sweep +experiment=cosmoflow512_weak cluster.account="$ACCOUNT" "$@"
