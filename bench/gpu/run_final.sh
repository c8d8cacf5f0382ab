#!/bin/bash
# The accelerator's benchmark batch: each step bounded; one log plus the JSON results under $OUT.
# Run from the repo root after `source .bcc/activate.sh` and installing the carried wheels.
mkdir -p "$OUT" /sys/fs/cgroup/krexbench /tmp/krex-replay
LOG="$OUT/log.txt"
CG=--cgroup-root=/sys/fs/cgroup/krexbench
step() { local name=$1 limit=$2; shift 2; echo "===== $name: $*" >> "$LOG"; local t0=$SECONDS
  timeout "$limit" "$@" >> "$LOG" 2>&1; echo "rc=$? after $((SECONDS - t0)) s" >> "$LOG"; }
step replay 200 python3 -m bench.replay --profile gpu-10min --seed 2 --policies region,shared \
  --out /tmp/krex-replay/gpu-10min-b.json --daemon-arg=$CG
cp /tmp/krex-replay/gpu-10min-b.json "$OUT/" 2>/dev/null
step overhead 110 python3 -m bench.region_overhead --backends cgroup,signal --siblings 1,4,16,64 \
  --contending 1,4,16 --regions 100 --daemon-arg=$CG --json "$OUT/region_overhead.json"
step cgroup_v2 40 python3 -m bench.gpu.check_cgroup_v2
step drain 100 python3 -m bench.gpu.check_drain --quick
step gateway 100 python3 -m bench.gateway_jobs --device gpu --jobs 8 --json "$OUT/gateway_jobs.json"
step probe_overhead 150 python3 -m bench.probe_overhead --gpu --reps 3 --flood 0 --json "$OUT/probe_overhead.json"
grep -E "^=====|^rc=" "$LOG"
