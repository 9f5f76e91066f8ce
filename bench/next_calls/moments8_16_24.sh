#!/usr/bin/env bash
# Issue 29 (timeout_s 600 a mode; written in the twenty-fifth session, not yet run): the issue's "report ours with
# fp32 and with 8-bit moments ... at a 16 GB and a 12 GB cap". The 20.3B with 8-bit moments trained under 12 GB
# (twenty-fourth session, call 7: steps of 56-60 s, first step after 223 s, peak GPU 9.9 GiB, 119.2 GiB of RAM)
# and took one step under 24 GB (eleventh session; the second was cut by the call's limit).
# `bash bench/next_calls/moments8_16_24.sh 16|24`: the same model and micro-batches (2 x 2048 x 4), two steps.
# Prediction: trains under both; under 16 GB as under 12 (none of the state in HBM, 45 GiB on NVMe), steps of
# 55-62 s, peak GPU under 14 GiB; under 24 GB 4-6 GiB of the state in HBM, steps of 50-58 s, peak GPU under 21 GiB;
# first step after 210-240 s (the initial records bound for NVMe allocated, not written). 3.9x the 5.16B
# DeepSpeed ZeRO-Offload trains under 16 GB (and so under 24).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
case "${1:-}" in
  16|24) ;;
  *) echo "usage: $0 16|24" >&2; exit 2 ;;
esac
say "ours ${1}GB 20.3B int8 (2 x 2048 x 4)"; df -h / | tail -1
timeout -k 10 570 python3 examples/big_model.py --hidden 6144 --layers 44 --heads 48 --inter 16384 --vocab 32000 \
  --seq 2048 --batch 2 --accumulate 4 --steps 2 --gpu-memory-cap ${1}GB --moments-dtype int8 \
  --nvme-path /root/big_nvme --json $OUT/ours20_${1}GB.jsonl > $OUT/ours20_${1}GB.log 2>&1; echo "ours rc=$?"
grep -v '^{' $OUT/ours20_${1}GB.log | grep -v "^\[rank0\]:  " | tail -24 | cut -c1-300
rm -rf /root/big_nvme
say done
