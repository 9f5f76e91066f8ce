#!/usr/bin/env bash
# The CUDA tests nearest a change, in one call of under 400 s (timeout_s 420; no carry), for a session whose
# device time cannot hold gpu_all.sh's two parts: the step's parity (test_gpu.py), the KV cache on CUDA, the
# split kernels and the staged and under-backward paths (gpu_all.sh's part 2), and of the offloaded model's
# tests those of a failed pass, of training under a cap, of evaluations and of a resume. Prediction: all pass.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
rm -rf /root/big_nvme
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
set -o pipefail
# Two processes, in gpu_all.sh's order (its part 1's files, then part 2's): in one process after part 2's tests, the
# capped plain bf16 run that test_offloaded_run_on_cuda..._cannot_fit expects to run out of memory completed once
# (thirty-fifth session, bench/RESULTS.md), which gpu_all.sh's part 1 had never seen.
timeout -k 10 ${LIMIT:-330} python3 -m pytest -m gpu tests/gpu/test_gpu.py tests/gpu/test_kv_cuda.py \
  tests/gpu/test_offload_params_cuda.py -k "not test_offload_params_cuda or raised_part_way or cannot_fit \
  or evaluations or resume or one_units" -v -rs --durations=15 -p no:cacheprovider 2>&1 \
  | tee $OUT/gpu_focus1.log | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^[0-9.]+s " | cut -c1-240
echo "rc=$?"
timeout -k 10 60 python3 -m pytest -m gpu tests/gpu/test_split_kernels.py tests/gpu/test_staged_cuda.py \
  tests/gpu/test_under_backward_cuda.py -v -rs -p no:cacheprovider 2>&1 \
  | tee $OUT/gpu_focus2.log | grep -E "FAILED|ERROR|passed|failed" | cut -c1-240
echo "rc=$?"
