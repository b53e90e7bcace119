#!/usr/bin/env bash
# gems sweep +experiment=spatial_strong [OVERRIDES]: see conf/experiment/spatial_strong.yaml
set -euo pipefail
exec gems sweep +experiment=spatial_strong "$@"
