#!/bin/bash
# What the accelerator owes the open issues after session 16 (bench/RESULTS.md section 0; session
# 16's runs were on an H100), in the order they matter (the fourth only if the device time allows):
#   bash bench/gpu/run_s16.sh 1   # ~8 min: the Atrex `deep` profile with the fixed ncu parser (all
#                                 # issue 24 still owes), then bench.gpu.check_idle_window at the
#                                 # 250 us bar and at 60 us (a neighbour's 0.2 ms kernels passed the
#                                 # 250 us bar at 3-10 ms windows on the H100), then
#                                 # bench.gpu.check_exit on the H200
#   bash bench/gpu/run_s16.sh 2   # ~6 min: the default set (the goals' judge) with region,
#                                 # region-pool (now --exit-wait 0), region-pool-wait (-1: the
#                                 # earlier wait) and shared
#   bash bench/gpu/run_s16.sh 3   # ~9 min: the large set with region-pool (--exit-starve 2, the
#                                 # default since session 17), region-pool-nostarve (600: exits
#                                 # frozen at once however long ago they began, session 16's
#                                 # exit0) and shared, one alone round (the H100 ran out of memory)
#   bash bench/gpu/run_s16.sh 4   # ~8 min: the replay of gpu-10min, seed 2, all three policies
# Results as run_s10.sh's ($OUT/s16-N.tgz, $OUT/s16-N.log, top-level JSON). Environment: as
# run_s12.sh's, EXIT_ARGS (bench.gpu.check_exit's flags) and WINDOW_ARGS (check_idle_window's).
set -u
cd "$(dirname "$0")/../.." || exit 1
source bench/gpu/batch.sh
batch_call s16 4 "${1:-}"
pool="--pool-size 8 --pool-preload torch"
case $call in
1)
  batch_atrex "${ATREX_TIMEOUT:-200}" --only profile-deep
  batch_step idle-window-250 110 python3 -m bench.gpu.check_idle_window --out "$res/bar250" ${WINDOW_ARGS:-}
  batch_step idle-window-60 110 python3 -m bench.gpu.check_idle_window --bar-us 60 --out "$res/bar60" \
    ${WINDOW_ARGS:-}
  batch_step exit 100 python3 -m bench.gpu.check_exit --out "$res" ${EXIT_ARGS:-}
  ;;
2)
  JOBS_SET=${JOBS_SET:-default} batch_jobs "${JOBS_TIMEOUT:-430}" "${JOBS_BUDGET:-400}" \
    "region" "region-pool:$pool" "region-pool-wait:$pool --exit-wait -1" "shared"
  ;;
3)
  JOBS_SET=${JOBS_SET:-large} JOBS_ARGS="--alone-rounds 1 ${JOBS_ARGS:-}" \
    batch_jobs "${JOBS_TIMEOUT:-570}" "${JOBS_BUDGET:-540}" \
    "region-pool:$pool" "region-pool-nostarve:$pool --exit-starve 600" "shared"
  ;;
4)
  batch_replay "${REPLAY_TIMEOUT:-560}" gpu-10min 2
  ;;
esac
batch_end
