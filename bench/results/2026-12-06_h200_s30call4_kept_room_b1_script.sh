#!/usr/bin/env bash
# Issue 29 (timeout_s 420; written in the twenty-fifth session, not yet run). The 5.16B under a 16 GB cap at
# DeepSpeed's 1 x 2048 x 32 (DeepSpeed ZeRO-Offload: 1,420-1,512 tokens/s, its largest there): ours ran at
# 2,455-2,459 with SUM_FROM_KEPT on (twenty-fifth session, call 2), 8 GiB of state in HBM (`--gpu-budget auto`: a
# micro-batch took 3.44 of 14.90 GiB), 2.31 GiB of sums kept a backward, forward and backward 1.52-1.55x the link's
# floor (891 GB up a step). At 32 micro-batches a step each GiB of sums kept on the GPU saves 31 GiB of the link's
# busy direction, each GiB of state there 2 GiB of the optimizer's: the HBM serves kept sums 15 times better.
# (1) the defaults (SUM_FROM_KEPT off), the figure the 1.5x must stand on; (2) SUM_FROM_KEPT with expandable
# segments and --gpu-budget 0.
# Prediction: (1) 2,290-2,380 tokens/s (1.51-1.68x); (2) 8-9 GiB kept a backward, 250-290 GB a step no longer up the
# link, forward and backward 17-20 s, optimizer 2.0-2.4 s, 2,950-3,450 tokens/s (1.95-2.4x DeepSpeed's).
source bench/next_calls/ours_with.sh
L40="--hidden 3200 --heads 32 --inter 8640 --seq 2048 --layers 40 --steps 3 --batch 1 --accumulate 32 --gpu-memory-cap 16GB"
ours_with 5.16B_16GB_b1_default False 0 190 $L40
ours_with 5.16B_16GB_b1_kept_expandable_budget0 True 1 $((410 - SECONDS)) $L40 --gpu-budget 0
say done
