#!/usr/bin/env bash
# Run as one command (timeout_s 170) with the session's last device time: part (1) of
# bench/next_calls/kept_sums_default.sh, its limit cut to 150 s (two steps reached).
source bench/next_calls/ours_with.sh; L40="--hidden 3200 --heads 32 --inter 8640 --seq 2048 --layers 40 --steps 3 --batch 1 --accumulate 32 --gpu-memory-cap 16GB"; ours_with 5.16B_16GB_b1_kept_expandable True 1 150 $L40; say done
