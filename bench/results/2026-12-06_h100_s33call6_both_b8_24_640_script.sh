#!/usr/bin/env bash
# Issue 29 (carry [".anchors"]; timeout_s 420; thirty-third session): the 6.40B under 24 GB at 8 x 2048 x 4, the
# same 65,536 tokens a step as both_train_24_640.sh in half the micro-batches: ours streams its weights once a
# micro-batch, so forward and backward should move half the bytes over the link (291 GB up at 4 x 2048 x 8).
# Prediction: ours 8.0-9.0 s forward and backward, 6,000-6,800 tokens/s (or out of GPU memory); DeepSpeed, whose
# weights stay on the GPU, 3,800-4,300 tokens/s or out of GPU memory (18.5 GiB peak at 4 x 2048).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say "ours 6.40B under 24 GB at 8 x 2048 x 4"
timeout -k 5 150 python3 examples/big_model.py --hidden 3200 --heads 32 --inter 8640 --seq 2048 \
  --layers 50 --steps 3 --batch 8 --accumulate 4 --gpu-memory-cap 24GB --nvme-path /root/big_nvme \
  --json $OUT/ours_24GB_6.40B_b8.jsonl > $OUT/ours_24GB_6.40B_b8.log 2>&1; echo "ours rc=$?"
grep "^step \|first step\|peak GPU\|peak host\|link,\|OutOfMemory" $OUT/ours_24GB_6.40B_b8.log | tail -10 | cut -c1-250
rm -rf /root/big_nvme
say "DeepSpeed 6.40B under 24 GB at 8 x 2048 x 4"
timeout -k 5 $((400 - SECONDS)) bash .anchors/run_on_device.sh ../bench/ds_big.py --hidden 3200 --heads 32 \
  --inter 8640 --seq 2048 --layers 50 --steps 3 --batch 8 --accumulate 4 --gpu-memory-cap 24GB --offload cpu \
  --nvme-path /root/ds_nvme --json $OUT/ds_24GB_6.40B_b8.jsonl > $OUT/ds_24GB_6.40B_b8.log 2>&1; echo "ds rc=$?"
grep -v '^{' $OUT/ds_24GB_6.40B_b8.log | grep -i "step\|tokens\|peak\|error\|memory" | tail -8 | cut -c1-250
say done
