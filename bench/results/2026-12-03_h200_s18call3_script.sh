#!/usr/bin/env bash
# Issue 29 (timeout_s 480; written in the eighteenth session): the offloaded model's next block of weights copied
# ahead (tiered/offload_prefetch.py). The profiled step of the seventeenth session's code (eighteenth session,
# call 2) put every block's weight upload on the compute stream: FSDP2 at world size 1 copies each block's
# weights to the GPU in wait_for_unshard, in line with the kernels, 17.6 GB at 54 GB/s in 322 ms over its two
# micro-batches, while the gradients went down on a stream of their own. Compute alone is 5.82 s
# (bench/compute_alone.py, call 1); forward and backward 7.31 s.
# Prediction: forward and backward 6.0-6.2 s (8 x 160 ms of in-line copies come off the compute stream, the first
# block's of each pass and the device-to-device copy stay), the step 7.5-7.7 s, 8,500-8,740 tokens/s; in the
# profiled step no host-to-device copy before the optimizer on the compute stream, 17.5 GB on the prefetch stream.
# Part 1: the CUDA tests of the offloaded runs (bitwise the run on the GPU, with the prefetch's hits asserted).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say gpu_tests
timeout -k 5 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_offload_params_cuda.py \
  -k "bf16 or kept" > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?"; tail -4 $OUT/gpu_tests.log | cut -c1-300
C="--hidden 3200 --layers 34 --heads 32 --inter 8640 --seq 2048 --gpu-memory-cap 24GB --batch 4"
say ours44
timeout -k 5 170 python3 examples/big_model.py $C --steps 3 --accumulate 8 --nvme-path /root/big_nvme \
  --json $OUT/big44.jsonl > $OUT/big44.log 2>&1; echo "ours rc=$?"; grep -v '^{' $OUT/big44.log | tail -14 | cut -c1-300
rm -rf /root/big_nvme
say trace44
timeout -k 5 130 python3 examples/big_model.py $C --steps 1 --accumulate 2 --nvme-path /root/big_nvme \
  --trace /root/trace44.json > $OUT/trace44.log 2>&1; echo "trace rc=$?"
python3 bench/step_timeline.py /root/trace44.json --step step > $OUT/timeline44.json; echo "timeline rc=$?"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({k: d.get(k) for k in ('step_ms',
'until_opt_ms','kernels_busy_ms','copies')}))" $OUT/timeline44.json | cut -c1-1500
rm -rf /root/big_nvme /root/trace44.json
say done
