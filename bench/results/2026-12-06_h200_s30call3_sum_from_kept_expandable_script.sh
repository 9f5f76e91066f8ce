#!/usr/bin/env bash
# Issue 29 (timeout_s 600; written in the twenty-fifth session, not yet run). The held sums added from the GPU's
# kept copies (tiered/offload/accumulation.py SUM_FROM_KEPT) with the allocator's expandable segments
# (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which give back the pages a live tensor does not use. In the
# twenty-fifth session SUM_FROM_KEPT took 4-7 % off the 4.42B's forward and backward under a 12 GB cap, but the
# 13.01B under 16 GB ran out of GPU memory in its first step with 11.84 GiB allocated and 2.09 GiB reserved but free
# (bench/results/2026-12-04_h200_s25call3_*): fragmentation, by those figures.
# Prediction: (1) the 13.01B under 16 GB, SUM_FROM_KEPT and expandable segments: trains, peak GPU at most 14.9 GiB,
# steps of 84-88 s (the default's 85.9: the link does not bound forward and backward at 4 x 2048); (2) the 4.42B
# under 12 GB, SUM_FROM_KEPT and expandable: 5,250-5,650 tokens/s (5,442-5,660 with SUM_FROM_KEPT alone, 5,257-5,291
# without); (3) the same with --gpu-budget 0: the HBM the auto budget gave 3 GiB of state goes to kept sums instead
# (each GiB kept saves 15 GiB of the link's busy direction a step, each GiB of state 2 GiB of the optimizer's), about
# 6 GiB kept a backward against 3.2: forward and backward 9.4-9.9 s, optimizer 1.40-1.50 s, 5,700-6,100 tokens/s
# (1.57-1.68x DeepSpeed's 3,622 with its weights offloaded). If (1) trains and (2) keeps the gain, the next change
# sets expandable segments where SUM_FROM_KEPT is on, and turns it on; if (3) wins, the auto budget gives kept sums
# the HBM before state.
source bench/next_calls/ours_with.sh
L13="--hidden 4096 --layers 63 --heads 32 --inter 11008 --vocab 32000 --seq 2048"
L34="--hidden 3200 --heads 32 --inter 8640 --seq 2048 --layers 34"
ours_with 13B_16GB_kept_expandable True 1 330 $L13 --steps 2 --batch 4 --accumulate 8 --gpu-memory-cap 16GB
ours_with 4.42B_12GB_kept_expandable True 1 120 $L34 --steps 3 --batch 2 --accumulate 16 --gpu-memory-cap 12GB
ours_with 4.42B_12GB_kept_expandable_budget0 True 1 $((585 - SECONDS)) $L34 --steps 3 --batch 2 --accumulate 16 \
  --gpu-memory-cap 12GB --gpu-budget 0
say done
