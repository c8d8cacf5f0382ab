#!/bin/bash
# The accelerator measurements the open issues still need, in calls of under 10 minutes each:
#   bash bench/gpu/run_open_goals.sh 1   # region overhead with 1,4,16,64 siblings and probes (issue 3),
#                                        # the v2 cgroup self-check (3), probe overhead (4)
#   bash bench/gpu/run_open_goals.sh 2   # drain at the daemon's default settle fraction, 8 regions (5)
#   bash bench/gpu/run_open_goals.sh 3   # the replay, all policies (issue 7; 5's fidelity goals)
#   bash bench/gpu/run_open_goals.sh 4   # the replay's region policy with --freeze device-holders
#   bash bench/gpu/run_open_goals.sh 5   # region overhead between two wake-up latency readings of the
#                                        # machine (issue 3), the ctxpool self-check and pooled start
#                                        # through the daemon (issue 6)
#   bash bench/gpu/run_open_goals.sh 6   # the kernel's freezer floor and region overhead (3), then
#                                        # the replay, all policies (7)
#   bash bench/gpu/run_open_goals.sh 7   # region entry with and without the bcc probes, 16 siblings,
#                                        # two rounds, and 1/4/64 with probes (3); host-clock
#                                        # timings in and out of a region per daemon variant (7)
#   bash bench/gpu/run_open_goals.sh 8   # the probes' GPU self-check (launch scope outsiders) and
#                                        # their overhead per mode (4)
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
drain() {  # check_drain at the default --settle-fraction, $1 regions
  step "drain" 300 env OUT="$OUT/drain" python3 -m bench.gpu.check_drain --skip nvml \
    --skip thaw --regions "$1"
  mv "$OUT/drain/check_drain.json" "$OUT/check_drain.json" 2>/dev/null; rmdir "$OUT/drain"; }
replay() {  # the replay, all policies, within $1 seconds (issue 7)
  step replay "$1" python3 -m bench.replay --profile gpu-10min --seed 2 \
    --out /tmp/krex-replay/gpu-10min.json --daemon-arg=$CG
  cp /tmp/krex-replay/gpu-10min*.json /tmp/krex-replay/*.png "$OUT/" 2>/dev/null; }
floor() {  # the kernel's freezer without krex, then krex's region entry, 16 siblings (issue 3)
  step freeze_floor 60 python3 -m bench.freeze_floor --root /sys/fs/cgroup/krexbench --groups 16 \
    --json "$OUT/freeze_floor.json"
  step overhead16 60 python3 -m bench.region_overhead --backends cgroup --siblings 16 \
    --contending '' --regions 200 --daemon-arg=$CG --json "$OUT/region_overhead16.json"; }
case "${1:-1}" in
1)
  step overhead 150 python3 -m bench.region_overhead --backends cgroup --siblings 1,4,16,64 \
    --contending '' --regions 100 --daemon-arg=$CG --json "$OUT/region_overhead.json"
  step overhead_probes 45 python3 -m bench.region_overhead --backends cgroup --siblings 16 \
    --contending '' --regions 100 --probes auto --daemon-arg=$CG --json "$OUT/region_overhead_probes.json"
  step cgroup_v2 90 python3 -m bench.gpu.check_cgroup_v2
  step probe_overhead 300 python3 -m bench.probe_overhead --gpu --reps 8 --bursts 200 --launches 500 \
    --flood 0 --seconds 1 --json "$OUT/probe_overhead.json" ;;
2)
  drain 8 ;;
3)
  replay 590 ;;
4)
  step replay_holders 400 python3 -m bench.replay --profile gpu-10min --seed 2 --policies region \
    --out /tmp/krex-replay/gpu-10min-holders.json --daemon-arg=$CG --daemon-arg=--freeze=device-holders
  cp /tmp/krex-replay/gpu-10min-holders.json "$OUT/" 2>/dev/null ;;
5)
  step wakeup_before 60 python3 -m bench.wakeup --pairs 0:1,0:8,3:12 --json "$OUT/wakeup_before.json"
  step overhead 150 python3 -m bench.region_overhead --backends cgroup --siblings 1,4,16,64 \
    --contending '' --regions 100 --daemon-arg=$CG --json "$OUT/region_overhead.json"
  step wakeup_after 60 python3 -m bench.wakeup --pairs 0:1,0:8,3:12 --json "$OUT/wakeup_after.json"
  step ctxpool 150 python3 -m bench.gpu.check_ctxpool
  step pool_start 220 python3 -m bench.pool_start --device cuda --daemon --together 1,16 --rounds 2 \
    --goal 20 --daemon-arg=$CG --json "$OUT/pool_start.json" ;;
6)
  floor
  replay 520 ;;
7)
  for round in 1 2; do for probes in off auto; do
    step "overhead16-$probes-$round" 70 python3 -m bench.region_overhead --backends cgroup \
      --siblings 16 --contending '' --regions 200 --probes $probes --daemon-arg=$CG \
      --json "$OUT/ro16-$probes-$round.json"
  done; done
  step overhead_probes 150 python3 -m bench.region_overhead --backends cgroup --siblings 1,4,64 \
    --contending '' --regions 100 --probes auto --daemon-arg=$CG --json "$OUT/ro-probes.json"
  step host_sync 150 python3 -m bench.gpu.region_host_sync --rounds 12 --reps 60 --daemon-arg=$CG \
    --json "$OUT/host_sync.json" ;;
8)
  step check_probes 130 python3 -m bench.gpu.check_probes --launches 100000 --deadline 110
  step probe_overhead 300 python3 -m bench.probe_overhead --gpu --reps 8 --bursts 200 --launches 500 \
    --flood 0 --seconds 1 --json "$OUT/probe_overhead.json" ;;
esac
grep -E "^=====|^rc=" "$LOG"
