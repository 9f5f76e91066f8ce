#!/usr/bin/env bash
# Issue 29 (carry [".anchors"]; timeout_s 600; nineteenth session's call 2). An offloaded model's later
# micro-batches' gradients added to the held ones on the GPU, in FSDP2's reduced gradients before they come down
# (tiered/offload_accumulation.py SUM_ON_DEVICE), the worker only moving the sums into their homes; A/B in one
# call against the worker's bf16 additions (SUM_ON_DEVICE=False, as before), the 4.42B under a 24 GB cap.
# Call 1 of this session (a slower host than the eighteenth session's) had the worker busy 7.6 s a step (4.8 there)
# and forward and backward 8.2-9.6 s (6.3 there). Prediction: worker_s a step 1/3 of the worker's A figure or less
# (copies, about 3x cheaper an element than bf16 additions on the CPU), end_wait_s under 0.1 s a step, forward and
# backward within 0.3 s of the eighteenth session's 6.3 s whatever the host; the optimizer unchanged (1.43 s).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say gpu_tests
timeout -k 5 230 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_offload_params_cuda.py \
  -k "kept_from_forward or bf16" > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?"; tail -4 $OUT/gpu_tests.log | cut -c1-300
C="--hidden 3200 --layers 34 --heads 32 --inter 8640 --seq 2048 --gpu-memory-cap 24GB --batch 4"
for mode in None False; do
  say "ours44 SUM_ON_DEVICE=$mode"
  timeout -k 5 120 python3 -c "import sys, runpy, tiered.offload_accumulation as a; a.SUM_ON_DEVICE = eval(sys.argv[1]);
sys.argv = ['examples/big_model.py', *sys.argv[2:]]; runpy.run_path('examples/big_model.py', run_name='__main__')" \
    $mode $C --steps 3 --accumulate 8 --nvme-path /root/big_nvme --json $OUT/big44_$mode.jsonl > $OUT/big44_$mode.log 2>&1
  echo "rc=$?"; grep "^step \|gradient sums\|peak GPU" $OUT/big44_$mode.log | tail -6 | cut -c1-260
  rm -rf /root/big_nvme
done
say done
