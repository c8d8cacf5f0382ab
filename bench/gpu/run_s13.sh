#!/bin/bash
# What the accelerator owes the open issues after session 13 (bench/RESULTS.md section 0): device
# calls in the order they matter (the fourth only if the session's device time allows).
#   bash bench/gpu/run_s13.sh 1   # ~8 min, most wanted first: the Atrex `deep` profile with the
#                                 # check's fixed regex (all issue 24 still owes), then
#                                 # bench.gpu.check_idle_window (how short the drain check's idle
#                                 # window can be: 20 of a region entry's 24 ms), then
#                                 # bench.gpu.check_exit (which part of a torch process's 0.4-0.5 s
#                                 # exit disturbs another's timing: what a region must wait for)
#   bash bench/gpu/run_s13.sh 2   # ~5 min: the default set (the goals' judge) with region,
#                                 # region-pool (adopters now served in order), the same with
#                                 # --exit-wait 0 (exits frozen, not waited for), and shared
#   bash bench/gpu/run_s13.sh 3   # ~9 min: the large set (48 jobs) with region-pool, its
#                                 # --exit-wait 0 twin and shared, one alone round
#   bash bench/gpu/run_s13.sh 4   # ~8 min: the replay of gpu-10min, seed 2, all three policies
# Results as run_s10.sh's ($OUT/s13-N.tgz, $OUT/s13-N.log, top-level JSON). Environment: as
# run_s12.sh's, EXIT_ARGS (bench.gpu.check_exit's flags) and WINDOW_ARGS (check_idle_window's).
set -u
cd "$(dirname "$0")/../.." || exit 1
source bench/gpu/batch.sh
batch_call s13 4 "${1:-}"
pool="--pool-size 8 --pool-preload torch"
case $call in
1)
  # most wanted first (a call cut short keeps the steps it finished): the Atrex deep profile is all
  # issue 24 still owes; the idle window sets --drain-window (issue 22's entry); then the exit
  batch_atrex "${ATREX_TIMEOUT:-200}" --only profile-deep
  batch_step idle-window 120 python3 -m bench.gpu.check_idle_window --out "$res" ${WINDOW_ARGS:-}
  batch_step exit 150 python3 -m bench.gpu.check_exit --out "$res" ${EXIT_ARGS:-}
  ;;
2)
  JOBS_SET=${JOBS_SET:-default} batch_jobs "${JOBS_TIMEOUT:-400}" "${JOBS_BUDGET:-370}" \
    "region" "region-pool:$pool" "region-pool-exit0:$pool --exit-wait 0" "shared"
  ;;
3)
  JOBS_SET=${JOBS_SET:-large} JOBS_ARGS="--alone-rounds 1 ${JOBS_ARGS:-}" \
    batch_jobs "${JOBS_TIMEOUT:-570}" "${JOBS_BUDGET:-540}" \
    "region-pool:$pool" "region-pool-exit0:$pool --exit-wait 0" "shared"
  ;;
4)
  batch_replay "${REPLAY_TIMEOUT:-560}" gpu-10min 2
  ;;
esac
batch_end
