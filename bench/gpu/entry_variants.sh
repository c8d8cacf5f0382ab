#!/bin/bash
# Where a region's entry time goes on the accelerator (issue 3): the kernel's freezer floor, then
# region_overhead with 16 idle siblings under daemon variants that each leave one part of the entry
# out, interleaved over two rounds:
#   A default   B --region-cores=0 (no fencing)   C --settle-ms=0 (no NVML settle thread)
#   D --devices=cpu:1 (no GPU work: no /proc reading thread, no settle)   E D with --region-cores=0
#   bash bench/gpu/entry_variants.sh [regions]
# Writes one file, $OUT/entry_variants.json ({name: the script's JSON}): a device call brings back
# at most 8 files.
source .bcc/activate.sh >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
mkdir -p "$OUT" /sys/fs/cgroup/krexbench
RAW=$(mktemp -d)
N=${1:-200}
CG=--cgroup-root=/sys/fs/cgroup/krexbench
declare -A V=([A]="" [B]="--region-cores=0" [C]="--settle-ms=0" [D]="--devices=cpu:1"
              [E]="--devices=cpu:1 --region-cores=0")
python3 -m bench.freeze_floor --root /sys/fs/cgroup/krexbench --groups 16 --json "$RAW/floor-1.json"
for round in 1 2; do
  for v in A B C D E; do
    args=(--daemon-arg=$CG); for a in ${V[$v]}; do args+=(--daemon-arg=$a); done
    echo "===== $v round $round: ${V[$v]}"
    timeout 60 python3 -m bench.region_overhead --backends cgroup --siblings 16 --contending '' \
      --regions "$N" "${args[@]}" --json "$RAW/entry-$v-$round.json" 2>&1 | grep -v '^$'
  done
done
python3 -m bench.freeze_floor --root /sys/fs/cgroup/krexbench --groups 16 --json "$RAW/floor-2.json"
python3 - "$RAW" "$OUT/entry_variants.json" <<'PY'
import json, os, sys
raw, out = sys.argv[1], sys.argv[2]
merged = {f[:-5]: json.load(open(os.path.join(raw, f))) for f in sorted(os.listdir(raw))
          if f.endswith(".json")}
json.dump(merged, open(out, "w"))
PY
