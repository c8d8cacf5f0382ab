#!/bin/bash
# What a region's entry waits for on the accelerator, one device call (~4 min):
#   bash bench/gpu/region_waits.sh [STEP...]   steps (default both, in this order):
#     idle-window  bench.gpu.check_idle_window: how short the drain check's idle window can be
#                  (--drain-window) and still never pass a busy neighbour, once per bar in BARS
#                  (110 s each; raw round-trip streams in idle_streams.json.gz)
#     exit         bench.gpu.check_exit: which part of a torch process's exit disturbs another's
#                  timing (what --exit-wait waits for) (100 s)
# Was run_s13.sh's and run_s16.sh's call 1, after its Atrex step (now bench/gpu/atrex_gateway.sh).
# Results: $OUT/region-waits.tgz (bar<US>/ for each bar), region-waits.log, the top-level JSON.
# Environment (all optional): BARS (the idle bars in us, "250 60"), WINDOW_ARGS (check_idle_window's
# flags), EXIT_ARGS (check_exit's), TAG, TAIL, BATCH_DRY=1 (print the commands only).
set -u
cd "$(dirname "$0")/../.." || exit 1
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(idle-window exit)
for step in "${steps[@]}"; do
  case $step in
    idle-window | exit) ;;
    *) echo "usage: bash bench/gpu/region_waits.sh [idle-window] [exit] (unknown step $step)"; exit 2 ;;
  esac
done
source bench/gpu/batch.sh
batch_begin region-waits
for step in "${steps[@]}"; do
  case $step in
    idle-window)
      for bar in ${BARS:-250 60}; do
        batch_step "idle-window-$bar" 110 python3 -m bench.gpu.check_idle_window --bar-us "$bar" \
          --out "$res/bar$bar" ${WINDOW_ARGS:-}
      done ;;
    exit) batch_step exit 100 python3 -m bench.gpu.check_exit --out "$res" ${EXIT_ARGS:-} ;;
  esac
done
batch_end
