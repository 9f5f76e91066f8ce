#!/usr/bin/env bash
# Issue 29, "the GPU stays busy" (timeout_s 600; thirty-ninth session). The 4.42B under a 24 GB cap at 4 x 2048 x 8
# took 1.38x compute alone on an H100 (thirty-fourth session): forward and backward 1.16x, and the offloaded
# update's 1.40 s after backward (1.11x its own link floor). Which shapes move the ratio, on one host:
# (1) compute alone and (2) the example at 4 x 2048 x 8, fp32 moments: the baseline again on this host;
# (3) the same with 8-bit moments: the optimizer's link bytes fall from 107 GB to about 56 GB;
# (4) compute alone and (5) the example at 8 x 2048 x 4 (the same 64K tokens a step in half the micro-batches:
# half the weights streamed up, 3 held gradient sums up instead of 7, half the kernel launches a token);
# (6) 4 x 2048 x 16 (128K tokens a step; compute alone from (1) doubled less one intercept... measured in (7)).
# Predictions: (2) step 8.6-8.7 s, 1.37-1.39x (1); (3) optimizer 0.6-0.8 s, step 1.25-1.29x (1); (5) forward and
# backward 1.06-1.10x (4), the optimizer 1.40 s as in (2), step 1.30-1.35x (4), peak GPU under 22 GiB (the auto
# budget adapts) or out of memory; (6) step 1.26-1.28x (7).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
S="--hidden 3200 --layers 34 --heads 32 --inter 8640 --seq 2048"
alone() {  # name batch accumulate
  say "compute alone $1"
  timeout -k 5 150 python3 bench/compute_alone.py $S --batch $2 --accumulate $3 --fit-layers 4,8 --steps 3 \
    --json $OUT/alone_$1.json > $OUT/alone_$1.log 2>&1; echo "rc=$?"; tail -2 $OUT/alone_$1.log | cut -c1-200
}
example() {  # name batch accumulate extra...
  local n=$1 b=$2 a=$3; shift 3
  say "the example $n"
  timeout -k 5 140 python3 examples/big_model.py $S --batch $b --accumulate $a --steps 3 --gpu-memory-cap 24GB \
    --nvme-path /root/big_nvme --json $OUT/ex_$n.jsonl "$@" > $OUT/ex_$n.log 2>&1; echo "rc=$?"
  grep "^step \|link, whole\|optimizer:\|peak GPU\|out of memory" $OUT/ex_$n.log | tail -7 | cut -c1-220; rm -rf /root/big_nvme
}
alone b4a8 4 8
example b4a8 4 8
example b4a8_int8 4 8 --moments-dtype int8
alone b8a4 8 4
example b8a4 8 4
alone b4a16 4 16
example b4a16 4 16
say done
