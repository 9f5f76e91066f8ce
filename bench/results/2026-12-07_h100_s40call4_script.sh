#!/usr/bin/env bash
# Issue 29, after the 8-bit codes' kernels, the records' downloads on their own stream and three chunks in flight
# (fortieth session): compute alone and the step of the 4.42B under a 24 GB cap at 8 x 2048 x 4 (65,536 tokens),
# fp32 and 8-bit moments, on one host. One call, timeout_s 600, no carry.
# Predictions: the optimizer, 1.45 s (fp32) and 1.26 s (8-bit) at this shape on the H200 before (thirty-ninth
# session), falls by what the step-alone benchmark showed (fp32 1.09x -> 1.00x its floor, 8-bit 2.4x -> 1.05x):
# fp32 about 1.3 s, 8-bit about 0.6-0.7 s; forward and backward unchanged; so 8 x 4 at about 1.28x (fp32) and
# 1.17x (8-bit) compute alone on an H200 (1.31x and 1.28x before). On an H100 compute alone is slower and the
# optimizer's share smaller.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
S="--hidden 3200 --layers 34 --heads 32 --inter 8640 --seq 2048"
say "compute alone"
timeout -k 5 150 python3 bench/compute_alone.py $S --batch 8 --accumulate 4 --fit-layers 4,8 --steps 3 \
  --json $OUT/alone_b8a4.json > $OUT/alone_b8a4.log 2>&1; echo "rc=$?"; tail -2 $OUT/alone_b8a4.log | cut -c1-200
for m in int8 fp32; do
  say "the example, moments $m"
  timeout -k 5 170 python3 examples/big_model.py $S --batch 8 --accumulate 4 --steps 3 --gpu-memory-cap 24GB \
    --nvme-path /root/big_nvme --moments-dtype $m --json $OUT/ex_b8a4_$m.jsonl > $OUT/ex_b8a4_$m.log 2>&1; echo "rc=$?"
  grep "^step \|link, whole\|optimizer:\|peak GPU\|out of memory" $OUT/ex_b8a4_$m.log | tail -7 | cut -c1-220
  rm -rf /root/big_nvme
done
say done
