#!/usr/bin/env bash
# gems sweep +experiment=spatial_weak [OVERRIDES]: see conf/experiment/spatial_weak.yaml
set -euo pipefail
exec gems sweep +experiment=spatial_weak "$@"
