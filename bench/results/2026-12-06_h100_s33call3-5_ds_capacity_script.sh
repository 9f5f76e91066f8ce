#!/usr/bin/env bash
# Issue 29 (carry [".anchors"]; timeout_s 600 a mode; written in the twenty-third session; b1_16, params12 and
# params12_big ran in the twenty-fourth, calls 3-6 and 8, bench/RESULTS.md): how large
# a model DeepSpeed trains under 16 and 12 GB caps, its weights on the GPU and off it.
# `bash bench/next_calls/ds_capacity.sh MODE`, MODE one of
#   b1_16     ZeRO-Offload (ZeRO-3, the optimizer on the CPU, the weights on the GPU) on the 5.16B (40 layers of
#             the 3.43B's shape) under a 16 GB cap at 1 x 2048 x 32: the 4.42B trained there at that micro-batch
#             (peak 11.8 GiB) and ran out of memory at 4 x 2048 x 8 (twenty-third session, calls 5-6)
#   params12  the weights off the GPU too (--offload-param cpu, ZeRO-3's offload_param) on the 4.42B under a 12 GB
#             cap at 2 x 2048 x 16, where ZeRO-Offload ran out of memory at 2 and 1 x 2048 (calls 4, 6)
#   params12_big  the same on ours12's 12.4B (60 layers of the 10.0B's shape), the optimizer on NVMe (its 149 GB
#             of state does not fit 125 GiB of RAM): one step
#   nvme12_big    the same, the weights on NVMe too (--offload-param nvme): ZeRO-Infinity whole
#   b4_24, b2_24  ZeRO-Offload on the 5.16B under a 24 GB cap at 4 x 2048 x 8 and 2 x 2048 x 16 (bench/next_calls/
#             both_train_24.sh runs them beside ours; DS_LIMIT: the seconds a mode may take, default 580)
#   largest_24  ZeRO-Offload's largest under a 24 GB cap, 4 x 2048 x 8, two steps, at most 275 s a model: the 6.03B
#             (47 layers of the 3.43B's shape); then the 6.40B (50 layers) if it trained, else the 5.65B (44)
#   at_24     the same at LAYERS layers (STEPS steps, default 2), one model (the 6.77B at 53)
# Predictions: b1_16 trains (10.3 GB of bf16 weights, peak 13.0-14.0 GiB), 1,700-2,100 tokens/s; params12 trains
# the 4.42B (peak under 8 GiB), below ZeRO-Offload's 4,300-4,900 tokens/s on the 3.43B (the weights cross the link
# twice a micro-batch); params12_big: DeepSpeed's initialize and first step take longer than 560 s, or its pinned
# host memory runs out: the run says which; nvme12_big likewise. largest_24 (thirty-third session): its RAM grew
# 18.8 GiB a billion parameters on the 5.16B (97.0 GiB) and ran out at the 6.74B, so the 6.03B trains near 113
# GiB of RAM (peak GPU near 18 GiB), the 6.40B runs out of RAM: DeepSpeed's largest under 24 GB is 6.03B.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
L34="--hidden 3200 --heads 32 --inter 8640 --seq 2048"
L10="--hidden 4096 --heads 32 --inter 11008 --vocab 32000 --seq 2048"
ds() {  # name, seconds, flags...
  local name=$1 limit=$2; shift 2
  say "ds $name: $*"
  timeout -k 10 ${DS_LIMIT:-$limit} bash .anchors/run_on_device.sh ../bench/ds_big.py "$@" --nvme-path /root/ds_nvme \
    --json $OUT/ds_$name.jsonl > $OUT/ds_$name.log 2>&1; echo "ds rc=$?"
  grep -v '^{' $OUT/ds_$name.log | grep -i "step\|tokens\|peak\|loss\|error\|memory\|initialize" | tail -10 \
    | cut -c1-300
  rm -rf /root/ds_nvme
}
case "${1:-}" in
  b1_16) ds 16GB_5.16B_b1 580 $L34 --layers 40 --steps 3 --batch 1 --accumulate 32 --gpu-memory-cap 16GB \
    --offload cpu ;;
  params12) ds 12GB_4.42B_params 580 $L34 --layers 34 --steps 2 --batch 2 --accumulate 16 --gpu-memory-cap 12GB \
    --offload cpu --offload-param cpu ;;
  params12_big) ds 12GB_12.4B_params 580 $L10 --layers 60 --steps 1 --batch 2 --accumulate 16 \
    --gpu-memory-cap 12GB --offload nvme --offload-param cpu ;;
  nvme12_big) ds 12GB_12.4B_nvme 580 $L10 --layers 60 --steps 1 --batch 2 --accumulate 16 \
    --gpu-memory-cap 12GB --offload nvme --offload-param nvme ;;
  b4_24) ds 24GB_5.16B_b4 580 $L34 --layers 40 --steps 3 --batch 4 --accumulate 8 --gpu-memory-cap 24GB \
    --offload cpu ;;
  b2_24) ds 24GB_5.16B_b2 580 $L34 --layers 40 --steps 3 --batch 2 --accumulate 16 --gpu-memory-cap 24GB \
    --offload cpu ;;
  largest_24)
    trained() { grep -q '"step_s"' "$OUT/ds_$1.jsonl" 2>/dev/null; }
    export DS_LIMIT=275
    ds 24GB_6.03B_b4 275 $L34 --layers 47 --steps 2 --batch 4 --accumulate 8 --gpu-memory-cap 24GB --offload cpu
    if trained 24GB_6.03B_b4; then
      ds 24GB_6.40B_b4 275 $L34 --layers 50 --steps 2 --batch 4 --accumulate 8 --gpu-memory-cap 24GB --offload cpu
    else
      ds 24GB_5.65B_b4 275 $L34 --layers 44 --steps 2 --batch 4 --accumulate 8 --gpu-memory-cap 24GB --offload cpu
    fi ;;
  at_24) ds 24GB_L${LAYERS}_b4 580 $L34 --layers "$LAYERS" --steps "${STEPS:-2}" --batch 4 --accumulate 8 --gpu-memory-cap 24GB \
    --offload cpu ;;
  *) echo "usage: $0 b1_16|params12|params12_big|nvme12_big|b4_24|b2_24|largest_24|at_24 (LAYERS=)" >&2; exit 2 ;;
esac
say done
