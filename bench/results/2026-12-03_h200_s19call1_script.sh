#!/usr/bin/env bash
# Issue 29 (carry [".anchors"]; timeout_s 600; nineteenth session's call 1, on main with the branch
# offload-bits-upload merged; kept only if the CUDA tests pass). The offloaded model's split chunks' bf16 weights
# (their masters' high halves) go up on the upload stream into a bits row beside each gradient staging row
# (tiered/optim/device_update.py `_stage_grads`), no longer on the work stream in line with the copies down; and
# the chunks in flight (tiered.shares.CHUNKS_IN_FLIGHT: records, staging rows and the pipeline's window) at 2 and 3.
# The eighteenth session's call 2 had the optimizer's work stream busy 1,225 of 1,343 ms (980 ms of copies down,
# 163 of weights up, 83 of kernels). Prediction: the optimizer 1.10-1.20 s at 2 (1.43 in call 4), the step
# 7.40-7.50 s, 8,740-8,860 tokens/s; at 3 within 0.05 s of 2 or better; the profiled step's work stream ~1,065 ms.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say gpu_tests
timeout -k 5 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_offload_params_cuda.py \
  tests/gpu/test_gpu.py -k "offload or norm_copied or hbm" > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?"
tail -4 $OUT/gpu_tests.log | cut -c1-300
C="--hidden 3200 --layers 34 --heads 32 --inter 8640 --seq 2048 --gpu-memory-cap 24GB --batch 4"
for n in 2 3; do
  say "ours44 in flight $n"
  timeout -k 5 110 python3 -c "import sys, runpy, tiered.shares as s; s.CHUNKS_IN_FLIGHT = int(sys.argv[1]);
sys.argv = ['examples/big_model.py', *sys.argv[2:]]; runpy.run_path('examples/big_model.py', run_name='__main__')" \
    $n $C --steps 3 --accumulate 8 --nvme-path /root/big_nvme --json $OUT/big44_$n.jsonl > $OUT/big44_$n.log 2>&1
  echo "rc=$?"; grep "^step \|optimizer:\|peak GPU" $OUT/big44_$n.log | tail -5 | cut -c1-200
  rm -rf /root/big_nvme
done
say trace44
timeout -k 5 120 python3 examples/big_model.py $C --steps 1 --accumulate 2 --nvme-path /root/big_nvme \
  --trace /root/trace44.json > $OUT/trace44.log 2>&1; echo "trace rc=$?"
python3 bench/step_timeline.py /root/trace44.json --step step > $OUT/timeline44.json; echo "timeline rc=$?"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({k: d.get(k) for k in ('step_ms',
'until_opt_ms','kernels_busy_ms','copies')}))" $OUT/timeline44.json | cut -c1-1800
rm -rf /root/big_nvme /root/trace44.json
say done
