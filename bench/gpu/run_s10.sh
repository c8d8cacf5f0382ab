#!/bin/bash
# Session 10's accelerator measurements, one device call each (bench/README.md, "Session 10 on the
# H200", says how to call them with the run tool and what each brings back):
#   bash bench/gpu/run_s10.sh 1   # ~7-9 min: check_lock, check_lock_states, check_pool_adopt,
#                                 # and the jobs pipeline on the tiny set (smoke)
#   bash bench/gpu/run_s10.sh 2   # ~9.5 min: bench.jobs, default set, the default variants with
#                                 # the pooled ones first (region-pool, shared-pool)
#   bash bench/gpu/run_s10.sh 3   # ~6-8 min: the Atrex-Bench eval/profile check through the gateway,
#                                 # then the replay of the quick profile with --pace trace
# Results: $OUT/s10-<call>.tgz (every step's log and JSON), $OUT/s10-<call>.log (the call's output)
# and the top-level JSON files. Each step is bounded so that a call ends inside its 600 s; the
# tarball is rewritten after every step, so a call cut short returns what it finished.
# Environment (all optional): LOCK_ARGS, LOCK_STATES_ARGS, POOL_ARGS, SMOKE_ARGS; VARIANTS (call 2:
# quoted NAME:ARGS items replacing the list below), JOBS_BUDGET (510), JOBS_TIMEOUT (545), JOBS_ARGS;
# ATREX_TIMEOUT (300), ATREX_ARGS; REPLAY_PROFILE (quick), REPLAY_TIMEOUT (200), REPLAY_ARGS;
# TAIL (log lines printed per step, 25); BATCH_DRY=1 prints the commands only.
set -u
cd "$(dirname "$0")/../.." || exit 1
source bench/gpu/batch.sh
batch_call s10 3 "${1:-}"
case $call in
1)
  # the driver lock through a daemon (53 s on the H200 in session 9), then the open question of
  # NOT_READY with a context (about 70-90 s), then pool adoption (36 s) and the jobs pipeline
  batch_step lock 150 python3 -m bench.gpu.check_lock --deadline 130 ${LOCK_ARGS:-}
  batch_step lockstates 115 python3 -m bench.gpu.check_lock_states --deadline 90 ${LOCK_STATES_ARGS:-}
  batch_step pool 100 python3 -m bench.gpu.check_pool_adopt --jobs 8 --deadline 90 \
    --out "$res/check_pool_adopt.json" ${POOL_ARGS:-}
  batch_step smoke 170 python3 -m bench.jobs --kernelbench .suites/KernelBench --set tiny --device gpu \
    --triton 4 --variants region shared --alone-rounds 1 --out "$res/jobs-smoke.json" \
    ${SMOKE_ARGS:-}
  ;;
2)
  # the default variants (bench/jobs.py default_variants) plus shared-pool; the pooled ones early,
  # since they are the owed measurement, and --budget-s skips whatever would not fit at the end
  pool="--pool-size 8 --pool-preload torch"
  batch_jobs "${JOBS_TIMEOUT:-545}" "${JOBS_BUDGET:-510}" "region:--freeze all" "region-pool:$pool" \
    "shared" "shared-pool:$pool" "command" "region-dh:--freeze device-holders" "region-lock:--hold lock"
  ;;
3)
  batch_atrex "${ATREX_TIMEOUT:-300}"
  batch_replay "${REPLAY_TIMEOUT:-200}" "${REPLAY_PROFILE:-quick}" 1
  ;;
esac
batch_end
