#!/bin/bash
# Runs steps of the accelerator batch in one device call and packs every result into $OUT/s9-<tag>.tgz
# (a device call brings back at most 8 files).
#   bench/gpu/run_s9.sh TAG STEP...   steps: lock pool smoke jobs atrex
# Set-up (carried .whl, .suites, .bcc) and packing: bench/gpu/batch.sh. Session 10's calls:
# bench/gpu/run_s10.sh.
set -u
cd "$(dirname "$0")/../.." || exit 1
source bench/gpu/batch.sh
tag=$1; shift
batch_setup "$tag" "s9-$tag"
for step in "$@"; do
  case $step in
    lock) batch_step lock 180 python3 -m bench.gpu.check_lock ;;
    pool) batch_step pool 140 python3 -m bench.gpu.check_pool_adopt --jobs 8 --deadline 120 \
            --out "$res/check_pool_adopt.json" ;;
    smoke) batch_step smoke 200 python3 -m bench.jobs --kernelbench .suites/KernelBench --set tiny \
             --device gpu --triton 4 --variants region shared --alone-rounds 1 --out "$res/jobs-smoke.json" ;;
    jobs) eval "variants=(${VARIANTS:-})"  # quoted NAME:ARGS items, e.g. "'r2:--hold freeze' shared"
          batch_step jobs "${JOBS_TIMEOUT:-560}" python3 -m bench.jobs --kernelbench .suites/KernelBench \
            --set default --device gpu ${VARIANTS:+--variants "${variants[@]}"} --budget-s "${JOBS_BUDGET:-540}" \
            --out "$res/jobs.json" ${JOBS_ARGS:-} ;;
    atrex) batch_step atrex "${ATREX_TIMEOUT:-400}" python3 -m bench.gateway_profile_check \
             --atrex-bench-root .suites/atrex-bench ${ATREX_ARGS:-} ;;
    *) echo "unknown step $step" ;;
  esac
done
batch_end
