#!/bin/bash
# The steady-state benchmark of record (bench.steady, issue 38) and the fidelity check
# (bench.gpu.check_fidelity) on one warm accelerator, over as many 10-minute calls as they need:
#   bash bench/gpu/steady_state.sh N    # N = 1, 2, 3, ...: only names the call's files
# Every call does what is still owed, within CALL_S (default 560) seconds of its start:
#   1. bench.steady --resume on $STATE/steady.json (STATE=/tmp/krex-steady on the device: it
#      survives between calls while the machine stays warm), stopping before a unit (an alone
#      round, or one variant's round of --jobs-per-round jobs) that would not end in time;
#   2. then, once the steady run owes nothing (or first, with FIDELITY_FIRST=1) and at least
#      FIDELITY_S (default 230) seconds are left, bench.gpu.check_fidelity, once.
# With the defaults (the large KernelBench set, 48 jobs a round, 2 rounds, 2 alone rounds; shared at
# 4, 8 and 12, region, region with a reusing pool at 8, and at 10 with --mem-guard want, the lead on
# the pool's memory queueing; the single-use pool left out: it ran below the reusing one in every
# invocation) the steady run is ~24
# min of units: three calls, a fourth if an estimate was short. A machine gone cold loses $STATE: carry the last
# returned steady.json (at an ignored path) and name it in STEADY_FROM to continue it.
# Environment (all optional): ADMIT (the region-admit@8 variant's args: serve args, then `-- `
# and gateway args, e.g. "--mem-admission on -- --max-running auto"), VARIANTS (quoted NAME:ARGS
# items replacing the default list), STEADY_ARGS (added to bench.steady), FIDELITY_ARGS (added to
# check_fidelity), CALL_S, FIDELITY_S, FIDELITY_FIRST, STEADY_FROM, BATCH_DRY=1 (print the steps).
# Results in $OUT: steady-N.tgz (everything), steady-N.log (the call's output), steady.json and
# check_fidelity.json as plain files.
set -u
cd "$(dirname "$0")/../.." || exit 1
call=${1:-}
if ! [[ "$call" =~ ^[0-9]+$ ]]; then
  echo "usage: bash bench/gpu/steady_state.sh N   (N: the call's number, 1, 2, ...)"; exit 2
fi
source bench/gpu/batch.sh
batch_setup "steady-$call" "steady-$call"
CALL_S=${CALL_S:-560}
FIDELITY_S=${FIDELITY_S:-230}
STATE=${STATE:-/tmp/krex-steady}
mkdir -p "$STATE"
if [ ! -f "$STATE/steady.json" ] && [ -n "${STEADY_FROM:-}" ]; then
  cp "$STEADY_FROM" "$STATE/steady.json" && echo "== continuing $STEADY_FROM"
fi
pool="--pool-size 8 --pool-preload torch"
off="--admission off"  # unprotected sharing: no memory admission either
reuse="$pool --pool-max-uses 1000"  # the pool reusing its workers
variants=("shared-4@4:$off" "shared-8@8:$off" "shared-12@12:$off" "region@8" "region-pool-reuse@8:$reuse"
  "region-pool-reuse-want@10:$reuse --pool-size 10 --mem-guard want")  # a guarded re-run's room, narrower
[ -n "${VARIANTS:-}" ] && eval "variants=($VARIANTS)"
admit=()
[ -n "${ADMIT:-}" ] && admit=("--admit=$ADMIT")

owed() {
  # whether the steady run still owes units (a missing file owes all of them)
  [ ! -f "$STATE/steady.json" ] && return 0
  python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); sys.exit(0 if d.get("pending", [1]) else 1)' \
    "$STATE/steady.json"
}

fidelity() {
  local left=$((CALL_S - SECONDS))
  if [ -f "$STATE/fidelity/check_fidelity.json" ] || [ "$left" -lt "$FIDELITY_S" ]; then return 0; fi
  mkdir -p "$STATE/fidelity"
  batch_step fidelity "$((left - 10))" python3 -m bench.gpu.check_fidelity --out "$STATE/fidelity" \
    --deadline "$((left - 40))" ${FIDELITY_ARGS:-}
  cp -a "$STATE/fidelity/." "$res/" 2>/dev/null
  batch_pack
}

steady() {
  local left=$((CALL_S - SECONDS))
  owed || return 0
  if [ "$left" -lt 60 ]; then echo "== steady: ${left}s left, nothing started"; return 0; fi
  # the unit under way may overrun its estimate by a little: the step's limit is the call's end
  batch_step steady "$left" python3 -m bench.steady --kernelbench .suites/KernelBench --device gpu \
    --variants "${variants[@]}" "${admit[@]}" --resume --deadline-s "$((left - 25))" \
    --out "$STATE/steady.json" ${STEADY_ARGS:-}
  cp -a "$STATE/steady.json" "$res/" 2>/dev/null
  tar czf "$res/steady-logs.tgz" -C "$STATE" steady.logs 2>/dev/null
  batch_pack
}

[ "${FIDELITY_FIRST:-0}" = 1 ] && fidelity
steady
owed || fidelity
batch_end
