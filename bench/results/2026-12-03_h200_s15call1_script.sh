#!/usr/bin/env bash
# Issue 31 in ONE call (carry [".anchors"]; timeout_s 600): the reference step with the state on NVMe, tiered-bench io
# beside DeepSpeed's libaio and the calibration (disk_compare.py, which installs DeepSpeed once), ZeRO-Infinity on
# the same model (the aio op reused through the same environment), 8-bit moments, then the state-in-DDR step at
# host_budget = state + 10 %, with and without a clip every step. Written in the fourteenth session; not yet run
# (no device time was left for it). Run from the repo root: bash bench/next_calls/issue31_one_call.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say ours
timeout -k 5 120 python3 bench/llama_step.py --steps 5 --deadline 100 --floor-budget 25 --nvme /root/tiered_nvme --host-budget 2GiB --name llama_hb2GiB > $OUT/ours.log 2>&1; echo "ours rc=$?"; grep -v '^{' $OUT/ours.log | tail -6 | cut -c1-300
rm -rf /root/tiered_nvme
say disk_compare
timeout -k 5 160 bash .anchors/run_on_device.sh ../bench/disk_compare.py --dir /root/cmp --out $OUT/disk_compare.json --budget 150 > $OUT/disk_compare.log 2>&1; echo "cmp rc=$?"; tail -3 $OUT/disk_compare.log | cut -c1-1500
rm -rf /root/cmp
say ds_infinity
lib=/tmp/aio/usr/lib/x86_64-linux-gnu
(export PYTHONPATH=/tmp/site:$PYTHONPATH CPATH=/tmp/aio/usr/include LIBRARY_PATH=$lib LD_LIBRARY_PATH=$lib TORCH_CUDA_ARCH_LIST=9.0 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511
 mkdir -p /root/ds_nvme; timeout -k 5 130 python3 .anchors/ds_anchor.py nvme --layers 16 --steps 4 --nvme /root/ds_nvme > $OUT/ds_infinity.log 2>&1; echo "ds rc=$?"); grep '^{' $OUT/ds_infinity.log | tail -1 | cut -c1-800; tail -2 $OUT/ds_infinity.log | cut -c1-300
rm -rf /root/ds_nvme
say int8
timeout -k 5 70 python3 bench/llama_step.py --steps 4 --deadline 55 --floor-budget 10 --nvme /root/tiered_nvme --host-budget 2GiB --moments-dtype int8 --name llama_hb2GiB_int8 > $OUT/int8.log 2>&1; echo "int8 rc=$?"; grep -v '^{' $OUT/int8.log | tail -4 | cut -c1-300
rm -rf /root/tiered_nvme
say ddr
timeout -k 5 90 python3 bench/llama_ab.py --nvme /root/ab --batch 32 --steps 6 --warmup 2 --sync stream --same-start --deadline 75 --name ddr_ab32 --variants 'plain=1;host_budget=state+10%;plain=1,clip=1.0;host_budget=state+10%,max_grad_norm=1.0' > $OUT/ddr.log 2>&1; echo "ab32 rc=$?"
rm -rf /root/ab
python3 - <<'PY'
import json, os
try:
    r = json.load(open(os.path.join(os.environ["OUT"], "ddr_ab32.json")))
    for x in r["runs"]:
        print("ddr", x["variant"], "med", round(x["median_s"], 4), "clip_active", x["clip_active"], "losses", x["losses"][:3])
    print("ddr summary", json.dumps({k: {f: v.get(f) for f in ("median_s", "over_bar", "same_losses")} for k, v in r["summary"].items()}))
except OSError as e:
    print("ddr missing", e)
PY
say done
