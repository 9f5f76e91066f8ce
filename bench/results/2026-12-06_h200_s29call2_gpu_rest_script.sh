#!/usr/bin/env bash
# Twenty-ninth session, call 2: the CUDA tests call 1 (gpu_all.sh) reached no time for, on the same warm machine.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; timeout -k 5 280 python3 -m pytest -m gpu tests/gpu/test_staged_cuda.py tests/gpu/test_under_backward_cuda.py -v -rs --durations=15 -p no:cacheprovider 2>&1 | tee $OUT/gpu_rest.log | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^[0-9.]+s " | cut -c1-200
