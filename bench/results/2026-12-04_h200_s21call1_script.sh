#!/usr/bin/env bash
# Issue 29 (carry [".anchors"]; timeout_s 480; written in the twentieth session; ran as the twenty-first session's call 1, whose raw output was not kept). The fix of the
# offloaded gradient copies' race (offload_accumulation._keep_until_copied: FSDP2's reduced gradients recorded on
# the hook's stream) checked with the window held wide on purpose (a GPU sleep in each hook): the CUDA test, then
# the same test with the keep patched out, which must fail (or the test cannot fail), then the offloaded CUDA tests
# of the frameworks; then the CUDA tests of what the session's stream-lifetime audit changed (records staged again,
# the KV cache's serial twin, loads' parameter writes) and the sums kept on the GPU within backward_room (the first
# backward keeps none). Prediction: passed; failed; passed; passed.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
T=tests/gpu/test_offload_params_cuda.py::test_a_slow_copy_down_never_reads_another_blocks_gradients
say fixed
timeout -k 5 90 python3 -m pytest -m gpu -q -p no:cacheprovider $T > $OUT/fixed.log 2>&1; echo "fixed rc=$?"
tail -1 $OUT/fixed.log
say mutant
timeout -k 5 90 python3 -c "import sys, pytest, tiered.offload_accumulation as a; a._keep_until_copied = lambda t: None
sys.exit(pytest.main(['-m', 'gpu', '-q', '-p', 'no:cacheprovider', sys.argv[1]]))" $T > $OUT/mutant.log 2>&1
echo "mutant rc=$? (1: failed, as it must)"; grep "assert\|passed\|failed" $OUT/mutant.log | tail -3 | cut -c1-200
say frameworks
timeout -k 5 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_offload_frameworks_cuda.py \
  > $OUT/frameworks.log 2>&1; echo "frameworks rc=$?"; tail -1 $OUT/frameworks.log
say audit
timeout -k 5 160 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_staged_cuda.py tests/gpu/test_kv_cuda.py \
  tests/gpu/test_offload_params_cuda.py::test_the_last_micro_batchs_sums_left_on_the_gpu_clip_and_update_bitwise \
  tests/gpu/test_offload_params_cuda.py::test_the_first_backward_keeps_no_sums_and_measures_what_a_pass_takes \
  > $OUT/audit.log 2>&1; echo "audit rc=$?"; tail -1 $OUT/audit.log
say done
