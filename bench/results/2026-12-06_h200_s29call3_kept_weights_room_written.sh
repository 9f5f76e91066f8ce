#!/usr/bin/env bash
# Issue 29 (timeout_s 600; written in the twenty-sixth session, not yet run). The last blocks' weights kept on the
# GPU from forward to backward as its room allows (`--keep-for-backward room`, tiered/offload/kept_weights.py): at
# small micro-batches each micro-batch sends every block's weights up twice (forward, and again for backward's
# recompute) and the held sums once, and the link's upward direction bounds forward and backward. A block kept
# crosses once. Its room is what a pass leaves: on the 4.42B under 12 GB a micro-batch's forward and backward took
# 4.74 GiB of 11.18, the auto GPU budget put 3 GiB of state in HBM, and backward kept 3.23 GiB of sums for the clip
# (twenty-fourth session, call 4): less the margin (1.70 GiB there) and the optimizer's scratch, room for about 4-8
# of its 34 layers' weights (0.231 GiB each) with the state there, 17-21 without it. Every GiB of weights kept saves 16 GiB a step of the link's upward direction there (2 x
# 2048 x 16), where a GiB of sums kept saved one and a GiB of state two.
# (0) the CUDA test of it (bitwise the run on the GPU, under a cap); (1) the 4.42B under 12 GB at 2 x 2048 x 16 with
# `room` (the defaults ran at 5,257-5,336 tokens/s in three calls, forward and backward 10.9-11.1 s); (2) the same
# with `--gpu-budget 0` (the HBM for weights, not state); (3) the 5.16B under 16 GB at DeepSpeed's 1 x 2048 x 32,
# `room` with `--gpu-budget 0` (40 layers of 0.231 GiB against the 9-10 GiB a pass leaves).
# Prediction: (0) passes; (1) 4-8 layers kept, forward and backward 10.2-10.6 s, 5,400-5,650 tokens/s (1.49-1.56x
# DeepSpeed's 3,622 with its weights offloaded); (2) 17-21 layers kept, forward and backward 9.0-9.6 s, optimizer
# 1.5-1.7 s, 5,800-6,200 tokens/s (1.60-1.71x); (3) 30-40 layers kept, forward and backward 15-18 s, optimizer
# 2.3-3.0 s, 3,000-3,600 tokens/s (2.0-2.5x DeepSpeed's 1,420-1,512; 2,455-2,459 with SUM_FROM_KEPT, twenty-fifth
# session). If they hold, "auto" keeps the last blocks by room where the whole model's weights do not fit, and the
# auto GPU budget gives weights the room before state.
source bench/next_calls/ours_with.sh
say "the CUDA test"
timeout -k 5 150 python3 -m pytest -q -m gpu tests/gpu/test_offload_params_cuda.py -k "room" -p no:cacheprovider 2>&1 \
  | tail -4
L34="--hidden 3200 --heads 32 --inter 8640 --seq 2048 --layers 34 --steps 3 --batch 2 --accumulate 16 --gpu-memory-cap 12GB"
ours_with 4.42B_12GB_room False 0 115 $L34 --keep-for-backward room
ours_with 4.42B_12GB_room_budget0 False 0 115 $L34 --keep-for-backward room --gpu-budget 0
L40="--hidden 3200 --heads 32 --inter 8640 --seq 2048 --layers 40 --steps 2 --batch 1 --accumulate 32 --gpu-memory-cap 16GB"
ours_with 5.16B_16GB_b1_room_budget0 False 0 $((585 - SECONDS)) $L40 --keep-for-backward room --gpu-budget 0
say done
