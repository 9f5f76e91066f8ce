#!/usr/bin/env bash
# Issue 29 (timeout_s 600; written in the fourteenth session, not yet run): the largest exact model under a 24 GB
# cap, the 10.0B's layer shape at 63 layers (13.01B; 2.54x DeepSpeed's largest trained here, the 5.12B of the same
# shape), 65,536 tokens a step, two steps, the optimizer's phases printed after each.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
echo "=== big13 $(date +%T)"; df -h / | tail -1; free -g | head -2
timeout -k 10 570 python3 examples/big_model.py --hidden 4096 --layers 63 --heads 32 --inter 11008 --vocab 32000 \
  --seq 2048 --batch 4 --accumulate 8 --steps 2 --gpu-memory-cap 24GB --nvme-path /root/big_nvme \
  --json $OUT/big13.jsonl > $OUT/big13.log 2>&1; echo "big13 rc=$?"
grep -v '^{' $OUT/big13.log | tail -30 | cut -c1-300
df -h / | tail -1
rm -rf /root/big_nvme
