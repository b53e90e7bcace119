#!/usr/bin/env bash
# gems sweep +experiment=replication_weak [OVERRIDES]: see conf/experiment/replication_weak.yaml
set -euo pipefail
exec gems sweep +experiment=replication_weak "$@"
