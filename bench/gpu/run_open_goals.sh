#!/bin/bash
# The accelerator measurements the open issues still need, in calls of under 10 minutes each:
#   bash bench/gpu/run_open_goals.sh 1   # region overhead (issue 3), probe overhead (4), drain at 0.9 (5)
#   bash bench/gpu/run_open_goals.sh 2   # the replay at --settle-fraction 0.97 (issue 5's default)
#   bash bench/gpu/run_open_goals.sh 3   # drain at 0.97; the replay's region policy with --freeze device-holders
#                                        # (issue 3: what freezing only GPU holders buys and costs)
# Run from the repo root; it activates the carried .bcc and installs the carried .whl itself.
# Each step is bounded; one log and the JSON results land under $OUT.
source .bcc/activate.sh >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
mkdir -p "$OUT" /sys/fs/cgroup/krexbench /tmp/krex-replay
LOG="$OUT/log.txt"
CG=--cgroup-root=/sys/fs/cgroup/krexbench
step() { local name=$1 limit=$2; shift 2; echo "===== $name: $*" | tee -a "$LOG"; local t0=$SECONDS
  timeout "$limit" "$@" >> "$LOG" 2>&1; echo "rc=$? after $((SECONDS - t0)) s" | tee -a "$LOG"; }
git log --oneline -1 >> "$LOG" 2>/dev/null; date -u >> "$LOG"
drain() {  # check_drain at one --settle-fraction
  step "drain_$1" 150 env OUT="$OUT/drain_$1" python3 bench/gpu/check_drain.py --skip nvml \
    --skip thaw --settle-fraction "$1"
  mv "$OUT/drain_$1/check_drain.json" "$OUT/check_drain_$1.json" 2>/dev/null; rmdir "$OUT/drain_$1"; }
case "${1:-1}" in
1)
  step overhead 90 python3 bench/region_overhead.py --backends cgroup --siblings 1,4,16,64 \
    --contending '' --regions 100 --daemon-arg=$CG --json "$OUT/region_overhead.json"
  step overhead_probes 45 python3 bench/region_overhead.py --backends cgroup --siblings 16 \
    --contending '' --regions 100 --probes auto --daemon-arg=$CG --json "$OUT/region_overhead_probes.json"
  step uprobe_anatomy 60 python3 bench/probe_overhead.py --uprobe-anatomy --json "$OUT/uprobe_anatomy.json"
  step probe_overhead 220 python3 bench/probe_overhead.py --gpu --reps 8 --bursts 5 --launches 100000 \
    --flood 0 --seconds 1 --json "$OUT/probe_overhead.json"
  drain 0.9 ;;
2)
  step replay 560 python3 bench/replay.py --profile gpu-10min --seed 2 \
    --out /tmp/krex-replay/gpu-10min-097.json --daemon-arg=$CG --daemon-arg=--settle-fraction=0.97
  cp /tmp/krex-replay/gpu-10min-097.json "$OUT/" 2>/dev/null ;;
3)
  drain 0.97
  step replay_holders 400 python3 bench/replay.py --profile gpu-10min --seed 2 --policies region \
    --out /tmp/krex-replay/gpu-10min-holders.json --daemon-arg=$CG --daemon-arg=--freeze=device-holders
  cp /tmp/krex-replay/gpu-10min-holders.json "$OUT/" 2>/dev/null ;;
esac
grep -E "^=====|^rc=" "$LOG"
