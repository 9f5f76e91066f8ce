#!/usr/bin/env bash
# Issue 29 (carry [".anchors"]; timeout_s 600; written in the twenty-fifth session, not yet run): "on the largest
# model both train under the cap, >= 1.5x DeepSpeed's tokens/s" under 24 GB. DeepSpeed ZeRO-Offload trained the
# 5.16B under a 16 GB cap (twenty-fourth session), so its largest under 24 GB is at least that, not the 4.42B the
# comparisons there have used (ours 1.29-1.35x). DeepSpeed on the 5.16B under 24 GB at 4 x 2048 x 8 (at 2 x 2048 x 16
# where that runs out of GPU memory), then ours at 4 x 2048 x 8, three steps each.
# Prediction: DeepSpeed at 4 x 2048 x 8: its 4.42B's 5,990-6,273 tokens/s scaled by 4.42/5.16, 5,100-5,400, peak GPU
# 16-17 GiB, about 100 GiB of RAM (or out of GPU memory, and 4,700-5,100 at 2 x 2048 x 16); ours: the 4.42B's
# 8,155-8,194 scaled, 6,900-7,100 tokens/s: 1.3-1.4x, short of 1.5x as on the 4.42B.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
DS_LIMIT=260 bash bench/next_calls/ds_capacity.sh b4_24
if grep -q "OutOfMemoryError" $OUT/ds_24GB_5.16B_b4.log; then DS_LIMIT=200 bash bench/next_calls/ds_capacity.sh b2_24; fi
say "ours 5.16B under 24 GB at 4 x 2048 x 8"
timeout -k 5 $((590 - SECONDS)) python3 examples/big_model.py --hidden 3200 --heads 32 --inter 8640 --seq 2048 \
  --layers 40 --steps 3 --batch 4 --accumulate 8 --gpu-memory-cap 24GB --nvme-path /root/big_nvme \
  --json $OUT/ours_24GB_5.16B.jsonl > $OUT/ours_24GB_5.16B.log 2>&1; echo "ours rc=$?"
grep "^step \|first step\|peak GPU\|peak host" $OUT/ours_24GB_5.16B.log | tail -8 | cut -c1-250
rm -rf /root/big_nvme
say done
