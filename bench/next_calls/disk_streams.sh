#!/usr/bin/env bash
# Issue 31, the write gap (forty-first session): how a 4 GiB overwrite reaches the disk, DeepSpeed's libaio handle
# beside our engine and libaio's own pattern sent through our kernel AIO calls, interleaved and mirrored in one
# process (bench/disk_streams.py). Run with carry [".anchors"] from the repo root: bash bench/next_calls/disk_streams.sh
#
# Predictions, written before the call:
# - engine:threads:64x1MiB and engine:aio:256x8MiB write at 0.80-0.88x ds (as every earlier call), read 0.85-1.0x;
# - if several sequential streams from several submitters are what the engine lacks: regions:8x32x8MiB writes within
#   5 % of ds and regions:1x256x8MiB (one submitter, one stream) no better than engine:aio (0.80-0.88x);
#   otherwise every variant of ours stays 0.80-0.88x, and the gap is in how DeepSpeed's C++ submits, not the pattern.
# - the GPU machine's disk: virtio with several hardware queues (one a vCPU).
export PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say "tree: $(grep -c 'regions_aio' bench/disk_streams.py) (a new symbol of this session)"
lsblk -o NAME,SIZE,TYPE,MOUNTPOINT 2>/dev/null | head -8; df -h /root | tail -1
say disk_streams
PYTHONPATH=$PWD timeout -k 5 330 bash .anchors/run_on_device.sh ../bench/disk_streams.py --dir /root/streams \
  --rounds ${ROUNDS:-2} --budget 300 --out $OUT/disk_streams.json > $OUT/disk_streams.log 2>&1; echo "rc=$?"
grep -v -i warning $OUT/disk_streams.log | tail -40 | cut -c1-300
rm -rf /root/streams
say done
