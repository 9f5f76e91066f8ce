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
# - the reference step (Llama-0.94B, 8 x 1024, host 2 GiB: the state on NVMe), default (32 x 1 MiB threads) against
#   io=aio:256x8MiB and io=64x1MiB, interleaved: a shape that writes 10-15 % faster above takes 4-7 % off the step
#   (writes are about 40 % of its disk time); one that does not, within the disk's drift (+-5 %).
export PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say "tree: $(grep -c 'regions_aio' bench/disk_streams.py) (a new symbol of this session)"
lsblk -o NAME,SIZE,TYPE,MOUNTPOINT 2>/dev/null | head -8; df -h /root | tail -1
say disk_streams
PYTHONPATH=$PWD timeout -k 5 330 bash .anchors/run_on_device.sh ../bench/disk_streams.py --dir /root/streams \
  --rounds ${ROUNDS:-2} --budget 300 --out $OUT/disk_streams.json > $OUT/disk_streams.log 2>&1; echo "rc=$?"
grep -v -i warning $OUT/disk_streams.log | tail -40 | cut -c1-300
rm -rf /root/streams
[ "${STEP:-1}" = 1 ] || { say done; exit 0; }
say step_ab
PYTHONPATH=$PWD timeout -k 5 ${STEP_S:-260} python3 bench/llama_ab.py --nvme /root/ab --host-budget 2GiB --steps 4 \
  --rounds 2 --deadline $(( ${STEP_S:-260} - 45 )) --name step_ab --variants "${STEP_VARIANTS:-default;io=aio:256x8MiB;io=64x1MiB}" \
  > $OUT/step_ab.log 2>&1; echo "rc=$?"
rm -rf /root/ab
python3 - <<'PY'
import json, os
try:
    r = json.load(open(os.path.join(os.environ["OUT"], "step_ab.json")))
    for x in r["runs"]:
        print("step", x["variant"], "med", round(x["median_s"], 3), "steps", [round(s, 2) for s in x.get("step_s", [])])
    print("summary", json.dumps({k: v.get("median_s") for k, v in r["summary"].items()}))
except (OSError, KeyError, ValueError) as e:
    print("step_ab missing", e)
PY
say done
