#!/usr/bin/env bash
# Twenty-ninth session, call 3 (timeout_s 400, same warm H200): kept_weights_room.sh's 12 GB rows with the defaults
# run in the same call as their baseline (bench/next_calls/room12.sh without DeepSpeed, for the time left).
source bench/next_calls/ours_with.sh; nvidia-smi --query-gpu=name --format=csv,noheader; L34="--hidden 3200 --heads 32 --inter 8640 --seq 2048 --layers 34 --steps 3 --batch 2 --accumulate 16 --gpu-memory-cap 12GB"; ours_with 4.42B_12GB_room False 0 118 $L34 --keep-for-backward room; ours_with 4.42B_12GB_room_budget0 False 0 118 $L34 --keep-for-backward room --gpu-budget 0; ours_with 4.42B_12GB_defaults False 0 $((395 - SECONDS)) $L34; say done
