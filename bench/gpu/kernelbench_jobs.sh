#!/bin/bash
# Throughput (jobs/min) and timing inflation of KernelBench jobs under daemon variants, against the
# same jobs alone (bench.jobs), one device call:
#   bash bench/gpu/kernelbench_jobs.sh SET [VARIANT...]
#     SET      tiny (~3 min: the pipeline's smoke test), default (~7 min: the goals' judge) or
#              large (~9.5 min: 48 jobs, less of the default set's tail, one alone round)
#     VARIANT  NAME or NAME:DAEMON-ARGS (quote each); none given: the set's list below
# Defaults, set by set (the variants the open issues last asked for):
#   tiny     region shared; --triton 4 --alone-rounds 1; no budget; limit 170 s
#   default  region, region-pool, region-pool-wait (--exit-wait -1), shared; budget 400 s, limit 430
#   large    region-pool, region-pool-nostarve (--exit-starve 600), shared; --alone-rounds 1;
#            budget 540 s, limit 570
# (region-pool: --pool-size 8 --pool-preload torch.) --budget-s skips, from the end, the variants
# that would not fit. Was the jobs steps of run_s9.sh to run_s16.sh (bench/RESULTS.md names each
# run's variants).
# Results: $OUT/kernelbench-jobs-SET.tgz, kernelbench-jobs-SET.log and jobs.json
# (`python -m bench.jobs_report jobs.json` prints its table again).
# Environment (all optional): JOBS_TIMEOUT, JOBS_BUDGET (the set's limit and budget), JOBS_ARGS
# (added to bench.jobs, after the set's), VARIANTS (quoted NAME:ARGS items, as the arguments), TAG,
# TAIL, BATCH_DRY=1 (print the commands only).
set -u
cd "$(dirname "$0")/../.." || exit 1
pool="--pool-size 8 --pool-preload torch"
set_name=${1:-}
case $set_name in
  tiny) limit=170 budget="" args="--triton 4 --alone-rounds 1" variants=("region" "shared") ;;
  default) limit=430 budget=400 args="" variants=("region" "region-pool:$pool" "region-pool-wait:$pool --exit-wait -1" "shared") ;;
  large) limit=570 budget=540 args="--alone-rounds 1" variants=("region-pool:$pool" "region-pool-nostarve:$pool --exit-starve 600" "shared") ;;
  *) echo "usage: bash bench/gpu/kernelbench_jobs.sh tiny|default|large [VARIANT...]"; exit 2 ;;
esac
shift
[ $# -gt 0 ] && variants=("$@")
source bench/gpu/batch.sh
batch_begin "kernelbench-jobs-$set_name"
JOBS_SET=$set_name JOBS_ARGS="$args ${JOBS_ARGS:-}" \
  batch_jobs "${JOBS_TIMEOUT:-$limit}" "${JOBS_BUDGET-$budget}" "${variants[@]}"
batch_end
