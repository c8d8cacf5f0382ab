#!/bin/bash
# Runs steps of the accelerator batch in one device call and packs every result into $OUT/s9-<tag>.tgz
# (a device call brings back at most 8 files).
#   bench/gpu/run_s9.sh TAG STEP...   steps: lock pool smoke jobs jobs-large atrex
# Set-up (carried .whl, .suites, .bcc) is done here; the repo is copied to /tmp/krex so that jobs
# running as an unprivileged user (the gateway's --run-as) can read it and the suites.
set -u
tag=$1; shift
real_out=${OUT:-/tmp/out}; mkdir -p "$real_out"
res=/tmp/res-$tag; mkdir -p "$res"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
[ -d .bcc ] && source .bcc/activate.sh
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
rm -rf /tmp/krex && cp -a . /tmp/krex && chmod -R a+rX /tmp/krex /tmp/site && cd /tmp/krex || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
export OUT=$res
for step in "$@"; do
  t0=$(date +%s)
  case $step in
    lock) timeout 180 python3 -m bench.gpu.check_lock > "$res/lock.log" 2>&1 ;;
    pool) timeout 140 python3 -m bench.gpu.check_pool_adopt --jobs 8 --deadline 120 \
            --out "$res/check_pool_adopt.json" > "$res/pool.log" 2>&1 ;;
    smoke) timeout 200 python3 -m bench.jobs --kernelbench .suites/KernelBench --set tiny --device gpu \
             --triton 4 --variants region shared --alone-rounds 1 --out "$res/jobs-smoke.json" \
             > "$res/smoke.log" 2>&1 ;;
    jobs) eval "variants=(${VARIANTS:-})"  # quoted NAME:ARGS items, e.g. "'r2:--hold freeze' shared"
          timeout ${JOBS_TIMEOUT:-560} python3 -m bench.jobs --kernelbench .suites/KernelBench --set default \
            --device gpu ${VARIANTS:+--variants "${variants[@]}"} --budget-s ${JOBS_BUDGET:-540} \
            --out "$res/jobs.json" ${JOBS_ARGS:-} > "$res/jobs.log" 2>&1 ;;
    atrex) timeout ${ATREX_TIMEOUT:-400} python3 -m bench.gateway_profile_check --atrex-bench-root .suites/atrex-bench ${ATREX_ARGS:-} \
             > "$res/atrex.log" 2>&1 ;;
    *) echo "unknown step $step"; continue ;;
  esac
  rc=$?
  echo "== $step rc=$rc $(( $(date +%s) - t0 ))s"; tail -n ${TAIL:-25} "$res/$step.log" 2>/dev/null | cut -c1-220
done
tar czf "$real_out/s9-$tag.tgz" -C "$res" . 2>/dev/null
cp "$res"/*.json "$real_out"/ 2>/dev/null
ls -la "$real_out"
