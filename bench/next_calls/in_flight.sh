#!/usr/bin/env bash
# Issue 29 (timeout_s 420; written in the eighteenth session, not yet run): the offloaded 4.42B's optimizer against
# the chunks in flight (tiered.shares.CHUNKS_IN_FLIGHT: the update's device records and gradient staging rows, and
# now also the pipeline's window, the chunks kept open at once; 2 by default), set per run from outside.
# Call 5 varied the records alone (2, 3, 4) under a window of 2: the optimizer stayed 1.42-1.49 s, for 58.9 GB up
# and 50.2 GB down (41 and 35 GB/s, where FSDP2's copies ran at 54). With two chunks open the host waits for chunk
# i's copies before it opens chunk i+2, so the link idles while the host launches the next.
# Prediction: 3 in flight 1.15-1.30 s, 4 within 0.05 s of 3; the step 7.45-7.60 s. A miss (1.43 s again) says the
# host's launches (update_s 0.35-0.66 s a step) are what holds it.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
C="--hidden 3200 --layers 34 --heads 32 --inter 8640 --seq 2048 --gpu-memory-cap 24GB --steps 3 --batch 4 --accumulate 8"
for n in 3 2 4; do
  say "in flight $n"
  timeout -k 5 115 python3 -c "import sys, runpy, tiered.shares as s; s.CHUNKS_IN_FLIGHT = int(sys.argv[1]);
sys.argv = ['examples/big_model.py', *sys.argv[2:]]; runpy.run_path('examples/big_model.py', run_name='__main__')" \
    $n $C --nvme-path /root/big_nvme --json $OUT/inflight$n.jsonl > $OUT/inflight$n.log 2>&1; echo "rc=$?"
  grep "^step \|optimizer:" $OUT/inflight$n.log | tail -4 | cut -c1-200
  rm -rf /root/big_nvme
done
say done
