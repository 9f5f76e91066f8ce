#!/usr/bin/env bash
# Issues 29 and the KV cache (timeout_s 360; written in the twenty-seventh and twenty-eighth sessions, not yet
# run). The CUDA tests of what was changed on the CPU since the last GPU call, each bitwise the run on the GPU: (1) evaluations under no_grad before the optimizer is
# built and between each backward and its step, streamed and with every block kept (tiered.offload.reshard: the
# weights such a forward gathers are dropped before the step, the state dicts or an optimizer read the
# parameters), and a backward that raised part-way, the batch skipped or the next micro-batch added to it (on the
# GPU machine's torch 2.11, without FSDP2's reset_iter_state: offload/failed_pass.py resets its fields one by one);
# (2) the optimizer's count of its link bytes (tiered/optim/link.py); (3) the frameworks' CUDA runs
# (HF Trainer, accelerate, Lightning on an offloaded model); (4) the KV cache's CUDA tests, after its lock, its
# updates outside inference mode and its deferred write errors (twenty-eighth session), against DynamicCache.
# Prediction: all pass; (1) takes 60-120 s.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say "evaluations"
timeout -k 5 150 python3 -m pytest -q -m gpu tests/gpu/test_offload_params_cuda.py -k "evaluations or raised" \
  -p no:cacheprovider 2>&1 | tail -4
say "the link's count"
timeout -k 5 60 python3 -m pytest -q -m gpu tests/gpu/test_gpu.py -k "link" -p no:cacheprovider 2>&1 | tail -4
say "the KV cache"
timeout -k 5 90 python3 -m pytest -q -m gpu tests/gpu/test_kv_cuda.py -p no:cacheprovider 2>&1 | tail -4
say "the frameworks"
timeout -k 5 $((350 - SECONDS)) python3 -m pytest -q -m gpu tests/gpu/test_offload_frameworks_cuda.py \
  -p no:cacheprovider 2>&1 | tail -4
say done
