#!/bin/bash
# session 3, call A: region overhead (cgroup, after the gpuholders change) and check_drain at 0.9 / 0.97
source .bcc/activate.sh >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
mkdir -p /sys/fs/cgroup/krexbench
cd $PWD
git log --oneline | head -1 > $OUT/commit.txt 2>/dev/null || true
date -u
timeout 120 python3 bench/region_overhead.py --backends cgroup --siblings 1,16 --contending '' --regions 100 \
    --daemon-arg=--cgroup-root=/sys/fs/cgroup/krexbench --json $OUT/ro.json 2>&1 | tee $OUT/ro.txt
timeout 60 python3 bench/region_overhead.py --backends cgroup --siblings 16 --contending '' --regions 100 --probes auto \
    --daemon-arg=--cgroup-root=/sys/fs/cgroup/krexbench --json $OUT/ro-probes.json 2>&1 | tee $OUT/ro-probes.txt
date -u
for f in 0.9 0.97; do
  OUT2=$OUT/d$f; mkdir -p $OUT2
  OUT=$OUT2 timeout 200 python3 bench/gpu/check_drain.py --skip nvml --skip thaw --settle-fraction $f 2>&1 | tail -40 > $OUT/drain-$f.txt
  cp $OUT2/check_drain.json $OUT/check-drain-$f.json 2>/dev/null; rm -rf $OUT2
  tail -22 $OUT/drain-$f.txt; date -u
done
