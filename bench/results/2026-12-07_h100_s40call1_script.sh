#!/usr/bin/env bash
# Issue 29: where the offloaded update's time goes, and the 8-bit codes' Triton kernels (codec_kernels.py) on a GPU.
# One call (timeout_s 480, no carry): the kernels' CUDA tests against the torch ops and the serial twins, then
# bench/update_profile.py on 1.0B bf16 parameters (state in DDR, updated on the GPU), fp32 and 8-bit moments, each
# plain (the kernels), `torchcodec` (the codes in torch ops, as before) and `down` (the record's copy down on a
# stream of its own).
# Predictions (fortieth session, before the run): with the torch ops an 8-bit record's update takes about twice its
# link floor, as on the 4.42B (4.6 ms against 2.2); the kernels take 1.5-1.8 ms of HBM passes off each record (about
# 40 full passes over a 64 MB fp32 row at ~3 TB/s), so 8-bit moments end near 1.2-1.4x their floor; `down` lets a
# record's update run beside the previous one's copy down: little for fp32 (link-bound, under 5 %), up to a third
# off 8-bit with the torch ops, and the rest of the way to the floor with the kernels.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout -k 10 200 python3 -m pytest -m gpu tests/gpu/test_codec_kernels.py tests/unit/layout/test_moments_int8.py \
  -q -rs -p no:cacheprovider 2>&1 | tail -25 | cut -c1-300
timeout -k 10 ${LIMIT:-240} python3 bench/update_profile.py --params ${PARAMS:-1.0B} --variants down,torchcodec \
  --host-budget 30GiB --json $OUT/update_profile.json 2>&1 | grep -v USDT | cut -c1-600
echo "rc=$?"
