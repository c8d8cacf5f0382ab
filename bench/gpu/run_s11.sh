#!/bin/bash
# Session 11's accelerator measurements (bench/README.md, "Session 11 on the H200"):
#   bash bench/gpu/run_s11.sh 1   # ~9.5 min: bench.jobs after the lock wait (region in both freeze
#                                 # modes, shared, region with the pool), then the Atrex-Bench
#                                 # eval/profile check through the gateway
#   bash bench/gpu/run_s11.sh 2   # the replay of gpu-10min, seed 2, --pace trace (REPLAY_ARGS="--policies
#                                 # region,shared": ~3.5 min; all three policies: ~8 min)
#   bash bench/gpu/run_s11.sh 3   # ~1.5 min: the broken-candidate and lock_clocks evals again, after
#                                 # the check's fixes (a dict output was not broken; clock_locked is
#                                 # read from the result's environment)
# Results as run_s10.sh's: $OUT/s11-<call>.tgz, $OUT/s11-<call>.log, the top-level JSON files.
# Environment (all optional): VARIANTS (quoted NAME:ARGS items), JOBS_BUDGET (260), JOBS_TIMEOUT
# (300), JOBS_ARGS; ATREX_TIMEOUT (230), ATREX_ARGS; REPLAY_PROFILE (gpu-10min), REPLAY_TIMEOUT (400),
# REPLAY_ARGS; BATCH_DRY=1 prints the commands only.
set -u
cd "$(dirname "$0")/../.." || exit 1
source bench/gpu/batch.sh
batch_call s11 3 "${1:-}"
case $call in
1)
  pool="--pool-size 8 --pool-preload torch"
  batch_jobs "${JOBS_TIMEOUT:-300}" "${JOBS_BUDGET:-260}" "region:--freeze all" "shared" \
    "region-dh:--freeze device-holders" "region-pool:--freeze all $pool"
  batch_atrex "${ATREX_TIMEOUT:-230}"
  ;;
2)
  batch_replay "${REPLAY_TIMEOUT:-400}" "${REPLAY_PROFILE:-gpu-10min}" 2
  ;;
3)
  batch_atrex "${ATREX_TIMEOUT:-120}" --only eval-broken eval-lock-clocks
  ;;
esac
batch_end
