#!/usr/bin/env bash
# Issue 29 (timeout_s 600). The 13.01B under a 16 GB cap, after offload_model's fix (f31dbc1): in the thirtieth
# session every 13.01B run ran out of GPU memory inside offload_model, before its first step, defaults included
# (it held every block's weights in HBM while it sharded them: bench/RESULTS.md, thirtieth session), so whether
# the held sums added from the GPU's kept copies (tiered/offload/accumulation.py SUM_FROM_KEPT) with the allocator's
# expandable segments train it is still open. Its 4.42B and 5.16B runs (thirtieth session, calls 3 and 4) gained
# 4-7 % with both on. (0) the CUDA test of the fix; (1) the defaults; (2) SUM_FROM_KEPT with expandable segments.
# Prediction: (0) passes; (1) trains, steps of 84-88 s (85.9 s in the twenty-fifth session), peak GPU under 14.9
# GiB; (2) trains, peak GPU at most 14.9 GiB, steps of 80-88 s (the link does not bound forward and backward at
# 4 x 2048, so little to gain). If (2) trains, the next change sets expandable segments where SUM_FROM_KEPT is on,
# and turns it on.
source bench/next_calls/ours_with.sh
timeout -k 5 80 python3 -m pytest -m gpu tests/gpu/test_offload_params_cuda.py -k one_units_weights -q \
  -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/offload_one_unit_test.log
L13="--hidden 4096 --layers 63 --heads 32 --inter 11008 --vocab 32000 --seq 2048"
ours_with 13B_16GB_default False 0 260 $L13 --steps 2 --batch 4 --accumulate 8 --gpu-memory-cap 16GB
ours_with 13B_16GB_kept_expandable True 1 $((585 - SECONDS)) $L13 --steps 2 --batch 4 --accumulate 8 \
  --gpu-memory-cap 16GB
say done
