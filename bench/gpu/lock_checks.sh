#!/bin/bash
# The NVIDIA driver's process lock on the accelerator, one device call (~5 min):
#   bash bench/gpu/lock_checks.sh [STEP...]   steps (default all, in this order):
#     lock        bench.gpu.check_lock: a daemon's --hold lock holding real CUDA siblings (150 s)
#     lockstates  bench.gpu.check_lock_states: lock/unlock in each state a CUDA process passes
#                 through, NOT_READY with a context among them (115 s)
#     pool        bench.gpu.check_pool_adopt: pooled interpreters adopting 8 jobs (100 s)
# Was run_s9.sh's lock and pool steps and run_s10.sh's call 1 (whose fourth step, the jobs
# pipeline's smoke test, is now `bash bench/gpu/kernelbench_jobs.sh tiny`).
# Results: $OUT/lock-checks.tgz (every step's log and JSON), lock-checks.log, the top-level JSON.
# Environment (all optional): LOCK_ARGS, LOCK_STATES_ARGS (e.g. "--only torch"), POOL_ARGS; TAG
# (names the results lock-checks-TAG); TAIL (log lines printed per step, 25); BATCH_DRY=1 prints
# the commands only.
set -u
cd "$(dirname "$0")/../.." || exit 1
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(lock lockstates pool)
for step in "${steps[@]}"; do
  case $step in
    lock | lockstates | pool) ;;
    *) echo "usage: bash bench/gpu/lock_checks.sh [lock] [lockstates] [pool] (unknown step $step)"; exit 2 ;;
  esac
done
source bench/gpu/batch.sh
batch_begin lock-checks
for step in "${steps[@]}"; do
  case $step in
    lock) batch_step lock 150 python3 -m bench.gpu.check_lock --deadline 130 ${LOCK_ARGS:-} ;;
    lockstates) batch_step lockstates 115 python3 -m bench.gpu.check_lock_states --deadline 90 ${LOCK_STATES_ARGS:-} ;;
    pool) batch_step pool 100 python3 -m bench.gpu.check_pool_adopt --jobs 8 --deadline 90 \
            --out "$res/check_pool_adopt.json" ${POOL_ARGS:-} ;;
  esac
done
batch_end
