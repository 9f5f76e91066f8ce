#!/usr/bin/env bash
# Ran as the twenty-fourth session's call 7 (bench/RESULTS.md).
# Issue 29 (timeout_s 600; written in the twenty-third session, not yet run): ours with 8-bit moments under a
# 12 GB cap, the "fp32 and 8-bit moments at 16 and 12 GB": the 20.3B that took a step under 24 GB
# (eleventh session: 6 GiB of state in HBM, 34.1 GiB in DDR, 39.2 GiB on NVMe, a step of 73.7 s, first after 243 s,
# peak host 120.4 GiB), at 2 x 2048 x 4 (half the micro-batch). Prediction: no state in HBM under 12 GB, so about
# 45 GiB on NVMe; the first step (16,384 tokens) after 260-320 s, steps of 80-100 s (disk-bound); peak GPU under
# 10.5 GiB; it is 1.6x the 12.4B trained there with fp32 moments and 4.6x the 4.42B DeepSpeed cannot.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say "ours 12GB 20.3B int8 (2 x 2048 x 4)"; df -h / | tail -1
timeout -k 10 570 python3 examples/big_model.py --hidden 6144 --layers 44 --heads 48 --inter 16384 --vocab 32000 \
  --seq 2048 --batch 2 --accumulate 4 --steps 2 --gpu-memory-cap 12GB --moments-dtype int8 \
  --nvme-path /root/big_nvme --json $OUT/ours20_12GB.jsonl > $OUT/ours20_12GB.log 2>&1; echo "ours rc=$?"
grep -v '^{' $OUT/ours20_12GB.log | grep -v "^\[rank0\]:  " | tail -24 | cut -c1-300
rm -rf /root/big_nvme
say done
