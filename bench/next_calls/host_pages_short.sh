#!/usr/bin/env bash
# host_pages.sh without DeepSpeed (for a call with under 300 s of device time left): the fork check, then
# `tiered-bench io` at 64 x 1 MiB and the reference step, each with the new buffers and with the shared ones of
# before (bench/shared_buffers.py), interleaved (STEP_VARIANTS= leaves the step out; IO_VARIANTS sets the io runs). Predictions: host_pages.sh's (io 1.1-1.3x the shared buffers'
# rates; the step 8-15 % shorter). Run from the repo root: bash bench/next_calls/host_pages_short.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
say() { echo "=== [+${SECONDS}s] $*"; }
say "tree: $(grep -c '_WIPEONFORK' io_engine/hugepages.py) (a new symbol of the forty-second session)"
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled /sys/block/vda/queue/max_segments 2>&1
say fork
timeout -k 5 40 python3 bench/fork_pinned.py 8
cli=$(python3 -c "import tiered.cli as c; print(c.__file__)")
say io
for v in ${IO_VARIANTS-new shared shared new}; do
  pre=""; [ $v = shared ] && pre="bench/shared_buffers.py"
  timeout -k 5 40 python3 $pre $cli io --dir /root/io_$v --size 4GiB --threads 64 --block-sizes 1MiB --warmup 0 --loops 1 --no-fio --json -q > $OUT/io_$v.json 2>$OUT/io_$v.err
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); r=d['sweep'][0]; print(sys.argv[2], 'read', r['read_gbps']['median'], 'write', r['write_gbps']['median'])" $OUT/io_$v.json $v || tail -3 $OUT/io_$v.err
done
say step
for v in ${STEP_VARIANTS-new shared}; do
  pre=""; [ $v = shared ] && pre="bench/shared_buffers.py"
  timeout -k 5 70 python3 $pre bench/llama_step.py --steps 4 --deadline 62 --floor-budget 0 \
    --nvme /root/tiered_nvme --host-budget 2GiB --name step_$v > $OUT/step_$v.log 2>&1; echo "$v rc=$?"
  grep -E "step [0-9]" $OUT/step_$v.log | tail -4 | cut -c1-160
  rm -rf /root/tiered_nvme
done
say done
