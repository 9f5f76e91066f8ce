#!/usr/bin/env bash
# Ran as the twenty-fourth session's call 4 (bench/RESULTS.md).
# Issue 29 (timeout_s 600; twenty-fourth session): ours on the 4.42B under a 12 GB cap at 2 x 2048 x 16, where
# DeepSpeed trains it only with its weights offloaded too (offload_param cpu: 3,274-3,622 tokens/s, 112.6 GiB of
# RAM, this session's call 2); then the CUDA tests of the kept sums and the clip.
# Prediction: trains, 6,000-7,000 tokens/s (the 3.43B ran 6,461-6,714 there, the 4.42B 7,095-7,451 under 16 GB
# at 4 x 2048), peak GPU under 11 GiB, 1.7-2.1x DeepSpeed's.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say "ours 12GB_4.42B (12GB, 2 x 2048 x 16)"
timeout -k 5 200 python3 examples/big_model.py --hidden 3200 --heads 32 --inter 8640 --seq 2048 --steps 3 \
  --layers 34 --batch 2 --accumulate 16 --gpu-memory-cap 12GB --nvme-path /root/big_nvme \
  --json $OUT/ours_12GB_4.42B.jsonl > $OUT/ours_12GB_4.42B.log 2>&1; echo "ours rc=$?"
grep "^step \|gradients on the GPU\|peak\|first step\|Error" $OUT/ours_12GB_4.42B.log | tail -12 | cut -c1-260
rm -rf /root/big_nvme
say "CUDA tests of the kept sums and the clip"
timeout -k 5 300 python3 -m pytest -q -m gpu tests/gpu/test_offload_params_cuda.py -k "backwards or clips" \
  > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -5 $OUT/pytest.log
say done
