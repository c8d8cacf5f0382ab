#!/bin/bash
# What the next accelerator session owes the open issues (21-24), after session 11's fixes (the lock
# wait, deferred exits of locked siblings, adopted programs' regions): up to four device calls, in
# the order they matter.
#   bash bench/gpu/run_s12.sh 1   # ~9.5 min: bench.jobs, default set, every variant in one run:
#                                 # region (the default hold), region-all, region-pool, shared,
#                                 # shared-pool, command
#   bash bench/gpu/run_s12.sh 2   # ~9 min: the large set (48 jobs) with region, region-pool and shared,
#                                 # one alone round: throughput with less of the default set's tail
#                                 # (two jobs' 15-17 s of CPU input generation set its makespan)
#   bash bench/gpu/run_s12.sh 3   # ~5 min: the Atrex evals the check's fixes are about (broken
#                                 # candidate, lock_clocks) and the `deep` profile level
#   bash bench/gpu/run_s12.sh 4   # ~8 min: the replay of gpu-10min, seed 2, all three policies
# Results as run_s10.sh's ($OUT/s12-N.tgz, $OUT/s12-N.log, top-level JSON). Environment: VARIANTS,
# JOBS_SET, JOBS_BUDGET, JOBS_TIMEOUT, JOBS_ARGS, ATREX_TIMEOUT, ATREX_ARGS, REPLAY_TIMEOUT,
# REPLAY_ARGS, BATCH_DRY=1 (print the commands only).
set -u
cd "$(dirname "$0")/../.." || exit 1
source bench/gpu/batch.sh
batch_call s12 4 "${1:-}"
pool="--pool-size 8 --pool-preload torch"
case $call in
1)
  batch_jobs "${JOBS_TIMEOUT:-570}" "${JOBS_BUDGET:-540}" "region" "region-pool:$pool" "shared" \
    "shared-pool:$pool" "command" "region-all:--freeze all"
  ;;
2)
  JOBS_SET=${JOBS_SET:-large} JOBS_ARGS="--alone-rounds 1 ${JOBS_ARGS:-}" \
    batch_jobs "${JOBS_TIMEOUT:-570}" "${JOBS_BUDGET:-540}" "region" "region-pool:$pool" "shared"
  ;;
3)
  batch_atrex "${ATREX_TIMEOUT:-330}" --only eval-broken eval-lock-clocks profile-deep
  ;;
4)
  batch_replay "${REPLAY_TIMEOUT:-560}" gpu-10min 2
  ;;
esac
batch_end
