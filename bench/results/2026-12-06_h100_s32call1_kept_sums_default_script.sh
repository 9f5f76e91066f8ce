#!/usr/bin/env bash
# Issue 29 (timeout_s 600). Whether the held sums added from the GPU's kept copies (tiered/offload/accumulation.py
# SUM_FROM_KEPT) with the allocator's expandable segments can become the default. Measured so far (bench/RESULTS.md,
# thirtieth and thirty-first sessions): 2-7 % more tokens/s on the 4.42B under 12 GB, 5-7 % on the 5.16B under 16 GB
# with --gpu-budget 0, and the 13.01B trains under 16 GB with both on. Not yet measured with both on: the 5.16B under
# 16 GB with the auto budget (the default), and the 13.01B under 12 GB (the smallest cap it trains under).
# (0) the 5.16B, 16 GB, 1 x 2048 x 32, the defaults, and (1) the same with both on (the auto budget), in one call: the
# thirty-first session's call 5 ran (1) alone on an H100 (2,489 tokens/s at step 1, forward and backward 24.7 s,
# 46 GB a step added from kept copies; the auto budget put 9 GiB of state in HBM) with no defaults beside it;
# (2) the 13.01B, 12 GB, 4 x 2048 x 8, both on, two steps.
# Prediction: (1) 3-7 % above (0), peak GPU under 14.9 GiB; (2) trains, peak GPU under 11.2 GiB, steps of 80-95 s
# (disk-bound). If (1) gains and (2) trains, SUM_FROM_KEPT goes on where the allocator's expandable segments are on.
source bench/next_calls/ours_with.sh
L40="--hidden 3200 --heads 32 --inter 8640 --seq 2048 --layers 40 --steps 3 --batch 1 --accumulate 32 --gpu-memory-cap 16GB"
ours_with 5.16B_16GB_b1_default False 0 170 $L40
ours_with 5.16B_16GB_b1_kept_expandable True 1 170 $L40
L13="--hidden 4096 --layers 63 --heads 32 --inter 11008 --vocab 32000 --seq 2048"
ours_with 13B_12GB_kept_expandable True 1 $((590 - SECONDS)) $L13 --steps 2 --batch 4 --accumulate 8 \
  --gpu-memory-cap 12GB
say done
