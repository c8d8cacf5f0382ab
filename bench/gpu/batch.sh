# Shared by the accelerator scripts of bench/gpu/ (lock_checks.sh, kernelbench_jobs.sh, atrex_gateway.sh,
# region_waits.sh, replay.sh, steady_state.sh; sourced, not run): the set-up of one accelerator call,
# bounded steps that log to a results folder, and packing that folder into $OUT.
#   batch_setup TAG PACK  install the carried .whl, activate the carried .bcc, copy the repo to
#                       /tmp/krex (jobs run as the unprivileged krexbench user must read it and
#                       .suites) and cd there; results go to /tmp/res-TAG, packed as $OUT/PACK.tgz,
#                       the call's whole output as $OUT/PACK.log
#   batch_step NAME LIMIT CMD...   run CMD under `timeout LIMIT`, output in $res/NAME.log, then
#                       print its rc, time and log tail, and pack again (a call cut short by its
#                       limit still returns every step finished before it)
#   batch_begin NAME    batch_setup for NAME, or NAME-$TAG where TAG is set (two runs of one script
#                       on a warm machine then keep their results apart)
#   batch_jobs LIMIT BUDGET VARIANT...   bench.jobs on a KernelBench set (JOBS_SET, default `default`;
#                       VARIANTS, quoted NAME:ARGS items, replace the list; JOBS_ARGS are added;
#                       an empty BUDGET gives no --budget-s)
#   batch_atrex LIMIT ARG...   bench.gateway_profile_check on .suites/atrex-bench (ATREX_ARGS added)
#   batch_replay LIMIT PROFILE SEED   bench.replay --pace trace under the delegated krexbench cgroup
# BATCH_DRY=1 prints each step's command instead of running it and skips the set-up's installs
# (checks this script's logic on a machine without the accelerator).

batch_begin() {
  local name=$1${TAG:+-$TAG}
  batch_setup "$name" "$name"
}

batch_setup() {
  tag=$1 pack_name=$2
  real_out=${OUT:-/tmp/out}; mkdir -p "$real_out"
  res=/tmp/res-$tag; mkdir -p "$res"
  exec > >(tee -a "$real_out/$pack_name.log") 2>&1  # the whole call's output comes back as a file too
  echo "== $pack_name $(date -u +%FT%TZ) $(git log --format='%h %s' -1 2>/dev/null | cut -c1-90)"
  # the device's copy of .git may predate the tree it was given: the code's own digest says which
  # commit ran (`bash bench/gpu/tree_digest.sh` at a checkout prints the same)
  echo "== krex_async digest $(bash bench/gpu/tree_digest.sh)"
  if [ "${BATCH_DRY:-0}" = 1 ]; then
    export OUT=$res
    return 0
  fi
  for need in .whl .suites; do
    [ -d "$need" ] || echo "WARNING: $need was not carried (run's carry list): steps that need it fail"
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || { echo "FAIL: installing the carried wheels (.whl)"; exit 1; }
  if [ -f .bcc/activate.sh ]; then source .bcc/activate.sh; else echo "no .bcc: probes will be off"; fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  rm -rf /tmp/krex && cp -a . /tmp/krex && chmod -R a+rX /tmp/krex /tmp/site && cd /tmp/krex || {
    echo "FAIL: copying the repo to /tmp/krex"; exit 1; }
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,memory.used --format=csv,noheader \
    || echo "WARNING: nvidia-smi failed"
  export OUT=$res
}

batch_pack() {
  # at most 8 files come back from a call: the tarball of everything, this call's log, and up to
  # five top-level JSON results as plain files
  # exit 1 is "a file changed as it was read" (a stack still writing its log after a timeout):
  # the archive is whole all the same
  local rc=0
  tar czf "$real_out/$pack_name.tgz.tmp" --warning=no-file-changed -C "$res" . 2>/dev/null || rc=$?
  [ "$rc" -le 1 ] && mv "$real_out/$pack_name.tgz.tmp" "$real_out/$pack_name.tgz"
  if [ "$(stat -c %s "$real_out/$pack_name.tgz" 2>/dev/null || echo 0)" -gt 15000000 ]; then
    # over a returned file's 16 MiB: keep the results, drop the daemons' and gateways' logs
    tar czf "$real_out/$pack_name.tgz" --warning=no-file-changed -C "$res" --exclude='*.logs' . 2>/dev/null
    echo "NOTE: $pack_name.tgz without *.logs (too large)"
  fi
  batch_copy_json
}

batch_copy_json() {
  local n=0 f
  for f in "$res"/*.json; do
    [ -f "$f" ] || continue
    n=$((n + 1)); [ $n -le 5 ] || break
    cp "$f" "$real_out/.$(basename "$f").tmp" && mv "$real_out/.$(basename "$f").tmp" "$real_out/$(basename "$f")"
  done
}

batch_step() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc
  echo "== $name (limit ${limit}s): $*"
  if [ "${BATCH_DRY:-0}" = 1 ]; then
    echo "$*" > "$res/$name.log"; rc=0
  else
    # meanwhile the step's JSON (rewritten by the benchmarks as they go) is copied to $OUT every 30 s,
    # so even a call killed at its limit mid-step returns the passes finished so far
    ( while sleep 30; do batch_copy_json; done ) >/dev/null 2>&1 &
    local copier=$!
    timeout "$limit" "$@" > "$res/$name.log" 2>&1; rc=$?
    kill "$copier" 2>/dev/null; wait "$copier" 2>/dev/null
  fi
  echo "== $name rc=$rc $((SECONDS - t0))s$([ $rc = 124 ] && echo ' (TIMED OUT)')"
  tail -n "${TAIL:-25}" "$res/$name.log" 2>/dev/null | cut -c1-220
  batch_pack
  return 0
}

batch_jobs() {
  local limit=$1 budget=$2; shift 2
  local variants=("$@")
  [ -n "${VARIANTS:-}" ] && eval "variants=($VARIANTS)"
  batch_step jobs "$limit" python3 -m bench.jobs --kernelbench .suites/KernelBench --set "${JOBS_SET:-default}" \
    --device gpu --variants "${variants[@]}" ${budget:+--budget-s "$budget"} --out "$res/jobs.json" ${JOBS_ARGS:-}
}

batch_atrex() {
  local limit=$1; shift
  batch_step atrex "$limit" python3 -m bench.gateway_profile_check --atrex-bench-root .suites/atrex-bench \
    --out "$res" "$@" ${ATREX_ARGS:-}
}

batch_replay() {
  # quick is a CPU profile (refused on the GPU machine): gpu-10min is the GPU one
  local limit=$1 profile=$2 seed=$3
  # an empty cgroup to delegate to the replay's daemons, as in earlier sessions
  [ "${BATCH_DRY:-0}" = 1 ] || mkdir -p /sys/fs/cgroup/krexbench
  batch_step replay "$limit" python3 -m bench.replay --profile "$profile" --seed "$seed" --pace trace \
    --out "$res/replay-$profile.json" --daemon-arg=--cgroup-root=/sys/fs/cgroup/krexbench ${REPLAY_ARGS:-}
}

batch_end() {
  ls -la "$real_out"
  exec 1>&- 2>&-  # let tee see the end of the output and finish the log file before the call returns
  sleep 0.5
}
