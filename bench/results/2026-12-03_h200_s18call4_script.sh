#!/usr/bin/env bash
# Issue 29 (carry [".anchors"]; timeout_s 600; written in the eighteenth session): the clip's copies of the
# offloaded gradients kept on the GPU for the update (tiered/optim/shards.py total_norm_on's `kept`,
# auto_budget.grad_room), with the next block's weights copied ahead (offload_prefetch.py, call 3), then
# DeepSpeed ZeRO-Offload on the same model in the same call (the 1.5x tokens/s target).
# Before (call 3): optimizer 1.47 s, its host-to-device bytes 67.7 GB (the norm's 8.7 GB of gradients, records
# 41.3, the gradients again 8.8, the split masters' bf16 halves 8.7), device-to-host 50.2; step 7.75 s, 8,460
# tokens/s. Prediction: host-to-device 58.9 GB, the optimizer 1.30-1.35 s, the step 7.58-7.65 s, 8,570-8,650
# tokens/s; DeepSpeed 5,400-5,800 (its 4,680-5,720 over four sessions): 1.48-1.6x.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say gpu_tests
timeout -k 5 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_offload_params_cuda.py \
  -k "kept_on_the_gpu or (cannot_fit and bf16)" > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?"
tail -4 $OUT/gpu_tests.log | cut -c1-300
C="--hidden 3200 --layers 34 --heads 32 --inter 8640 --seq 2048 --gpu-memory-cap 24GB --steps 3 --batch 4 --accumulate 8"
say ours44
timeout -k 5 170 python3 examples/big_model.py $C --nvme-path /root/big_nvme --json $OUT/big44.jsonl > $OUT/big44.log 2>&1
echo "ours rc=$?"; grep -v '^{' $OUT/big44.log | grep "step \|optimizer:\|peak\|first step" | tail -12 | cut -c1-300
rm -rf /root/big_nvme
say ds44
timeout -k 5 230 bash .anchors/run_on_device.sh ../bench/ds_big.py $C --offload cpu --nvme-path /root/ds_nvme \
  --json $OUT/ds44.jsonl > $OUT/ds44.log 2>&1; echo "ds rc=$?"
grep -v '^{' $OUT/ds44.log | grep -i "step\|tokens\|peak" | tail -8 | cut -c1-300
rm -rf /root/ds_nvme
say done
