#!/bin/bash
# Session 11's accelerator measurements (bench/README.md, "Session 11 on the H200"):
#   bash bench/gpu/run_s11.sh 1   # ~9.5 min: bench.jobs after the lock wait (region in both freeze
#                                 # modes, shared, region with the pool), then the Atrex-Bench
#                                 # eval/profile check through the gateway
#   bash bench/gpu/run_s11.sh 2   # ~3-4 min: the replay (REPLAY_PROFILE, REPLAY_ARGS) with --pace trace
#   bash bench/gpu/run_s11.sh 3   # ~1.5 min: the broken-candidate and lock_clocks evals again, after
#                                 # the check's fixes (a dict output was not broken; clock_locked is
#                                 # read from the result's environment)
# Results as run_s10.sh's: $OUT/s11-<call>.tgz, $OUT/s11-<call>.log, the top-level JSON files.
# Environment (all optional): VARIANTS (quoted NAME:ARGS items), JOBS_BUDGET (260), JOBS_TIMEOUT
# (300), JOBS_ARGS; ATREX_TIMEOUT (230), ATREX_ARGS; REPLAY_PROFILE (quick), REPLAY_TIMEOUT (400),
# REPLAY_ARGS; BATCH_DRY=1 prints the commands only.
set -u
cd "$(dirname "$0")/../.." || exit 1
source bench/gpu/batch.sh
call=${1:-}
case $call in 1|2|3) ;; *) echo "usage: bash bench/gpu/run_s11.sh 1|2|3"; exit 2 ;; esac
batch_setup "s11-$call" "s11-$call"
case $call in
1)
  pool="--pool-size 8 --pool-preload torch"
  variants=("region:--freeze all" "shared" "region-dh:--freeze device-holders" "region-pool:--freeze all $pool")
  [ -n "${VARIANTS:-}" ] && eval "variants=($VARIANTS)"
  batch_step jobs "${JOBS_TIMEOUT:-300}" python3 -m bench.jobs --kernelbench .suites/KernelBench \
    --set default --device gpu --variants "${variants[@]}" --budget-s "${JOBS_BUDGET:-260}" \
    --out "$res/jobs.json" ${JOBS_ARGS:-}
  batch_step atrex "${ATREX_TIMEOUT:-230}" python3 -m bench.gateway_profile_check \
    --atrex-bench-root .suites/atrex-bench --out "$res" ${ATREX_ARGS:-}
  ;;
2)
  [ "${BATCH_DRY:-0}" = 1 ] || mkdir -p /sys/fs/cgroup/krexbench
  batch_step replay "${REPLAY_TIMEOUT:-400}" python3 -m bench.replay --profile "${REPLAY_PROFILE:-quick}" \
    --seed 1 --pace trace --out "$res/replay-${REPLAY_PROFILE:-quick}.json" \
    --daemon-arg=--cgroup-root=/sys/fs/cgroup/krexbench ${REPLAY_ARGS:-}
  ;;
3)
  batch_step atrex "${ATREX_TIMEOUT:-120}" python3 -m bench.gateway_profile_check \
    --atrex-bench-root .suites/atrex-bench --out "$res" --only eval-broken eval-lock-clocks ${ATREX_ARGS:-}
  ;;
esac
batch_end
