#!/bin/bash
# Atrex-Bench's eval and profile jobs through `krex gateway` on the accelerator
# (bench.gateway_profile_check: each job kind's result checked), one device call (~5 min for all):
#   bash bench/gpu/atrex_gateway.sh [ARG...]   ARGs go to the check, e.g. `--only profile-deep`,
#                                               `--only eval-broken eval-lock-clocks`, `--deep`
# Was the atrex steps of run_s9.sh to run_s16.sh. Needs .suites/atrex-bench (carried).
# Results: $OUT/atrex-gateway.tgz, atrex-gateway.log, gateway_profile_check.json.
# Environment (all optional): ATREX_TIMEOUT (the step's limit, 300 s), ATREX_ARGS (added after the
# arguments), TAG, TAIL, BATCH_DRY=1 (print the commands only).
set -u
cd "$(dirname "$0")/../.." || exit 1
source bench/gpu/batch.sh
batch_begin atrex-gateway
batch_atrex "${ATREX_TIMEOUT:-300}" "$@"
batch_end
