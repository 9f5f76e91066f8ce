#!/usr/bin/env bash
# Issue 29 (timeout_s 420; written in the eighteenth session): the offloaded 4.42B's optimizer against the number
# of chunks in flight on the GPU (tiered/optim/device_update.py IN_FLIGHT: device records and gradient staging
# rows, 2 today), set per run from outside. Call 4: the optimizer 1.43 s for 58.9 GB up and 50.2 GB down, 42 and
# 36 GB/s, where the link carries about 54 GB/s a direction (FSDP2's copies in the same trace): not the link's
# rate, so the two-record pipeline's waits. Prediction: 3 in flight 1.20-1.30 s, 4 no better than 3.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
C="--hidden 3200 --layers 34 --heads 32 --inter 8640 --seq 2048 --gpu-memory-cap 24GB --steps 3 --batch 4 --accumulate 8"
for n in 3 2 4; do
  say "in flight $n"
  timeout -k 5 115 python3 -c "import sys, runpy, tiered.optim.device_update as d; d.IN_FLIGHT = int(sys.argv[1]);
sys.argv = ['examples/big_model.py', *sys.argv[2:]]; runpy.run_path('examples/big_model.py', run_name='__main__')" \
    $n $C --nvme-path /root/big_nvme --json $OUT/inflight$n.jsonl > $OUT/inflight$n.log 2>&1; echo "rc=$?"
  grep "^step \|optimizer:" $OUT/inflight$n.log | tail -4 | cut -c1-200
  rm -rf /root/big_nvme
done
say done
