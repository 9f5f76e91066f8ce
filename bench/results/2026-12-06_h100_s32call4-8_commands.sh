#!/usr/bin/env bash
# The thirty-second session's calls 4-8 (one warm H100, 168 s of device time in all), run inline from the repository
# root at b762697: the CUDA tests of the paths that session's fixes touched. Call 5 only compared md5 sums of
# tiered/kv/writes.py, window.py and optim/groups.py with this checkout's (the device's .git is a stale copy; its
# work tree is this one).
export PYTHONPATH=$PWD
timeout -k 5 150 python3 -m pytest -m gpu tests/gpu/test_kv_cuda.py -v -rs -p no:cacheprovider | tee $OUT/kv_cuda.log   # call 4
timeout -k 5 140 python3 -m pytest -m gpu tests/gpu/test_gpu.py -v -rs -p no:cacheprovider | tee $OUT/gpu_step.log    # call 6
timeout -k 5 120 python3 -m pytest -m gpu tests/gpu/test_split_kernels.py tests/gpu/test_staged_cuda.py \
  tests/gpu/test_under_backward_cuda.py -q -rs -p no:cacheprovider | tee $OUT/gpu_part2.log                          # call 7
timeout -k 5 100 python3 -m pytest -m gpu tests/gpu/test_offload_frameworks_cuda.py -v -rs -p no:cacheprovider \
  | tee $OUT/frameworks.log                                                                                          # call 8
