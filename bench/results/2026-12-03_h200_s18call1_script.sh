#!/usr/bin/env bash
# Issue 29, "the GPU stays busy" (timeout_s 480; written in the seventeenth session, not yet run): compute alone for
# the two models measured under the 24 GB cap, their forward and backward with the whole model on the GPU and
# nothing moved, timed at layer counts that fit and extrapolated (bench/compute_alone.py), no cap (compute does not
# depend on it). Our steps to set beside it: the 4.42B at 4 x 2048 x 8, 8.81-8.89 s (forward and backward
# 7.31-7.33 s; seventeenth session); the 10.0B at 4 x 2048 x 8, 64.4-64.7 s (forward and backward 16.9-17.0 s; tenth).
# Prediction: the 4.42B's 65,536 tokens with recompute take about 8 x 4.42e9 x 65,536 = 2.3 PFLOP of GEMMs and 0.2
# of attention: 4.3-5.1 s at 500-600 TFLOP/s; so its step is 1.7-2.1x compute alone (target 1.25x) and its forward
# and backward 1.4-1.7x (the weights and gradients crossing PCIe under it, and FSDP2's per-block waits). The 10.0B:
# 9.5-11.5 s, its step disk-bound at 5.6-6.8x.
# Then one step of the offloaded 4.42B (2 micro-batches) under torch.profiler (examples/big_model.py --trace,
# bench/step_timeline.py): how much of it any kernel ran. Prediction: its forward and backward (about 1.8 s
# unprofiled) 60-70 % kernel-busy; the copies busy most of it.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say "compute alone, 4.42B"
timeout -k 5 130 python3 bench/compute_alone.py --hidden 3200 --layers 34 --heads 32 --inter 8640 --seq 2048 \
  --batch 4 --accumulate 8 --fit-layers 4,8,12 --steps 2 --json $OUT/compute44.json 2>&1 | grep -v Warn | tail -5
say "compute alone, 10.0B"
timeout -k 5 130 python3 bench/compute_alone.py --hidden 4096 --layers 48 --heads 32 --inter 11008 --seq 2048 \
  --batch 4 --accumulate 8 --fit-layers 4,8 --steps 2 --json $OUT/compute100.json 2>&1 | grep -v Warn | tail -5
say "the 4.42B offloaded, one step profiled (2 micro-batches: a trace of 8 would run to gigabytes)"
timeout -k 5 200 python3 examples/big_model.py --hidden 3200 --layers 34 --heads 32 --inter 8640 --seq 2048 \
  --gpu-memory-cap 24GB --steps 1 --batch 4 --accumulate 2 --nvme-path /root/big_nvme --trace /root/trace44.json \
  > $OUT/trace44.log 2>&1; echo "rc=$?"; grep -v '^{' $OUT/trace44.log | grep "step\|profiled" | tail -4 | cut -c1-200
python3 bench/step_timeline.py /root/trace44.json --step step > $OUT/timeline44.json; echo "timeline rc=$?"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('step_ms','kernels_busy_ms',
'copies_busy_ms','backward','opt.step','compute_stream','gpu_after_backward_ms')})" $OUT/timeline44.json | cut -c1-600
rm -rf /root/big_nvme /root/trace44.json
say done
