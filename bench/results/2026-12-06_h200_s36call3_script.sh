#!/usr/bin/env bash
# Thirty-sixth session, call 3 (run from the repository root, timeout_s 230, no carry): part 2 of gpu_all.sh and the
# capped bf16 yardstick test in ONE pytest process, the order in which that test failed in the thirty-fifth session.
export PYTHONPATH=$PWD; timeout -k 10 200 python3 -m pytest -m gpu tests/gpu/test_split_kernels.py tests/gpu/test_staged_cuda.py tests/gpu/test_under_backward_cuda.py tests/gpu/test_offload_params_cuda.py -k "split_kernel or join_params or staged or under_backward or cannot_fit" -q -p no:cacheprovider 2>&1 | tail -5 | tee $OUT/order.log
