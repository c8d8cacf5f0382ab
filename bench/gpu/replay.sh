#!/bin/bash
# The agent-trace replay on the accelerator (bench.replay --pace trace, under the delegated krexbench
# cgroup): every policy's throughput and timing fidelity on one trace, one device call:
#   bash bench/gpu/replay.sh [PROFILE [SEED]]   default gpu-10min, seed 2 (~8 min, all three
#                                               policies; REPLAY_ARGS="--policies region,shared":
#                                               ~3.5 min). `quick` is a CPU profile: refused there.
# Was run_s10.sh's call 3 (its second step), run_s11.sh's call 2, run_s12.sh's and run_s13.sh's and
# run_s16.sh's call 4.
# Results: $OUT/replay-PROFILE.tgz, replay-PROFILE.log, replay-PROFILE.json.
# Environment (all optional): REPLAY_TIMEOUT (the step's limit, 560 s), REPLAY_ARGS (added to
# bench.replay), TAG, TAIL, BATCH_DRY=1 (print the commands only).
set -u
cd "$(dirname "$0")/../.." || exit 1
profile=${1:-gpu-10min} seed=${2:-2}
if ! [[ "$seed" =~ ^[0-9]+$ ]] || [ $# -gt 2 ]; then
  echo "usage: bash bench/gpu/replay.sh [PROFILE [SEED]]"; exit 2
fi
source bench/gpu/batch.sh
batch_begin "replay-$profile"
batch_replay "${REPLAY_TIMEOUT:-560}" "$profile" "$seed"
batch_end
