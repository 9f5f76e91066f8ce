#!/usr/bin/env bash
# Issue 29, after codec_profile.sh: the optimizer's step alone with the 8-bit codes' kernels and the records'
# downloads on a stream of their own (both in the code now), against the download on the work stream as before
# (`workdown`), the codes in torch ops (`torchcodec`) and three chunks in flight (`in3`); then the CUDA tests of
# part 2 and part 3 (gpu_all.sh). One call, timeout_s 600, no carry.
# Predictions (fortieth session, from codec_profile.sh's run on an H100, 1.0B): plain as that run's `down` variant,
# 8-bit 0.108 s (1.31x its link floor), fp32 0.223 s (1.11x); `workdown` as its plain (0.121 and 0.227 s);
# `in3`: the upload of chunk i+2 no longer waits for chunk i's update, so a record takes max(up, down, update) not
# up + update: 8-bit near its floor (under 1.1x, 0.09 s), fp32 1.0-1.05x.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout -k 10 ${LIMIT:-300} python3 bench/update_profile.py --params ${PARAMS:-1.0B} --variants workdown,torchcodec,in3 \
  --host-budget 30GiB --json $OUT/update_profile.json 2>&1 | grep -v USDT | cut -c1-400
LIMIT=100 bash bench/next_calls/gpu_all.sh 2 | tail -8
LIMIT=150 bash bench/next_calls/gpu_all.sh 3 | tail -25
echo "rc=$?"
