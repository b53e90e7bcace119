#!/usr/bin/env bash
# gems sweep +experiment=gems_schedules [OVERRIDES]: see conf/experiment/gems_schedules.yaml
set -euo pipefail
exec gems sweep +experiment=gems_schedules "$@"
