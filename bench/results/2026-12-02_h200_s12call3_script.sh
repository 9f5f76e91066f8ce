#!/usr/bin/env bash
# Twelfth session, call 3 (issue 31, one call): the reference step with the state on NVMe, then tiered-bench io
# beside DeepSpeed's libaio and the telemetry's calibration (disk_compare.py), then DeepSpeed ZeRO-Infinity on the
# same model, then 8-bit moments. DeepSpeed's wheel is installed once (run_on_device.sh); ZeRO-Infinity then runs
# with the same environment and no reinstall, so its aio op is not rebuilt.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say ours
timeout -k 10 140 python3 bench/llama_step.py --steps 5 --deadline 115 --floor-budget 30 --nvme /root/tiered_nvme --host-budget 2GiB --name llama_hb2GiB > $OUT/ours.log 2>&1; echo "ours rc=$?"; grep -v '^{' $OUT/ours.log | tail -6 | cut -c1-300
rm -rf /root/tiered_nvme
say disk_compare
timeout -k 10 190 bash .anchors/run_on_device.sh ../bench/disk_compare.py --dir /root/cmp --out $OUT/disk_compare.json --budget 175 > $OUT/disk_compare.log 2>&1; echo "cmp rc=$?"; tail -3 $OUT/disk_compare.log | cut -c1-1500
rm -rf /root/cmp
say ds_infinity
lib=/tmp/aio/usr/lib/x86_64-linux-gnu
(export PYTHONPATH=/tmp/site:$PYTHONPATH CPATH=/tmp/aio/usr/include LIBRARY_PATH=$lib LD_LIBRARY_PATH=$lib TORCH_CUDA_ARCH_LIST=9.0 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511
 mkdir -p /root/ds_nvme; timeout -k 10 150 python3 .anchors/ds_anchor.py nvme --layers 16 --steps 4 --nvme /root/ds_nvme > $OUT/ds_infinity.log 2>&1; echo "ds rc=$?"); grep '^{' $OUT/ds_infinity.log | tail -1 | cut -c1-800; tail -3 $OUT/ds_infinity.log | cut -c1-300
rm -rf /root/ds_nvme
say int8
timeout -k 10 100 python3 bench/llama_step.py --steps 4 --deadline 80 --floor-budget 15 --nvme /root/tiered_nvme --host-budget 2GiB --moments-dtype int8 --name llama_hb2GiB_int8 > $OUT/int8.log 2>&1; echo "int8 rc=$?"; grep -v '^{' $OUT/int8.log | tail -4 | cut -c1-300
rm -rf /root/tiered_nvme
say done
