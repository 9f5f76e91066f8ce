#!/usr/bin/env bash
# Issue 29 (carry [".anchors"]; timeout_s 600; twentieth session). Part 1: the nineteenth session's resident.sh
# found tests/gpu/test_offload_params_cuda.py's kept-copies test failing where the clip keeps no copy on the GPU
# (grad_room forced to 0: the update sends every host gradient up through the staging rows): which parameters
# differ, with and without the clip, with the staging synchronised, one chunk in flight, the worker's sums
# (bench/next_calls/room0_diag.py). Part 2: tokens44.sh's runs (ours with resident_grads now on, DeepSpeed
# ZeRO-Offload) without its tests. Prediction for ours: the step 7.4-7.9 s on this kind of host, 1.3-1.45x DS.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say diag
timeout -k 5 200 python3 bench/next_calls/room0_diag.py > $OUT/diag.log 2>&1; echo "diag rc=$?"
grep -v "tiered: parameters\|Warning\|warn" $OUT/diag.log | tail -14 | cut -c1-400
rm -rf /root/diag
C="--hidden 3200 --layers 34 --heads 32 --inter 8640 --seq 2048 --gpu-memory-cap 24GB --steps 3 --batch 4 --accumulate 8"
say ours44
timeout -k 5 130 python3 examples/big_model.py $C --nvme-path /root/big_nvme --json $OUT/big44.jsonl > $OUT/big44.log 2>&1
echo "ours rc=$?"; grep "^step \|gradient sums\|on the GPU for\|peak" $OUT/big44.log | tail -9 | cut -c1-260
rm -rf /root/big_nvme
say ds44
timeout -k 5 240 bash .anchors/run_on_device.sh ../bench/ds_big.py $C --offload cpu --nvme-path /root/ds_nvme \
  --json $OUT/ds44.jsonl > $OUT/ds44.log 2>&1; echo "ds rc=$?"
grep -v '^{' $OUT/ds44.log | grep -i "step\|tokens\|peak" | tail -8 | cut -c1-300
rm -rf /root/ds_nvme
say done
