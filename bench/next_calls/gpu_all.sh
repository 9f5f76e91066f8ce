#!/usr/bin/env bash
# Every CUDA test, in three calls of under 600 s each: `bash bench/next_calls/gpu_all.sh 1`, then `... 2`, `... 3`
# (timeout_s 600 each; no carry). Part 1: the GPU step's parity and link count, the KV cache against DynamicCache,
# the frameworks on an offloaded model under a cap, the offloaded model's own tests (about 560 s on an H200,
# twenty-ninth session); part 2: the split and 8-bit codes' kernels, the staged and under-backward paths (about
# 60 s); part 3: the gpu-marked tests outside tests/gpu (8-bit moments on CUDA, pinned pools, FSDP2 and accelerate
# on CUDA, the example's GPU budget).
# Run after any change to a path the CUDA tests cover. Prediction: all pass.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
case "${1:-1}" in
  1) files="tests/gpu/test_gpu.py tests/gpu/test_kv_cuda.py tests/gpu/test_offload_frameworks_cuda.py
            tests/gpu/test_offload_params_cuda.py" ;;
  2) files="tests/gpu/test_split_kernels.py tests/gpu/test_codec_kernels.py tests/gpu/test_staged_cuda.py
            tests/gpu/test_under_backward_cuda.py" ;;
  3) files="tests/unit tests/tools tests/acceptance" ;;
  *) echo "usage: $0 1|2|3" >&2; exit 2 ;;
esac
rm -rf /root/big_nvme  # what a run cut by an earlier call's limit left on the warm machine's disk
df -h /tmp | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
set -o pipefail
# shellcheck disable=SC2086
timeout -k 10 ${LIMIT:-580} python3 -m pytest -m gpu $files -v -rs --durations=25 -p no:cacheprovider 2>&1 \
  | tee $OUT/gpu_part$1.log | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^[0-9.]+s " | cut -c1-240
echo "rc=$?"
