#!/usr/bin/env bash
# Ran as the twenty-fourth session's call 1 (bench/RESULTS.md).
# Issue 29 (timeout_s 600; written in the twenty-third session, not yet run): ours on the largest models DeepSpeed
# ZeRO-Offload trains under the 12 and 16 GB caps (twenty-second and twenty-third sessions): the 3.43B (26 layers
# of the 4.42B's shape) under 12 GB at its 2 x 2048 x 16 (DeepSpeed 4,302-4,920 tokens/s), the 4.42B under 16 GB
# at 4 x 2048 x 8 (where DeepSpeed ran out of GPU memory) and at DeepSpeed's 1 x 2048 x 32 (2,006-2,305 tokens/s).
# Prediction: each micro-batch sends its weights up twice (forward and backward; at these caps few are kept) and
# its held sums once, about 3 bytes a parameter at 45-50 GB/s, more than its compute at 2 x 2048 and 1 x 2048:
# the 3.43B 7,500-9,500 tokens/s (1.5-2.2x); the 4.42B 6,500-8,000 at 4 x 2048 and 3,000-4,500 at 1 x 2048
# (1.3-2.2x DeepSpeed's at its own micro-batch).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
L34="--hidden 3200 --heads 32 --inter 8640 --seq 2048 --steps 3"
ours() {  # name, cap, layers, batch, accumulate, seconds
  say "ours $1 ($2, $4 x 2048 x $5)"
  timeout -k 5 $6 python3 examples/big_model.py $L34 --layers $3 --batch $4 --accumulate $5 --gpu-memory-cap $2 \
    --nvme-path /root/big_nvme --json $OUT/ours_$1.jsonl > $OUT/ours_$1.log 2>&1; echo "ours rc=$?"
  grep "^step \|gradients on the GPU\|peak\|first step\|Error" $OUT/ours_$1.log | tail -9 | cut -c1-260
  rm -rf /root/big_nvme
}
ours 12GB_3.43B 12GB 26 2 16 170
ours 16GB_4.42B 16GB 34 4 8 170
ours 16GB_4.42B_b1 16GB 34 1 32 $((590 - SECONDS))
say done
