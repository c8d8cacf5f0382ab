#!/bin/bash
# The accelerator's check batch: each step bounded, output under $OUT. Run from the repo root after
# `source .bcc/activate.sh` and installing the carried wheels.
mkdir -p "$OUT"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$?" >> "$OUT/$name.txt"; tail -4 "$OUT/$name.txt"; }
step cgroup_v2 45 python3 -m bench.gpu.check_cgroup_v2
step probes 120 python3 -m bench.gpu.check_probes --launches 100000 --deadline 110
step drain 200 python3 -m bench.gpu.check_drain
step pool 120 python3 -m bench.pool_start --device cuda --together 1,16 --rounds 3 --goal 20 --json "$OUT/pool_start.json"
step workload 110 python3 -m bench.gpu.check_workload
step lock 180 python3 -m bench.gpu.check_lock --deadline 170
