#!/usr/bin/env bash
# Issue 29 at a 16 GB and a 12 GB cap (carry [".anchors"] for the ds modes; timeout_s 600 each; written in the
# fifteenth session; ours16 and ours12 ran in the twenty-second session, calls 1-3, the ds modes not yet):
# `bash bench/next_calls/caps_16_12.sh MODE`, MODE one of
#   ours16  the 10.0B's layer shape at 60 layers (12.4B), 4 x 2048 x 8 tokens, two steps, under a 16 GB cap
#   ours12  the same model at 2 x 2048 x 16 tokens (half the activations: at 4 x 2048 a micro-batch took 11.2 GiB
#           under the 24 GB cap, all of a 12 GB card), under a 12 GB cap
#   ds16    DeepSpeed ZeRO-Offload on the 4.42B (34 layers of the 3.43B's shape) under a 16 GB cap (it peaked at
#           14.0 GiB under 24 GB), then 40 layers (5.16B) if the 4.42B trained; ours16's tokens
#   ds12    DeepSpeed ZeRO-Offload on the 4.42B under a 12 GB cap, then 40 layers (5.16B) if the 4.42B trained;
#           ours12's tokens (the 3.43B trained there: twenty-second session, call 4)
# Predictions (tiered-bench plan --gpu 16GB|12GB --ram 125GiB --disk 60GB --activations 3GiB: offloaded 13.52B |
# 13.23B, DeepSpeed ZeRO-Offload 4.81B | 2.81B, bound by the GPU): ours trains the 12.4B at both caps, 46 GiB of
# weights and gradients pinned, about 63 GiB of state in DDR, 50-54 GiB on NVMe (1-3 GiB in HBM), steps of 80-95 s
# (disk-bound), first step after 230-260 s; DeepSpeed trains the 4.42B at 16 GB and not the 5.16B, and at 12 GB the
# 2.68B but not the 3.43B: 2.8x and 4.6x.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
L10="--hidden 4096 --heads 32 --inter 11008 --vocab 32000 --seq 2048 --steps 2"
L34="--hidden 3200 --heads 32 --inter 8640 --seq 2048 --steps 3"
ours() {  # cap, batch, accumulate
  say "ours $1 (12.4B, $2 x 2048 x $3)"; df -h / | tail -1
  timeout -k 10 560 python3 examples/big_model.py $L10 --layers 60 --batch $2 --accumulate $3 --gpu-memory-cap $1 \
    --nvme-path /root/big_nvme --json $OUT/ours_$1.jsonl > $OUT/ours_$1.log 2>&1; echo "ours rc=$?"
  grep -v '^{' $OUT/ours_$1.log | tail -24 | cut -c1-300
  rm -rf /root/big_nvme
}
ds() {  # cap, layers, name, batch, accumulate
  say "ds $1 $3 ($4 x 2048 x $5)"
  timeout -k 10 270 bash .anchors/run_on_device.sh ../bench/ds_big.py $L34 --layers $2 --batch $4 --accumulate $5 \
    --gpu-memory-cap $1 --offload cpu \
    --nvme-path /root/ds_nvme --json $OUT/ds_$1_$3.jsonl > $OUT/ds_$1_$3.log 2>&1; rc=$?; echo "ds rc=$rc"
  grep -v '^{' $OUT/ds_$1_$3.log | grep -i "step\|tokens\|peak\|loss\|error\|memory" | tail -8 | cut -c1-300
  rm -rf /root/ds_nvme
  return $rc
}
case "${1:-}" in
  ours16) ours 16GB 4 8 ;;
  ours12) ours 12GB 2 16 ;;
  ds16) ds 16GB 34 4.42B 4 8 && ds 16GB 40 5.16B 4 8 ;;
  ds12) ds 12GB 34 4.42B 2 16 && ds 12GB 40 5.16B 2 16 ;;
  ds_b1) ds 16GB 34 4.42B 1 32; ds 12GB 34 4.42B 1 32 ;;  # a smaller micro-batch where 4 x 2048 and 2 x 2048 ran out
  *) echo "usage: $0 ours16|ours12|ds16|ds12|ds_b1" >&2; exit 2 ;;
esac
say done
